#include <caf/all.hpp>

#include "examples/actor_trainer/actors.hpp"
#include "kernels/cpu/elementwise.hpp"
#include "kernels/cpu/linear.hpp"

namespace shardflow::actor_trainer {

namespace {

// Asks the rank actor the same question for the weight and the bias at once, and runs `then` with
// both answers: two round trips to the rank actor's thread in parallel rather than in a row.
template <class Reply, class Ask, class Then>
void both(caf::stateful_actor<LayerState>* self, const RankContext* ctx, int index, Ask ask, Then then) {
  auto answers = std::make_shared<std::pair<std::optional<Reply>, std::optional<Reply>>>();
  auto fail = [=](caf::error& e) { self->send(ctx->trainer, failed_atom::value, e); };
  for (bool bias : {false, true}) {
    auto got = [=](Reply r) {
      (bias ? answers->second : answers->first) = std::move(r);
      if (answers->first && answers->second) then(*answers->first, *answers->second);
    };
    ask(ctx->params[std::size_t(2 * index + bias)], got, fail);
  }
}

}  // namespace

caf::behavior layer(caf::stateful_actor<LayerState>* self, const RankContext* ctx, int index) {
  auto& l = ctx->model->layers()[std::size_t(index)];
  const bool last = index + 2 == int(ctx->opt->sizes.size());
  auto forward = [=, &l](Activations in, int rows) {
    auto& st = self->state;
    auto out = std::make_shared<std::vector<float>>(std::size_t(rows) * std::size_t(l.out));
    {
      auto span = ctx->rt->span("forward " + mlp::Model::param_name(index, false), "forward");
      kernels::linear_forward(in->data(), l.weight.data(), l.bias.data(), out->data(), rows, l.in, l.out);
      if (!last) kernels::relu_forward(out->data(), out->data(), out->size());
    }
    st.in = std::move(in);
    st.rows = rows;
    self->send(last ? ctx->loss : ctx->layers[std::size_t(index) + 1], forward_atom::value, Activations(out), rows);
  };
  return {
      [=](forward_atom, Activations& in, int rows) {
        if (!ctx->prefetch) return forward(std::move(in), rows);
        // Forward prefetch: the update of this layer's parameters may still be on its way.
        both<Param>(
            self, ctx, index,
            [=](Param p, auto got, auto fail) {
              self->request(ctx->runtime, caf::infinite, rank_api::params_ready_atom::value, p)
                  .then([=](rank_api::params_ready_atom, Param q) { got(q); }, fail);
            },
            [=, in = std::move(in)](Param, Param) { forward(in, rows); });
      },
      [=, &l](backward_atom, Gradient& dy) {
        both<GradSlot>(
            self, ctx, index,
            [=](Param p, auto got, auto fail) {
              self->request(ctx->runtime, caf::infinite, rank_api::grad_atom::value, p).then([=](GradSlot g) { got(g); }, fail);
            },
            [=, &l, dy = std::move(dy)](GradSlot w, GradSlot b) {
              auto& st = self->state;
              Gradient dx;
              {
                auto span = ctx->rt->span("backward " + mlp::Model::param_name(index, false), "backward");
                if (index > 0) dx = std::make_shared<std::vector<float>>(std::size_t(st.rows) * std::size_t(l.in));
                kernels::linear_backward(st.in->data(), l.weight.data(), dy->data(), static_cast<float*>(w.data),
                                         static_cast<float*>(b.data), dx ? dx->data() : nullptr, st.rows, l.in, l.out);
              }
              // Reported the moment they are complete: the runtime reduces them while the layers
              // below compute.
              self->send(ctx->runtime, rank_api::grad_ready_atom::value, w.param);
              self->send(ctx->runtime, rank_api::grad_ready_atom::value, b.param);
              if (index == 0) {
                self->send(ctx->trainer, backward_done_atom::value);
              } else {
                kernels::relu_backward(st.in->data(), dx->data(), dx->data(), dx->size());  // the input is layer i-1's ReLU output
                self->send(ctx->layers[std::size_t(index) - 1], backward_atom::value, dx);
              }
              st.in.reset();
            });
      },
  };
}

}  // namespace shardflow::actor_trainer
