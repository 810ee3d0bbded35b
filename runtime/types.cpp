#include <algorithm>
#include <cctype>
#include <cmath>

#include "shardflow/errors.hpp"
#include "shardflow/types.hpp"

namespace shardflow {

std::size_t dtype_size(DType t) { return t == DType::f32 ? 4 : 2; }

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "fp32";
    case DType::bf16: return "bf16";
    case DType::f16: return "fp16";
  }
  return "?";
}

DType parse_dtype(const std::string& name) {
  std::string s = name;
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  if (s == "fp32" || s == "f32" || s == "float32" || s == "float") return DType::f32;
  if (s == "bf16" || s == "bfloat16") return DType::bf16;
  if (s == "fp16" || s == "f16" || s == "float16" || s == "half") return DType::f16;
  throw UsageError("unknown dtype '" + name + "': expected fp32, bf16 or fp16");
}

std::string Device::str() const { return kind == Kind::cpu ? "cpu" : "cuda:" + std::to_string(index); }

std::int64_t numel(const Shape& s) {
  std::int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

const char* collective_name(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::allreduce: return "allreduce";
    case CollectiveKind::reduce_scatter: return "reduce_scatter";
    case CollectiveKind::allgather: return "allgather";
    case CollectiveKind::broadcast: return "broadcast";
    case CollectiveKind::barrier: return "barrier";
    case CollectiveKind::shift: return "shift";
  }
  return "?";
}

}  // namespace shardflow
