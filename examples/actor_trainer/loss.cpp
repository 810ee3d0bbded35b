#include <caf/all.hpp>

#include "examples/actor_trainer/actors.hpp"
#include "kernels/cpu/elementwise.hpp"

namespace shardflow::actor_trainer {

caf::behavior loss(caf::stateful_actor<LossState>* self, const RankContext* ctx) {
  return {
      [=](targets_atom, BatchPtr& batch) { self->state.batch = std::move(batch); },
      [=](forward_atom, Activations& out, int rows) {
        const auto& opt = *ctx->opt;
        const auto& y = self->state.batch->y;
        const int classes = opt.sizes.back();
        // As mlp::train_steps: the gradient of this rank's mean, counted over the global batch.
        const double denom = double(opt.global_batch / ctx->world) * (opt.loss == mlp::Loss::mse ? classes : 1);
        auto dy = std::make_shared<std::vector<float>>(out->size());
        float value;
        if (opt.loss == mlp::Loss::cross_entropy) {
          value = kernels::softmax_xent_loss(out->data(), y.data(), rows, classes);
          kernels::softmax_xent_backward(out->data(), y.data(), dy->data(), rows, classes, denom);
        } else {
          value = kernels::mse_loss(out->data(), y.data(), out->size());
          kernels::mse_backward(out->data(), y.data(), dy->data(), dy->size(), denom);
        }
        self->send(ctx->trainer, loss_atom::value, value);
        self->send(ctx->layers.back(), backward_atom::value, Gradient(std::move(dy)));
      },
  };
}

}  // namespace shardflow::actor_trainer
