#include <caf/all.hpp>

#include <limits>

#include "examples/actor_trainer/actors.hpp"

namespace shardflow::actor_trainer {

namespace {

using Self = caf::stateful_actor<RankTrainerState>*;

void fail(Self self, const caf::error& e) {
  auto& st = self->state;
  if (std::exchange(st.failed, true)) return;  // the first error is the cause
  if (st.run.pending()) st.run.deliver(e);
}

// Reports in step order: those up to the newest reduced step, and after it those no pending
// reduction holds back.
void report(Self self, const RankContext* ctx) {
  auto& st = self->state;
  const int next_pending = st.in_flight.empty() ? std::numeric_limits<int>::max() : st.in_flight.front();
  std::size_t n = 0;
  for (; n < st.held.size() && st.held[n].step < next_pending; ++n) {
    st.held[n].loss = st.last_global;
    if (ctx->opt->on_step) ctx->opt->on_step(st.held[n]);
  }
  st.held.erase(st.held.begin(), st.held.begin() + std::ptrdiff_t(n));
}

void start_step(Self self, RankContext* ctx);

// After the last step: every update landed, every step's global loss, rank 0's results.
void finish(Self self, RankContext* ctx, mlp::TrainResult* result, std::size_t slot) {
  const auto& opt = *ctx->opt;
  auto fill = [=] {
    auto& st = self->state;
    result->memory_end[slot] = ctx->rt->memory_report();
    if (ctx->rank == 0) {
      if (opt.report_loss) result->losses = st.local_losses;
      if (ctx->data->test_rows > 0) {
        result->heldout_accuracy = ctx->model->accuracy(ctx->data->x_test.data(), ctx->data->y_test.data(), ctx->data->test_rows);
        result->heldout_rows = ctx->data->test_rows;
      }
      result->params = ctx->model->release_state_dict();
      result->buckets = ctx->rt->buckets();
      result->collectives = ctx->rt->collective_log();
      result->stats = ctx->rt->stats();
    }
    st.run.deliver(run_atom::value);
  };
  self->request(ctx->runtime, caf::infinite, rank_api::all_params_atom::value)
      .then(
          [=](rank_api::all_params_atom) {
            auto& st = self->state;
            // Every step's global loss in one collective at the end (the same sums as per step).
            if (opt.report_loss && opt.world_size > 1 && opt.loss_every > 1 && !st.local_losses.empty()) {
              self->request(ctx->runtime, caf::infinite, rank_api::collective_atom::value,
                            mlp::loss_allreduce(st.local_losses.data(), st.local_losses.size(), opt.world_size))
                  .then([=](rank_api::collective_atom, const std::string&) { fill(); }, [=](caf::error& e) { fail(self, e); });
            } else {
              fill();
            }
          },
          [=](caf::error& e) { fail(self, e); });
}

// The iteration is done: the step's loss (reduced every loss_every steps) and its report.
void end_step(Self self, RankContext* ctx, mlp::TrainResult* result, std::size_t slot) {
  auto& st = self->state;
  const auto& opt = *ctx->opt;
  const int step = st.step;
  st.local_losses.push_back(st.loss);
  const bool reduce_now = (step + 1) % std::max(1, opt.loss_every) == 0 || step + 1 == opt.steps;
  const bool reduces = opt.report_loss && opt.world_size > 1;
  if (!reduces) st.last_global = st.loss;
  if (reduces && reduce_now) {
    st.reduced[std::size_t(step)] = st.loss;
    st.in_flight.push_back(step);
    self->request(ctx->runtime, caf::infinite, rank_api::collective_atom::value, mlp::loss_allreduce(&st.reduced[std::size_t(step)], 1, opt.world_size))
        .then(
            [=](rank_api::collective_atom, const std::string&) {
              auto& st = self->state;
              st.last_global = st.reduced[std::size_t(step)];
              if (opt.loss_every <= 1) st.local_losses[std::size_t(step)] = st.last_global;  // already global
              st.in_flight.erase(st.in_flight.begin());
              report(self, ctx);
              if (st.in_flight.empty() && st.step == opt.steps) finish(self, ctx, result, slot);
            },
            [=](caf::error& e) { fail(self, e); });
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - st.t0).count();
  if (ctx->rank == 0) {
    if (opt.runtime.zero.clip_grad_norm > 0) result->grad_norms.push_back(ctx->rt->last_grad_norm());
    result->step_ms.push_back(ms);
    st.held.push_back(mlp::StepReport{step, st.last_global, ms, ctx->rt->last_stats()});
  }
  report(self, ctx);
  ++st.step;
  if (st.step < opt.steps)
    start_step(self, ctx);
  else if (st.in_flight.empty())
    finish(self, ctx, result, slot);
}

void start_step(Self self, RankContext* ctx) {
  auto& st = self->state;
  st.t0 = std::chrono::steady_clock::now();
  st.have_loss = st.have_backward = false;
  self->send(ctx->runtime, rank_api::zero_grad_atom::value);
  if (ctx->prefetch) self->send(ctx->layers.front(), prefetch_atom::value);  // the first layer's update, asked for before its input is ready
  self->request(ctx->loader, caf::infinite, batch_atom::value, st.step)
      .then(
          [=](BatchPtr batch) {
            self->send(ctx->loss, targets_atom::value, batch);
            self->send(ctx->layers.front(), forward_atom::value, Activations(batch, &batch->x), batch->rows);
          },
          [=](caf::error& e) { fail(self, e); });
}

}  // namespace

caf::behavior rank_trainer(caf::stateful_actor<RankTrainerState>* self, RankContext* ctx, mlp::TrainResult* result, std::size_t slot) {
  self->state.reduced.resize(std::size_t(std::max(0, ctx->opt->steps)));
  auto backward_over = [=] {
    auto& st = self->state;
    if (!st.have_loss || !st.have_backward || st.failed) return;
    self->request(ctx->runtime, caf::infinite, rank_api::iteration_atom::value)
        .then([=](rank_api::step_done_atom, std::uint64_t) { end_step(self, ctx, result, slot); }, [=](caf::error& e) { fail(self, e); });
  };
  return {
      [=](run_atom) {
        auto& st = self->state;
        st.run = self->make_response_promise();
        // Setup's collectives run on the rank actor's thread, never on a scheduler thread.
        const auto optimizer = ctx->opt->optimizer;
        self->request(ctx->runtime, caf::infinite, rank_api::call_atom::value, rank_api::RankCall{[=](Runtime& rt) {
                        rt.finalize();
                        rt.configure_optimizer(optimizer);
                        result->memory[slot] = rt.memory_report();
                      }})
            .then(
                [=](rank_api::call_atom) {
                  if (ctx->opt->steps > 0)
                    start_step(self, ctx);
                  else
                    finish(self, ctx, result, slot);
                },
                [=](caf::error& e) { fail(self, e); });
        return st.run;
      },
      [=](loss_atom, float value) {
        self->state.loss = value;
        self->state.have_loss = true;
        backward_over();
      },
      [=](backward_done_atom) {
        self->state.have_backward = true;
        backward_over();
      },
      [=](failed_atom, caf::error& e) { fail(self, e); },
  };
}

}  // namespace shardflow::actor_trainer
