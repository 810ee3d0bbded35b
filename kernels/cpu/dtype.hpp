// bf16 / fp16 <-> fp32 conversions. Reductions of 16-bit buffers accumulate in fp32 and round once,
// round-to-nearest-even, like NCCL and PyTorch do.
#pragma once

#include <cstdint>
#include <cstring>

namespace shardflow::kernels {

inline float bf16_to_f32(std::uint16_t h) {
  std::uint32_t u = std::uint32_t{h} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline std::uint16_t f32_to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return std::uint16_t((u >> 16) | 0x40);  // keep NaN a NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return std::uint16_t(u >> 16);
}

float f16_to_f32(std::uint16_t h);
std::uint16_t f32_to_f16(float f);

}  // namespace shardflow::kernels
