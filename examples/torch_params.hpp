// A torch::nn::Module's parameters to and from safetensors under the module's own names: the
// libtorch examples' --init, --save and --save-init, and the files their PyTorch counterparts
// (tests/libtorch/torch_digits_ddp.py, bench/peers/torch_gpt.py) read and write.
#pragma once

#include <torch/torch.h>

#include <string>

#include "shardflow/errors.hpp"
#include "shardflow/safetensors.hpp"

namespace examples {

inline void save_params(torch::nn::Module& module, const std::string& path) {
  shardflow::TensorMap out;
  for (auto& item : module.named_parameters()) {
    const auto p = item.value().detach().to(torch::kCPU, torch::kFloat).contiguous();  // a GPU or bf16 model saves fp32 values
    out[item.key()] = shardflow::Tensor::from_f32(p.data_ptr<float>(), shardflow::Shape(p.sizes().begin(), p.sizes().end()));
  }
  shardflow::save_safetensors(path, out, {{"format", "pt"}});
}

// Every parameter must be in the file with the module's shape; `shape_hint` ends a shape error
// (which flags decide the shapes).
inline void load_params(torch::nn::Module& module, const std::string& path, const std::string& shape_hint = "") {
  const auto t = shardflow::load_safetensors(path);
  torch::NoGradGuard no_grad;
  for (auto& item : module.named_parameters()) {
    auto it = t.find(item.key());
    if (it == t.end()) throw shardflow::UsageError("--init '" + path + "': tensor '" + item.key() + "' is missing");
    const shardflow::Shape want(item.value().sizes().begin(), item.value().sizes().end());
    if (it->second.shape != want)
      throw shardflow::UsageError("--init '" + path + "': tensor '" + item.key() + "' has shape " + shardflow::shape_str(it->second.shape) +
                                  ", the model's is " + shardflow::shape_str(want) + shape_hint);
    auto v = it->second.to_f32("--init '" + path + "': tensor '" + item.key() + "'");
    item.value().copy_(torch::from_blob(v.data(), it->second.shape));
  }
}

}  // namespace examples
