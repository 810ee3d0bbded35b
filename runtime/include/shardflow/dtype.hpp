// The element type of parameters, gradients and wire buffers: its one declaration. Plain C++17, so
// that the CUDA kernels (nvcc compiles them as C++17, toolchain notes) include it too.
#pragma once

#include <cstdint>

namespace shardflow {

enum class DType : std::uint8_t { f32, bf16, f16 };

}  // namespace shardflow
