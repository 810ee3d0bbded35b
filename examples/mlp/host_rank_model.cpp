#include <algorithm>
#include <optional>
#include <vector>

#include "examples/mlp/rank_model.hpp"
#include "kernels/cpu/elementwise.hpp"

namespace shardflow::mlp {
namespace {

// Model on the CPU. Mixed precision: the registered storage is 16-bit; `model` computes in fp32
// copies of it, and its fp32 gradients are added into the runtime's 16-bit gradient buffers when
// complete.
class HostRankModel final : public RankModel {
 public:
  HostRankModel(Model& model, const TrainOptions& opt)
      : model_(model), pdt_(opt.param_dtype), half_(pdt_ != DType::f32), prefetch_(opt.runtime.zero.forward_prefetch), freeze_(opt.freeze) {
    if (!opt.optimizer_in_runtime) optim_.emplace(opt.optimizer);
  }

  void attach(Runtime& rt) override {
    for (std::size_t i = 0; i < model_.layers().size(); ++i) {
      auto& l = model_.layers()[i];
      for (bool bias : {false, true}) {
        auto& v = bias ? l.bias : l.weight;
        void* data = v.data();
        if (half_) {
          store_.emplace_back(v.size());
          kernels::convert_from_f32(pdt_, store_.back().data(), v.data(), v.size());
          kernels::convert_to_f32(pdt_, v.data(), store_.back().data(), v.size());  // start from what 16 bits hold
          scratch_.emplace_back(v.size());
          data = store_.back().data();
        }
        const Shape shape = bias ? Shape{l.out} : Shape{l.out, l.in};
        ParamSpec spec{Model::param_name(int(i), bias), shape, pdt_, Device::cpu(), data};
        spec.requires_grad = std::find(freeze_.begin(), freeze_.end(), spec.name) == freeze_.end();
        // A frozen parameter's gradient is still computed by backward, into a buffer of its own, and dropped.
        dropped_.emplace_back(spec.requires_grad ? 0 : v.size());
        handles_.push_back(rt.register_param(spec));
      }
    }
  }

  float micro_batch(Runtime& rt, const float* x, const float* y, int rows, double denom) override {
    // Forward prefetch: a layer's parameters may still be arriving; wait for them right before use.
    std::function<void(int)> before_layer;
    if (prefetch_)
      before_layer = [&](int i) {
        rt.wait_param(handles_[std::size_t(2 * i)]);
        rt.wait_param(handles_[std::size_t(2 * i + 1)]);
        refresh_layer(std::size_t(i));
      };
    auto grad_slot = [&](int l, bool b) -> float* {
      const auto k = std::size_t(2 * l + b);
      if (!dropped_[k].empty()) return std::fill(dropped_[k].begin(), dropped_[k].end(), 0.0f), dropped_[k].data();
      if (!half_) return rt.grad_f32(handles_[k]);
      std::fill(scratch_[k].begin(), scratch_[k].end(), 0.0f);
      return scratch_[k].data();
    };
    auto grad_done = [&](int l, bool b) {
      const auto k = std::size_t(2 * l + b);
      if (!dropped_[k].empty()) return;  // frozen
      if (half_) accumulate_16bit(rt, k);
      rt.grad_ready(handles_[k]);
    };
    float loss;
    {
      auto span = rt.span("forward", "forward");
      loss = model_.forward(x, y, rows, before_layer);
    }
    auto span = rt.span("backward", "backward");
    model_.backward(y, denom, grad_slot, grad_done);
    return loss;
  }

  void after_step(Runtime& rt, int) override {
    if (!prefetch_)
      for (std::size_t i = 0; i < model_.layers().size(); ++i) refresh_layer(i);
    if (!optim_) return;
    auto span = rt.span("trainer's optimizer step", "step");
    for (std::size_t i = 0; i < model_.layers().size(); ++i) {
      auto& l = model_.layers()[i];
      if (dropped_[2 * i].empty()) optim_->step(l.weight.data(), rt.grad_f32(handles_[2 * i]), l.weight.size(), 2 * i);
      if (dropped_[2 * i + 1].empty()) optim_->step(l.bias.data(), rt.grad_f32(handles_[2 * i + 1]), l.bias.size(), 2 * i + 1);
    }
    optim_->end_step();
  }

  void finish(Runtime&, Model& host) override {
    for (std::size_t i = 0; i < model_.layers().size(); ++i) refresh_layer(i);
    if (&host != &model_) host = model_;
  }

 private:
  // The runtime updated the 16-bit storage: the fp32 copies anew.
  void refresh_layer(std::size_t i) {
    if (!half_) return;
    auto& l = model_.layers()[i];
    kernels::convert_to_f32(pdt_, l.weight.data(), store_[2 * i].data(), l.weight.size());
    kernels::convert_to_f32(pdt_, l.bias.data(), store_[2 * i + 1].data(), l.bias.size());
  }

  // Adds parameter k's fp32 gradient into its 16-bit bucket slot (autograd's accumulation),
  // rounding once: scratch += bucket, then back into the bucket.
  void accumulate_16bit(Runtime& rt, std::size_t k) {
    auto* g = static_cast<std::uint16_t*>(rt.grad(handles_[k]));
    auto& sc = scratch_[k];
    for (std::size_t e = 0; e < sc.size(); ++e) {
      float have;
      kernels::convert_to_f32(pdt_, &have, g + e, 1);
      sc[e] += have;
    }
    kernels::convert_from_f32(pdt_, g, sc.data(), sc.size());
  }

  Model& model_;
  const DType pdt_;
  const bool half_, prefetch_;
  std::vector<std::vector<std::uint16_t>> store_;  // [2*layer + bias], 16-bit parameters
  std::vector<std::vector<float>> scratch_;        // fp32 gradients before they go into the bucket
  std::vector<Param> handles_;                     // [2*layer + bias]
  const std::vector<std::string> freeze_;          // --freeze
  std::vector<std::vector<float>> dropped_;        // [2*layer + bias]: a frozen parameter's gradient (empty: trainable)
  std::optional<Optimizer> optim_;                 // the trainer's own, when the runtime has none
};

}  // namespace

std::unique_ptr<RankModel> make_host_rank_model(Model& model, const TrainOptions& opt) {
  return std::make_unique<HostRankModel>(model, opt);
}

}  // namespace shardflow::mlp
