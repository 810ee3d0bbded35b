#include "examples/mlp/model.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "examples/mlp/rng.hpp"
#include "kernels/cpu/elementwise.hpp"
#include "kernels/cpu/host_memory.hpp"
#include "kernels/cpu/linear.hpp"
#include "shardflow/errors.hpp"

namespace shardflow::mlp {

Loss parse_loss(const std::string& name) {
  if (name == "mse") return Loss::mse;
  if (name == "cross-entropy" || name == "xent") return Loss::cross_entropy;
  throw UsageError("--loss '" + name + "': expected mse (regression) or cross-entropy (classification, one-hot y)");
}

const char* loss_name(Loss loss) { return loss == Loss::mse ? "mse" : "cross-entropy"; }

void Model::check_sizes(const std::vector<int>& sizes) {
  if (sizes.size() < 2) throw UsageError("--sizes needs at least two numbers (input and output width)");
  for (int s : sizes)
    if (s <= 0) throw UsageError("--sizes: every width must be positive");
}

Model::Model(std::vector<int> sizes, Loss loss) : sizes_(std::move(sizes)), loss_(loss) {
  check_sizes(sizes_);
  for (std::size_t i = 0; i + 1 < sizes_.size(); ++i) {
    Layer l;
    l.in = sizes_[i];
    l.out = sizes_[i + 1];
    // On huge pages where it is large, as the runtime's own blocks are (Note [Huge pages for large
    // blocks]): written first here, in 4 KiB faults it took 0.15 s for a 4096 x 4096 layer on a VM,
    // on every rank's start, a replacement's and a joiner's included.
    const std::size_t n = std::size_t(l.in) * l.out;
    l.weight.reserve(n);
    advise_huge_pages(l.weight.data(), n * sizeof(float));
    l.weight.assign(n, 0.0f);
    l.bias.assign(std::size_t(l.out), 0.0f);
    layers_.push_back(std::move(l));
  }
  acts_.resize(layers_.size());
}

std::string Model::param_name(int layer, bool bias) {
  return "layers." + std::to_string(layer) + (bias ? ".bias" : ".weight");
}

void Model::init(std::uint64_t seed) {
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    auto& l = layers_[i];
    const float bound = 1.0f / std::sqrt(float(l.in));
    CounterRng wr(seed, 2 * i), br(seed, 2 * i + 1);
    for (auto& w : l.weight) w = bound * (2.0f * wr.uniform() - 1.0f);
    for (auto& b : l.bias) b = bound * (2.0f * br.uniform() - 1.0f);
  }
}

void Model::load(const TensorMap& tensors, const std::string& origin) {
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    auto& l = layers_[i];
    for (bool bias : {false, true}) {
      const std::string name = param_name(int(i), bias);
      auto it = tensors.find(name);
      if (it == tensors.end()) throw Error(origin + ": tensor '" + name + "' is missing");
      const Shape want = bias ? Shape{l.out} : Shape{l.out, l.in};
      if (it->second.shape != want)
        throw Error(origin + ": tensor '" + name + "' has shape " + shape_str(it->second.shape) + ", the model (--sizes) needs " +
                    shape_str(want));
      (bias ? l.bias : l.weight) = it->second.to_f32(origin + ": tensor '" + name + "'");
    }
  }
}

TensorMap Model::state_dict() const {
  TensorMap out;
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    const auto& l = layers_[i];
    out[param_name(int(i), false)] = Tensor::from_f32(l.weight.data(), {l.out, l.in});
    out[param_name(int(i), true)] = Tensor::from_f32(l.bias.data(), {l.out});
  }
  return out;
}

TensorMap Model::release_state_dict() {
  TensorMap out;
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    auto& l = layers_[i];
    out[param_name(int(i), false)] = Tensor::from_f32(l.weight.data(), {l.out, l.in});
    out[param_name(int(i), true)] = Tensor::from_f32(l.bias.data(), {l.out});
    std::vector<float>().swap(l.weight);
    std::vector<float>().swap(l.bias);
  }
  return out;
}

