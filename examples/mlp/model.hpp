// The example trainer's model: Linear layers with ReLU between them (none after the last), loss
// mean((pred - y)^2) or softmax cross-entropy. Parameter names and layouts are nn.Linear's: layers.{i}.weight [out, in],
// layers.{i}.bias [out], so a torch state dict saved as safetensors loads directly.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "shardflow/safetensors.hpp"

namespace shardflow::mlp {

// What the last layer's outputs are scored with: regression (MSE against y) or classification
// (softmax cross-entropy against one-hot y; accuracy by argmax).
enum class Loss { mse, cross_entropy };
Loss parse_loss(const std::string& name);  // "mse" | "cross-entropy"; UsageError naming --loss otherwise
const char* loss_name(Loss loss);

struct Layer {
  int in = 0, out = 0;
  std::vector<float> weight;  // [out, in]
  std::vector<float> bias;    // [out]
};

class Model {
 public:
  explicit Model(std::vector<int> sizes, Loss loss = Loss::mse);  // e.g. {784, 256, 256, 10}

  const std::vector<int>& sizes() const { return sizes_; }
  std::vector<Layer>& layers() { return layers_; }
  const std::vector<Layer>& layers() const { return layers_; }

  // torch's nn.Linear default init (uniform in +-1/sqrt(in)) from a counter-based generator, so
  // every rank and every run with the same seed starts from the same parameters.
  void init(std::uint64_t seed);
  // Loads layers.{i}.weight / .bias; Error naming the tensor if one is missing or misshaped.
  void load(const TensorMap& tensors, const std::string& origin);
  TensorMap state_dict() const;
  // The same, freeing each layer as it is copied: at the end of a run, the copy never holds a
  // second whole model (peak resident memory).
  TensorMap release_state_dict();

  // Forward on `rows` rows of x [rows, sizes[0]]; keeps the activations for backward and returns
  // the loss mean over this batch (MSE: over its elements; cross-entropy: over its rows). `before_layer(i)` runs right before layer i reads its
  // parameters (forward prefetch waits for their update there).
  float forward(const float* x, const float* y, int rows, const std::function<void(int)>& before_layer = {});

  // Backward through the last forward. Gradients accumulate into grads(layer, is_bias) and
  // `ready(layer, is_bias)` is called as soon as each one is complete, last layer first — the
  // moment a DDP runtime can start reducing it. `loss_denominator` is the count the loss mean is
  // over (elements for MSE, rows for cross-entropy), the global batch's for data parallel.
  using GradSlot = std::function<float*(int layer, bool bias)>;
  using GradReady = std::function<void(int layer, bool bias)>;
  void backward(const float* y, double loss_denominator, const GradSlot& grads, const GradReady& ready);

  static std::string param_name(int layer, bool bias);
  // Refuses widths no model can have, allocating nothing (the constructor checks the same).
  static void check_sizes(const std::vector<int>& sizes);

  // The fraction of `rows` rows whose largest output is at the index of their largest y (top-1
  // accuracy with one-hot labels). Forward only, in batches: no activations kept for backward.
  double accuracy(const float* x, const float* y, std::size_t rows);
  Loss loss() const { return loss_; }

 private:
  // The outputs of the layers on `rows` rows of x (acts_.back() the last).
  void run_layers(const float* x, int rows, const std::function<void(int)>& before_layer);

  std::vector<int> sizes_;
  Loss loss_;
  std::vector<Layer> layers_;
  const float* x_ = nullptr;
  int rows_ = 0;
  std::vector<std::vector<float>> acts_;  // acts_[i]: output of layer i (after ReLU except the last)
  std::vector<float> dy_, dx_;
};

std::vector<int> parse_sizes(const std::string& csv);  // "784,256,10"; UsageError if malformed

}  // namespace shardflow::mlp
