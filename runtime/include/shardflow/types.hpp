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

// The collectives the backends run (communicator.hpp) and the plans count (`shardflow plan`).
enum class CollectiveKind : std::uint8_t { allreduce, reduce_scatter, allgather, broadcast, barrier, shift };
const char* collective_name(CollectiveKind k);

// A registered parameter. Cheap to copy; only valid with the Runtime that returned it.
struct Param {
  std::uint32_t index = ~0u;
  std::uint32_t owner = 0;
};

struct BucketInfo {
  std::uint32_t index = 0;
  DType dtype = DType::f32;
  Device device;
  std::size_t bytes = 0;
  std::vector<std::string> params;  // in the order they sit in the flat buffer
};

// A piece of a parameter this rank owns (keeps optimizer state for and steps): elements
// [begin, end) of its flat storage; the whole parameter when begin is 0 and end its numel.
struct OwnedPiece {
  std::string param;
  std::size_t begin = 0, end = 0;
  bool operator==(const OwnedPiece&) const = default;
};

// Raw buffers, the way llm.c-style engines keep a model (Note [Flat buffers]): one flat parameter
// buffer, optionally one flat gradient buffer of the same layout, and a table of where each
// parameter sits in them (offsets and shapes in elements).
struct FlatEntry {
  std::string name;
  Shape shape;
  std::size_t offset = 0;
};
struct FlatBuffers {
  void* params = nullptr;
  // The engine's gradient buffer (Config::buckets.gradient_as_bucket_view off: shardflow copies
  // into and out of its buckets), or null (view on: gradients live in the buckets, Runtime::grad).
  void* grads = nullptr;
  std::size_t numel = 0;  // elements in each buffer
  DType dtype = DType::f32;
  Device device = Device::cpu();
  std::vector<FlatEntry> table;  // in forward order
};

}  // namespace shardflow
