#include <caf/all.hpp>

#include "examples/actor_trainer/actors.hpp"

namespace shardflow::actor_trainer {

namespace {
BatchPtr make_batch(const RankContext& ctx, int step) {
  const auto& opt = *ctx.opt;
  auto b = std::make_shared<Batch>();
  b->step = step;
  b->rows = opt.global_batch / ctx.world;
  mlp::local_batch(*ctx.data, step, opt.global_batch, ctx.world, ctx.rank, b->x, b->y);
  return b;
}
}  // namespace

caf::behavior data_loader(caf::stateful_actor<LoaderState>* self, const RankContext* ctx) {
  return {
      [=](batch_atom, int step) -> BatchPtr {
        auto& ready = self->state.ready;
        auto it = ready.find(step);
        BatchPtr b = it != ready.end() ? it->second : make_batch(*ctx, step);
        ready.erase(ready.begin(), ready.upper_bound(step));
        // The next step's rows, while this one computes: a message to itself, so the answer goes first.
        self->send(self, batch_atom::value, step + 1, true);
        return b;
      },
      [=](batch_atom, int step, bool) {
        if (step < ctx->opt->steps && !self->state.ready.count(step)) self->state.ready.emplace(step, make_batch(*ctx, step));
      },
  };
}

}  // namespace shardflow::actor_trainer
