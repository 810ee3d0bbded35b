#include <caf/all.hpp>

#include <utility>

#include "examples/actor_trainer/actors.hpp"
#include "kernels/cpu/elementwise.hpp"
#include "kernels/cpu/linear.hpp"

namespace shardflow::actor_trainer {

caf::behavior layer(caf::stateful_actor<LayerState>* self, const RankContext* ctx, int index) {
  auto& l = ctx->model->layers()[std::size_t(index)];
  const bool last = index + 2 == int(ctx->opt->sizes.size());
  const Param weight = ctx->params[std::size_t(2 * index)], bias = ctx->params[std::size_t(2 * index + 1)];
  auto fail = [=](caf::error& e) { self->send(ctx->trainer, failed_atom::value, e); };
  auto forward = [=, &l](Activations in, int rows) {
    auto& st = self->state;
    // Forward prefetch: the next layer asks for its update now, and has the answer in hand (it is
    // idle) while this layer computes; the runtime notes the next layer's first use a layer early.
    if (ctx->prefetch && !last) self->send(ctx->layers[std::size_t(index) + 1], prefetch_atom::value);
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
        auto& st = self->state;
        // The update may have landed while the rank actor's answer is still on its way: checked
        // here without a message, as the blocking wait_param does.
        if (!ctx->prefetch || st.landed || (st.landed = ctx->rt->params_ready({weight, bias}))) return forward(std::move(in), rows);
        st.waiting = std::move(in);  // the parameters' update is still on its way
        st.rows = rows;
      },
      [=](prefetch_atom) {
        // This step's update of the layer's parameters, asked for by the layer itself so that the
        // answer never queues behind a busy actor's compute; no message at all when it is in.
        auto& st = self->state;
        const auto generation = ++st.generation;
        st.landed = ctx->rt->params_ready({weight, bias});
        if (st.landed) return;
        self->request(ctx->runtime, caf::infinite, rank_api::params_ready_atom::value, std::vector<Param>{weight, bias})
            .then(
                [=](rank_api::params_ready_atom, const std::vector<Param>&) {
                  auto& st = self->state;
                  if (st.generation != generation) return;  // an earlier step's answer, already used
                  st.landed = true;
                  if (st.waiting) forward(std::exchange(st.waiting, nullptr), st.rows);
                },
                fail);
      },
      [=, &l](backward_atom, Gradient& dy) {
        // Both slots in one request (stage 2 may hold it until a bucket buffer is free).
        self->request(ctx->runtime, caf::infinite, rank_api::grad_atom::value, std::vector<Param>{weight, bias})
            .then(
                [=, &l, dy = std::move(dy)](const std::vector<GradSlot>& slots) {
                  auto& st = self->state;
                  Gradient dx;
                  {
                    auto span = ctx->rt->span("backward " + mlp::Model::param_name(index, false), "backward");
                    if (index > 0) dx = std::make_shared<std::vector<float>>(std::size_t(st.rows) * std::size_t(l.in));
                    kernels::linear_backward(st.in->data(), l.weight.data(), dy->data(), static_cast<float*>(slots[0].data),
                                             static_cast<float*>(slots[1].data), dx ? dx->data() : nullptr, st.rows, l.in, l.out);
                  }
                  // Reported the moment they are complete: the runtime reduces them while the
                  // layers below compute.
                  self->send(ctx->runtime, rank_api::grad_ready_atom::value, std::vector<Param>{weight, bias});
                  if (index == 0) {
                    self->send(ctx->trainer, backward_done_atom::value);
                  } else {
                    kernels::relu_backward(st.in->data(), dx->data(), dx->data(), dx->size());  // the input is layer i-1's ReLU output
                    self->send(ctx->layers[std::size_t(index) - 1], backward_atom::value, dx);
                  }
                  st.in.reset();
                },
                fail);
      },
  };
}

}  // namespace shardflow::actor_trainer
