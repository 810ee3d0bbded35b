// The per-parameter optimizer a trainer runs after Runtime::wait() (ZeRO stage 0: every rank
// steps every parameter on the averaged gradients). Numerics follow torch.optim's defaults.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace shardflow {

struct OptimizerConfig {
  enum class Kind { sgd, adam, adamw };
  Kind kind = Kind::sgd;
  float lr = 0.01f;
  // SGD
  float momentum = 0.0f;
  float dampening = 0.0f;
  bool nesterov = false;
  // Adam / AdamW (torch defaults: betas 0.9 / 0.999, eps 1e-8)
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  // L2 penalty for SGD and Adam, decoupled decay for AdamW. Negative: the torch default of the
  // kind (0, 0, 0.01).
  float weight_decay = -1.0f;

  static Kind parse_kind(const std::string& s);  // "sgd", "adam", "adamw"
  float effective_weight_decay() const;
  void validate() const;  // UsageError naming the bad field
};

// One update of n elements by `h`'s rule: the mapping onto the kernels that the trainer-side
// Optimizer and the ZeRO shard share. state0: momentum buffer (SGD, may be null without momentum)
// or exp_avg; state1: exp_avg_sq (Adam). `first`: torch seeds the momentum buffer with the first
// gradient; `step`: Adam's bias-correction step, counting from 1.
void apply_update(const OptimizerConfig& h, float* param, const float* grad, float* state0, float* state1,
                  std::size_t n, bool first, std::int64_t step);

class Optimizer {
 public:
  explicit Optimizer(OptimizerConfig cfg);
  // Updates param[0..n) from grad; `slot` identifies the parameter (its state lives there).
  void step(float* param, const float* grad, std::size_t n, std::size_t slot);
  // Marks the end of an optimizer step over all parameters (Adam's step counter advances).
  void end_step() { ++steps_; }
  const OptimizerConfig& config() const { return cfg_; }
  void set_lr(float lr) { cfg_.lr = lr; }
  std::size_t state_bytes() const;

 private:
  struct State {
    std::vector<float> a, b;  // momentum buffer, or exp_avg / exp_avg_sq
  };
  OptimizerConfig cfg_;
  std::int64_t steps_ = 0;
  std::vector<State> state_;
};

}  // namespace shardflow
