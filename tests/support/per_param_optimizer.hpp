// torch.optim's bookkeeping by hand, as the reference of the scenarios on unused and frozen
// parameters: each parameter its own state and its own step count, updated by the same rule the
// runtime uses (apply_update), so a scenario checks the runtime's bookkeeping, not the kernels.
#pragma once

#include <cstdint>
#include <vector>

#include "shardflow/optimizer.hpp"

namespace shardflow::test {

// AdamW with decoupled weight decay: the scenarios' optimizer.
inline OptimizerConfig adamw(float lr, float weight_decay) {
  OptimizerConfig oc;
  oc.kind = OptimizerConfig::Kind::adamw;
  oc.lr = lr;
  oc.weight_decay = weight_decay;
  return oc;
}

class PerParamOptimizer {
 public:
  PerParamOptimizer(OptimizerConfig oc, std::vector<std::vector<float>> params) : oc_(oc), param_(std::move(params)) {
    for (const auto& p : param_) {
      a_.emplace_back(p.size(), 0.0f);
      b_.emplace_back(p.size(), 0.0f);
    }
    own_.assign(param_.size(), 0);
  }
  // One step of parameter p on gradient g, with its own count (as torch.optim keeps it), by the
  // hyper-parameters `h` (the constructor's when null).
  void step(std::size_t p, const std::vector<float>& g, const OptimizerConfig* h = nullptr) {
    apply_update(h ? *h : oc_, param_[p].data(), g.data(), a_[p].data(), b_[p].data(), g.size(), own_[p] == 0, own_[p] + 1);
    ++own_[p];
  }
  // p's state goes (frozen): trained again, it starts afresh.
  void forget(std::size_t p) {
    std::fill(a_[p].begin(), a_[p].end(), 0.0f);
    std::fill(b_[p].begin(), b_[p].end(), 0.0f);
    own_[p] = 0;
  }
  const std::vector<std::vector<float>>& params() const { return param_; }

 private:
  OptimizerConfig oc_;
  std::vector<std::vector<float>> param_, a_, b_;
  std::vector<std::int64_t> own_;
};

}  // namespace shardflow::test
