// The model as the rank loop (train.cpp) drives it, whatever device it computes on: one rank loop,
// two adapters. The host adapter runs Model on the CPU (fp32, or 16-bit parameters with fp32
// compute copies); the device adapter runs DeviceModel with cuBLAS on one GPU, on the stream the
// runtime records its bucket events on.
#pragma once

#include <memory>
#include <string>

#include "examples/mlp/model.hpp"
#include "examples/mlp/train.hpp"

namespace shardflow::mlp {

class RankModel {
 public:
  virtual ~RankModel() = default;
  // Registers the parameters (and, on a GPU, the compute stream) with `rt`, before finalize().
  virtual void attach(Runtime& rt) = 0;
  // Forward and backward of one micro-batch of `rows` rows, each gradient reported to `rt` as it
  // completes; returns the micro-batch's loss (mean over its rows, over `loss_denominator`).
  virtual float micro_batch(Runtime& rt, const float* x, const float* y, int rows, double loss_denominator) = 0;
  // Once the step's gradients are reduced (and, with the runtime's optimizer, stepped): the
  // trainer's own optimizer step when the runtime has none, compute copies refreshed.
  virtual void after_step(Runtime& rt, int step) = 0;
  // After the last step, once every parameter sync has landed: the final parameters into `host`.
  virtual void finish(Runtime& rt, Model& host) = 0;
};

// `model` outlives the adapter; the host adapter trains it in place, the device adapter uploads it.
std::unique_ptr<RankModel> make_host_rank_model(Model& model, const TrainOptions& opt);
// The device adapter lives in its own module, loaded on first use (device_loader.cpp); throws
// UsageError saying why when it cannot be loaded.
std::unique_ptr<RankModel> make_device_rank_model(const Model& model, const TrainOptions& opt);
// Empty when --device cuda can run here; otherwise why not (no CUDA in this build, the module
// missing or not loadable).
std::string device_model_unavailable();

}  // namespace shardflow::mlp
