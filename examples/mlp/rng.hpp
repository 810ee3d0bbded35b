// A counter-based generator (splitmix64 over seed, stream, counter): the same numbers on every
// platform and standard library, unlike std::uniform_real_distribution, so runs reproduce anywhere.
#pragma once

#include <cmath>
#include <cstdint>

namespace shardflow::mlp {

class CounterRng {
 public:
  CounterRng(std::uint64_t seed, std::uint64_t stream) : state_(seed * 0x9E3779B97F4A7C15ull ^ (stream + 1) * 0xBF58476D1CE4E5B9ull) {}

  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float uniform() { return float(next() >> 40) * (1.0f / 16777216.0f); }  // [0, 1)
  float normal() {  // Box-Muller
    const float u1 = (float(next() >> 40) + 1.0f) * (1.0f / 16777217.0f);
    const float u2 = uniform();
    return std::sqrt(-2.0f * std::log(u1)) * std::cos(6.2831853f * u2);
  }

 private:
  std::uint64_t state_;
};

}  // namespace shardflow::mlp
