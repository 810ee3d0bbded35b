// The per-parameter optimizer a trainer runs after Runtime::wait() (ZeRO stage 0: every rank
// steps every parameter on the averaged gradients). Numerics follow torch.optim's defaults.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace shardflow {

struct OptimizerConfig;

// Note [Step rules]
// Bring your own optimizer: a rule the shard runs on the pieces it owns, in
// place of SGD / Adam. It keeps up to two fp32 state tensors per element, named by state_names()
// (zero at the start; checkpoints carry them as optim.<param>.<name>, and they migrate and reshard
// like Adam's). update() gets fp32 values: the parameter (or its fp32 master), the reduced
// gradient (unscaled and clipped already), the state, this parameter's own step count from 1, and
// the group's hyper-parameters (lr, betas, eps, weight_decay, momentum: any may change between
// iterations). Pieces of one parameter may be split over ranks (the flat partition): a rule that
// needs whole-tensor quantities (LAMB's trust ratio) wants the param partition. Host shards.
struct StepArgs {
  float* param;
  const float* grad;
  float* state[2];  // state_names().size() of them; the rest null
  std::size_t n;
  std::int64_t step;
  const OptimizerConfig& hyper;
  const std::string& param_name;
  std::size_t offset;  // of param[0] within the parameter
};
class StepRule {
 public:
  virtual ~StepRule() = default;
  virtual std::string name() const = 0;
  virtual std::vector<std::string> state_names() const = 0;  // at most two
  virtual void update(const StepArgs& a) const = 0;
};

struct OptimizerConfig {
  enum class Kind { sgd, adam, adamw, custom };
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
  // Kind::custom: the rule that steps (StepRule).
  std::shared_ptr<const StepRule> rule;

  static Kind parse_kind(const std::string& s);  // "sgd", "adam", "adamw"
  float effective_weight_decay() const;
  void validate() const;  // UsageError naming the bad field
};

// One update of n elements by `h`'s rule: the mapping onto the kernels that the trainer-side
// Optimizer and the ZeRO shard share. state0: momentum buffer (SGD, may be null without momentum)
// or exp_avg; state1: exp_avg_sq (Adam). `first`: torch seeds the momentum buffer with the first
// gradient; `step`: Adam's bias-correction step, counting from 1. `from`: what the update reads
// when it is not where it writes (all null: in place), overlapping none of what it writes: Adam
// reads it directly, the other rules step a copy of it.
struct UpdateFrom {
  const float* param = nullptr;
  const float* state0 = nullptr;
  const float* state1 = nullptr;
};
void apply_update(const OptimizerConfig& h, float* param, const float* grad, float* state0, float* state1,
                  std::size_t n, bool first, std::int64_t step, const std::string& param_name = "", std::size_t offset = 0,
                  const UpdateFrom& from = {});

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
