// The example MLP on a GPU (mlp_train --device cuda): the same layers, loss and parameter names as
// Model, with parameters, activations and gradients in device memory, the matmuls in cuBLAS and
// everything enqueued on one stream — the stream the Runtime records its bucket events on — so
// backward never waits for a reduction and the host never waits for backward. No CUDA types here:
// the trainer compiles with or without the toolkit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "examples/mlp/model.hpp"
#include "shardflow/optimizer.hpp"

namespace shardflow::mlp {

class DeviceModel {
 public:
  // Uploads `host`'s parameters to cuda:`device`. UsageError when CUDA or the device is missing.
  DeviceModel(const Model& host, int device);
  ~DeviceModel();
  DeviceModel(const DeviceModel&) = delete;
  DeviceModel& operator=(const DeviceModel&) = delete;

  void* stream() const;  // cudaStream_t: hand it to Runtime::set_stream
  float* param(int layer, bool bias) const;

  // Copies this batch in and runs forward; the loss mean stays on the device until loss().
  void forward(const float* x_host, const float* y_host, int rows, const std::function<void(int)>& before_layer = {});
  float loss();  // waits for the stream: once per step, for reporting

  // As Model::backward, with device gradient slots: kernels for layer i are enqueued, then
  // ready(i, ...) is called — the runtime records the bucket's event after them.
  void backward(double loss_denominator, const Model::GradSlot& grads, const Model::GradReady& ready);

  // The trainer's optimizer step on the device (ZeRO stage 0 with the optimizer outside the
  // runtime): the fused kernels of kernels/cuda/optim.cuh, state per parameter slot.
  void step(const OptimizerConfig& h, float* param, const float* grad, std::size_t n, std::size_t slot,
            std::int64_t step);

  void download(Model& host) const;  // parameters back into `host` (waits for the stream)

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardflow::mlp
