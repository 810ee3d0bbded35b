#include <caf/all.hpp>

#include <utility>

#include "examples/actor_trainer/actors.hpp"
#include "kernels/cpu/elementwise.hpp"
#include "kernels/cpu/linear.hpp"

namespace shardflow::actor_trainer {

void prefetch_layer(caf::event_based_actor* self, const RankContext* ctx, int index) {
  const std::vector<Param> params{ctx->params[std::size_t(2 * index)], ctx->params[std::size_t(2 * index + 1)]};
  self->request(ctx->runtime, caf::infinite, rank_api::params_ready_atom::value, params)
      .then([=](rank_api::params_ready_atom, const std::vector<Param>&) { self->send(ctx->layers[std::size_t(index)], params_landed_atom::value); },
            [=](caf::error& e) { self->send(ctx->trainer, failed_atom::value, e); });
}

caf::behavior layer(caf::stateful_actor<LayerState>* self, const RankContext* ctx, int index) {
  auto& l = ctx->model->layers()[std::size_t(index)];
  const bool last = index + 2 == int(ctx->opt->sizes.size());
  const Param weight = ctx->params[std::size_t(2 * index)], bias = ctx->params[std::size_t(2 * index + 1)];
  auto fail = [=](caf::error& e) { self->send(ctx->trainer, failed_atom::value, e); };
  auto forward = [=, &l](Activations in, int rows) {
    auto& st = self->state;
    // Forward prefetch: the next layer's update is asked for now, its answer on the way while this
    // layer computes (the runtime notes the next layer's first use a layer early).
    st.landed = false;
    if (ctx->prefetch && !last) prefetch_layer(self, ctx, index + 1);
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
        if (!ctx->prefetch || st.landed) return forward(std::move(in), rows);
        st.waiting = std::move(in);  // the parameters' update is still on its way
        st.rows = rows;
      },
      [=](params_landed_atom) {
        auto& st = self->state;
        st.landed = true;
        if (st.waiting) forward(std::exchange(st.waiting, nullptr), st.rows);
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