void Model::run_layers(const float* x, int rows, const std::function<void(int)>& before_layer) {
  const float* in = x;
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    auto& l = layers_[i];
    if (before_layer) before_layer(int(i));
    acts_[i].resize(std::size_t(rows) * l.out);
    kernels::linear_forward(in, l.weight.data(), l.bias.data(), acts_[i].data(), rows, l.in, l.out);
    if (i + 1 < layers_.size()) kernels::relu_forward(acts_[i].data(), acts_[i].data(), acts_[i].size());
    in = acts_[i].data();
  }
}

float Model::forward(const float* x, const float* y, int rows, const std::function<void(int)>& before_layer) {
  x_ = x;
  rows_ = rows;
  run_layers(x, rows, before_layer);
  if (loss_ == Loss::cross_entropy) return kernels::softmax_xent_loss(acts_.back().data(), y, rows, sizes_.back());
  return kernels::mse_loss(acts_.back().data(), y, acts_.back().size());
}

double Model::accuracy(const float* x, const float* y, std::size_t rows) {
  if (rows == 0) return 0.0;
  const int C = sizes_.back(), in = sizes_.front();
  constexpr std::size_t kBatch = 256;
  std::size_t right = 0;
  for (std::size_t first = 0; first < rows; first += kBatch) {
    const int n = int(std::min(kBatch, rows - first));
    run_layers(x + first * std::size_t(in), n, {});
    for (int r = 0; r < n; ++r) {
      const float* p = acts_.back().data() + std::size_t(r) * C;
      const float* t = y + (first + std::size_t(r)) * std::size_t(C);
      right += std::max_element(p, p + C) - p == std::max_element(t, t + C) - t;
    }
  }
  return double(right) / double(rows);
}

void Model::backward(const float* y, double denom, const GradSlot& grads, const GradReady& ready) {
  const int L = int(layers_.size());
  dy_.resize(acts_.back().size());
  if (loss_ == Loss::cross_entropy)
    kernels::softmax_xent_backward(acts_.back().data(), y, dy_.data(), rows_, sizes_.back(), denom);
  else
    kernels::mse_backward(acts_.back().data(), y, dy_.data(), dy_.size(), denom);
  for (int i = L - 1; i >= 0; --i) {
    auto& l = layers_[std::size_t(i)];
    const float* in = i == 0 ? x_ : acts_[std::size_t(i) - 1].data();
    float* dx = nullptr;
    if (i > 0) {
      dx_.resize(std::size_t(rows_) * l.in);
      dx = dx_.data();
    }
    float* dW = grads(i, false);
    float* db = grads(i, true);
    kernels::linear_backward(in, l.weight.data(), dy_.data(), dW, db, dx, rows_, l.in, l.out);
    // Reported the moment they are complete: the runtime reduces them while we go on below.
    ready(i, false);
    ready(i, true);
    if (i > 0) {
      kernels::relu_backward(acts_[std::size_t(i) - 1].data(), dx_.data(), dx_.data(), dx_.size());
      dy_.swap(dx_);
    }
  }
}

std::vector<int> parse_sizes(const std::string& csv) {
  std::vector<int> out;
  std::stringstream ss(csv);
  for (std::string tok; std::getline(ss, tok, ',');) {
    try {
      std::size_t used = 0;
      const int v = std::stoi(tok, &used);
      if (used != tok.size() || v <= 0) throw std::invalid_argument(tok);
      out.push_back(v);
    } catch (const std::exception&) {
      throw UsageError("--sizes: '" + tok + "' is not a positive integer (expected e.g. 784,256,256,10)");
    }
  }
  if (out.size() < 2) throw UsageError("--sizes needs at least two widths, e.g. 784,256,10");
  return out;
}

}  // namespace shardflow::mlp
