#include "shardflow/optimizer.hpp"

#include <cmath>
#include <cstring>

#include "kernels/cpu/optim.hpp"
#include "runtime/zero/optimizer_hyper.hpp"
#include "shardflow/errors.hpp"

namespace shardflow {

OptimizerConfig::Kind OptimizerConfig::parse_kind(const std::string& s) {
  if (s == "sgd") return Kind::sgd;
  if (s == "adam") return Kind::adam;
  if (s == "adamw") return Kind::adamw;
  throw UsageError("unknown optimizer '" + s + "': expected sgd, adam or adamw");
}

const char* kind_name(OptimizerConfig::Kind k) {
  switch (k) {
    case OptimizerConfig::Kind::adam: return "adam";
    case OptimizerConfig::Kind::adamw: return "adamw";
    case OptimizerConfig::Kind::custom: return "custom";
    default: return "sgd";
  }
}

float OptimizerConfig::effective_weight_decay() const {
  if (weight_decay >= 0.0f) return weight_decay;
  return kind == Kind::adamw ? 0.01f : 0.0f;
}

void OptimizerConfig::validate() const {
  // Finite too: an infinite lr or eps would train into NaNs without a word.
  if (!(lr >= 0.0f) || !std::isfinite(lr)) throw UsageError("optimizer: lr must be finite and >= 0, got " + std::to_string(lr));
  if (!(momentum >= 0.0f) || !std::isfinite(momentum)) throw UsageError("optimizer: momentum must be finite and >= 0");
  if (!(weight_decay >= 0.0f || weight_decay == -1.0f) || !std::isfinite(weight_decay))
    throw UsageError("optimizer: weight_decay must be finite and >= 0 (or -1: torch's default for the kind), got " + std::to_string(weight_decay));
  if (!std::isfinite(dampening)) throw UsageError("optimizer: dampening must be finite");
  if (nesterov && (momentum <= 0.0f || dampening != 0.0f))
    throw UsageError("optimizer: nesterov needs momentum > 0 and dampening 0 (as in torch.optim.SGD)");
  if (!(beta1 >= 0.0f && beta1 < 1.0f)) throw UsageError("optimizer: beta1 must be in [0, 1)");
  if (!(beta2 >= 0.0f && beta2 < 1.0f)) throw UsageError("optimizer: beta2 must be in [0, 1)");
  if (!(eps >= 0.0f) || !std::isfinite(eps)) throw UsageError("optimizer: eps must be finite and >= 0");
  if (kind == Kind::custom && !rule) throw UsageError("optimizer: kind custom needs a StepRule (OptimizerConfig::rule)");
  if (kind == Kind::custom && rule->state_names().size() > 2)
    throw UsageError("optimizer: step rule '" + rule->name() + "' asks for " + std::to_string(rule->state_names().size()) +
                     " state tensors; the shard keeps at most two per element");
}

Optimizer::Optimizer(OptimizerConfig cfg) : cfg_(cfg) { cfg_.validate(); }

kernels::SgdHyper sgd_hyper(const OptimizerConfig& h) {
  return kernels::SgdHyper{h.lr, h.momentum, h.dampening, h.effective_weight_decay(), h.nesterov};
}

kernels::AdamHyper adam_hyper(const OptimizerConfig& h) {
  return kernels::AdamHyper{h.lr, h.beta1, h.beta2, h.eps, h.effective_weight_decay(),
                            h.kind == OptimizerConfig::Kind::adamw};
}

void apply_update(const OptimizerConfig& h, float* param, const float* grad, float* state0, float* state1,
                  std::size_t n, bool first, std::int64_t step, const std::string& param_name, std::size_t offset, const UpdateFrom& from) {
  const bool adam = h.kind != OptimizerConfig::Kind::custom && h.kind != OptimizerConfig::Kind::sgd;
  if (from.param && adam)  // reads the kept buffers and writes the new ones: no copies beside it
    return kernels::adam_step(param, grad, state0, state1, n, adam_hyper(h), step, from.param, from.state0, from.state1);
  if (from.param) {  // the other rules step in place: on copies of what they read
    std::memcpy(param, from.param, n * sizeof(float));
    if (state0 && from.state0) std::memcpy(state0, from.state0, n * sizeof(float));
    if (state1 && from.state1) std::memcpy(state1, from.state1, n * sizeof(float));
  }
  if (h.kind == OptimizerConfig::Kind::custom)
    h.rule->update(StepArgs{param, grad, {state0, state1}, n, step, h, param_name, offset});
  else if (h.kind == OptimizerConfig::Kind::sgd)
    kernels::sgd_step(param, grad, h.momentum != 0.0f ? state0 : nullptr, n, sgd_hyper(h), first);
  else
    kernels::adam_step(param, grad, state0, state1, n, adam_hyper(h), step);
}

void Optimizer::step(float* param, const float* grad, std::size_t n, std::size_t slot) {
  if (slot >= state_.size()) state_.resize(slot + 1);
  State& s = state_[slot];
  const bool first = s.a.empty();
  const std::size_t slots = cfg_.kind == OptimizerConfig::Kind::custom ? cfg_.rule->state_names().size()
                            : cfg_.kind != OptimizerConfig::Kind::sgd  ? 2
                                                                        : cfg_.momentum != 0.0f;
  if (first && slots >= 1) s.a.assign(n, 0.0f);
  if (s.b.empty() && slots >= 2) s.b.assign(n, 0.0f);
  apply_update(cfg_, param, grad, s.a.empty() ? nullptr : s.a.data(), s.b.empty() ? nullptr : s.b.data(), n, first,
               steps_ + 1);
}

std::size_t Optimizer::state_bytes() const {
  std::size_t b = 0;
  for (const auto& s : state_) b += (s.a.size() + s.b.size()) * sizeof(float);
  return b;
}

}  // namespace shardflow
