// Optimizer updates over flat fp32 buffers, numerically following torch.optim (1.13, single-tensor
// path): the same operation order, so results match PyTorch to rounding.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shardflow::kernels {

struct SgdHyper {
  float lr = 0.01f;
  float momentum = 0.0f;
  float dampening = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
};

// momentum_buf may be null when momentum == 0. `first` marks the first step, where torch
// initialises the buffer with the gradient itself rather than decaying zeros.
void sgd_step(float* param, const float* grad, float* momentum_buf, std::size_t n, const SgdHyper& h,
              bool first);

struct AdamHyper {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  bool decoupled_weight_decay = false;  // AdamW
};

// `step` counts from 1 (bias correction). `param_in`, `exp_avg_in`, `exp_avg_sq_in`: what the
// step reads, when not the buffers it writes (all three, or null: in place), and overlapping none
// of them; the same arithmetic either way, so a step that keeps what it stepped from costs no
// copies beside it.
void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, std::size_t n,
               const AdamHyper& h, std::int64_t step, const float* param_in = nullptr, const float* exp_avg_in = nullptr,
               const float* exp_avg_sq_in = nullptr);

}  // namespace shardflow::kernels
