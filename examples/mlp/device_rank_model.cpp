#include <functional>
#include <vector>

#include "examples/mlp/device_model.hpp"
#include "examples/mlp/rank_model.hpp"

namespace shardflow::mlp {
namespace {

// DeviceModel on one GPU: the model's kernels and the bucket events on the model's stream
// (Runtime::set_stream), so backward never waits for a reduction; the runtime's optimizer steps
// its shard on the device, or (optimizer_in_runtime off) the trainer steps every parameter there.
class DeviceRankModel final : public RankModel {
 public:
  DeviceRankModel(const Model& model, const TrainOptions& opt) : model_(model), opt_(opt), dm_(model, opt.device.index) {}

  void attach(Runtime& rt) override {
    rt.set_stream(dm_.stream());
    for (std::size_t i = 0; i < model_.layers().size(); ++i) {
      const auto& l = model_.layers()[i];
      for (bool bias : {false, true})
        handles_.push_back(rt.register_param({Model::param_name(int(i), bias), bias ? Shape{l.out} : Shape{l.out, l.in},
                                              DType::f32, opt_.device, dm_.param(int(i), bias)}));
    }
  }

  float micro_batch(Runtime& rt, const float* x, const float* y, int rows, double denom) override {
    std::function<void(int)> before_layer;  // forward prefetch: the compute stream waits per layer
    if (opt_.runtime.zero.forward_prefetch)
      before_layer = [&](int i) {
        rt.wait_param(handles_[std::size_t(2 * i)]);
        rt.wait_param(handles_[std::size_t(2 * i + 1)]);
      };
    auto grad_slot = [&](int l, bool b) { return rt.grad_f32(handles_[std::size_t(2 * l + b)]); };
    auto grad_done = [&](int l, bool b) { rt.grad_ready(handles_[std::size_t(2 * l + b)]); };
    {
      auto span = rt.span("forward (enqueue)", "forward");
      dm_.forward(x, y, rows, before_layer);
    }
    {
      auto span = rt.span("backward (enqueue)", "backward");
      dm_.backward(denom, grad_slot, grad_done);
    }
    return opt_.report_loss ? dm_.loss() : 0.0f;  // waits for this rank's backward, not for the reductions
  }

  void after_step(Runtime& rt, int step) override {
    if (opt_.optimizer_in_runtime) return;
    for (std::size_t i = 0; i < model_.layers().size(); ++i)
      for (bool bias : {false, true}) {
        const auto k = 2 * i + bias;
        const auto& l = model_.layers()[i];
        dm_.step(opt_.optimizer, dm_.param(int(i), bias), rt.grad_f32(handles_[k]), bias ? l.bias.size() : l.weight.size(), k,
                 step + 1);
      }
  }

  void finish(Runtime&, Model& host) override { dm_.download(host); }

 private:
  const Model& model_;  // shapes and names; the parameters live in dm_
  const TrainOptions& opt_;
  DeviceModel dm_;
  std::vector<Param> handles_;  // [2*layer + bias]
};

}  // namespace

}  // namespace shardflow::mlp

// The module's one entry point (examples/mlp/device_loader.cpp finds it by name).
extern "C" __attribute__((visibility("default"))) shardflow::mlp::RankModel* shardflow_mlp_make_device_rank_model(
    const shardflow::mlp::Model& model, const shardflow::mlp::TrainOptions& opt) {
  return new shardflow::mlp::DeviceRankModel(model, opt);
}
