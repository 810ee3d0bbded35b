// Element types, devices and parameter descriptions shared by the trainer API, the bucket plan and
// the communication backends.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "shardflow/dtype.hpp"

namespace shardflow {

std::size_t dtype_size(DType t);
const char* dtype_name(DType t);
DType parse_dtype(const std::string& name);  // "fp32"/"f32"/"float32", "bf16", "fp16"/"f16"

struct Device {
  enum class Kind : std::uint8_t { cpu, cuda };
  Kind kind = Kind::cpu;
  int index = 0;

  static Device cpu() { return {}; }
  static Device cuda(int i) { return {Kind::cuda, i}; }
  bool operator==(const Device&) const = default;
  std::string str() const;  // "cpu", "cuda:1"
};

using Shape = std::vector<std::int64_t>;
std::int64_t numel(const Shape& s);
std::string shape_str(const Shape& s);  // "[256, 784]"

// What a trainer registers: one model parameter, in forward order.
struct ParamSpec {
  std::string name;
  Shape shape;
  DType dtype = DType::f32;
  Device device = Device::cpu();
  void* data = nullptr;  // parameter storage, owned by the trainer
  // Gradient storage owned by the trainer. Leave null with Config::buckets.gradient_as_bucket_view (the default):
  // the gradient then lives inside the flat bucket and Runtime::grad() says where.
  void* grad = nullptr;
  // False: a frozen parameter (torch's requires_grad = False). It is synced from rank 0 at
  // registration and saved in checkpoints, but never bucketed, reduced, stepped or synced, and
  // has no optimizer state; Runtime::set_requires_grad + refresh_trainable() change it later.
  bool requires_grad = true;
};

// What a trainer registers besides parameters: state that forward updates and that must stay the
// same on every rank but gets no gradient (normalisation running statistics, step counters,
// masks). Raw bytes: shardflow only copies them (Config::sync).
struct BufferSpec {
  std::string name;
  void* data = nullptr;  // owned by the trainer
  std::size_t bytes = 0;  // a whole number of 16-bit words: the backends move 2- or 4-byte elements
  Device device = Device::cpu();
};

}  // namespace shardflow
