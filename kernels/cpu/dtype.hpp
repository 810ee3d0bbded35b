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

namespace detail {
inline std::uint32_t bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace detail

// IEEE binary16 conversions by bit manipulation (after F. Giesen's well-known float/half routines):
// inline integer work instead of a libgcc call per element, which is what _Float16 costs on CPUs
// targeted without F16C (Debian's x86-64 baseline). Round-to-nearest-even, NaN stays NaN,
// overflow goes to infinity, subnormals both ways. Checked bit for bit against _Float16 in
// tests/test_kernels.cpp (every half, and a sweep of floats).
inline float f16_to_f32(std::uint16_t h) {
  constexpr std::uint32_t shifted_exp = 0x7c00u << 13;  // exponent mask after the shift
  std::uint32_t o = (std::uint32_t(h) & 0x7fffu) << 13;
  const std::uint32_t exp = shifted_exp & o;
  o += (127 - 15) << 23;                               // re-bias the exponent
  if (exp == shifted_exp) {
    o += (128 - 16) << 23;                             // Inf / NaN: exponent all ones
  } else if (exp == 0) {                               // zero / subnormal: renormalise via the FPU
    o += 1 << 23;
    o = detail::bits(detail::from_bits(o) - detail::from_bits(113u << 23));
  }
  return detail::from_bits(o | (std::uint32_t(h) & 0x8000u) << 16);
}

inline std::uint16_t f32_to_f16(float x) {
  constexpr std::uint32_t f32_infty = 255u << 23;
  constexpr std::uint32_t f16_max = (127u + 16u) << 23;  // first float that overflows half
  constexpr std::uint32_t denorm_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  std::uint32_t f = detail::bits(x);
  const std::uint32_t sign = f & 0x80000000u;
  f ^= sign;
  std::uint32_t o;
  if (f >= f16_max) {
    o = f > f32_infty ? 0x7e00u : 0x7c00u;             // NaN -> quiet NaN, else infinity
  } else if (f < (113u << 23)) {                       // becomes a half subnormal (or zero):
    o = detail::bits(detail::from_bits(f) + detail::from_bits(denorm_magic)) - denorm_magic;  // the FPU rounds (to even)
  } else {
    const std::uint32_t mant_odd = (f >> 13) & 1u;     // round to nearest, ties to even
    f += ((15u - 127u) << 23) + 0xfffu;
    f += mant_odd;
    o = f >> 13;
  }
  return std::uint16_t(o | (sign >> 16));
}


}  // namespace shardflow::kernels
