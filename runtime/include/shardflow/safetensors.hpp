// safetensors files (8-byte little-endian header length, a JSON header, raw little-endian data),
// read and written on nlohmann-json. The format PyTorch and HF tools exchange state dicts in, so a
// torch state dict saved with safetensors loads directly.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <vector>

#include "shardflow/types.hpp"

namespace shardflow {

struct Tensor {
  std::string dtype = "F32";  // safetensors names: F32, BF16, F16, F64, I64, I32, U8, ...
  Shape shape;
  std::vector<std::byte> data;

  std::size_t numel() const { return std::size_t(shardflow::numel(shape)); }
  // The data as float32; UsageError naming `what` if the tensor is not F32.
  std::vector<float> to_f32(const std::string& what) const;
  static Tensor from_f32(const float* p, Shape shape);
};

using TensorMap = std::map<std::string, Tensor>;

// Throws Error naming the file (and tensor) when the file is missing, truncated or malformed.
TensorMap load_safetensors(const std::string& path);
void save_safetensors(const std::string& path, const TensorMap& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace shardflow
