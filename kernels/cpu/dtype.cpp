#include "kernels/cpu/dtype.hpp"

namespace shardflow::kernels {

// The compiler's _Float16 does IEEE binary16 conversion with correct rounding (and uses F16C when
// the target has it), so there is no hand-written bit twiddling to get wrong.
float f16_to_f32(std::uint16_t h) {
  _Float16 v;
  std::memcpy(&v, &h, 2);
  return static_cast<float>(v);
}

std::uint16_t f32_to_f16(float f) {
  _Float16 v = static_cast<_Float16>(f);
  std::uint16_t h;
  std::memcpy(&h, &v, 2);
  return h;
}

}  // namespace shardflow::kernels
