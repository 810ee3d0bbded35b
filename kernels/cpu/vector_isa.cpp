#include "kernels/cpu/vector_isa.hpp"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "shardflow/errors.hpp"

namespace shardflow::kernels {

// Note [Vector loops, the same bits]
// The optimizer steps are element loops of multiplies, adds, divides and square roots, all
// correctly rounded in IEEE arithmetic whatever the vector width: SSE2's 4 lanes and AVX2's 8 give
// every element the same bits. Debian builds for x86-64's baseline (SSE2), so the compiler's loops
// use 4 lanes; AdamW's two divides and a square root an element then made the step compute-bound
// (2.0 ms for 2.1 M elements on this VM's Zen 5 core, against 1.2 ms with AVX2) on the cores the
// trainer's compute shares with the shards. So each such loop is compiled twice, for the baseline
// and for AVX2, and the CPU chooses at run time. Two things would change the bits and are kept
// out: fused multiply-adds (AVX2 alone does not enable FMA, so the compiler cannot contract) and
// anything approximate (rsqrt). test_kernels holds every path to the baseline's bits.
const char* name(VectorIsa isa) { return isa == VectorIsa::avx2 ? "avx2" : "baseline"; }

bool cpu_has_avx2() {
#if defined(__x86_64__) && defined(__GNUC__)
  return __builtin_cpu_supports("avx2");
#else
  return false;
#endif
}

VectorIsa vector_isa_setting(const char* value, bool has_avx2) {
  const auto best = has_avx2 ? VectorIsa::avx2 : VectorIsa::baseline;
  if (!value || std::strcmp(value, "auto") == 0) return best;
  if (std::strcmp(value, "baseline") == 0) return VectorIsa::baseline;
  if (std::strcmp(value, "avx2") == 0) {
    if (!has_avx2) throw UsageError("SHARDFLOW_CPU_VECTORS=avx2, but this CPU has no AVX2: use auto or baseline");
    return VectorIsa::avx2;
  }
  throw UsageError(std::string("SHARDFLOW_CPU_VECTORS='") + value +
                   "': auto (AVX2 where the CPU has it, the default), baseline (SSE2) or avx2");
}

namespace {
std::atomic<int> chosen{-1};  // -1: not read yet
}

VectorIsa vector_isa() {
  int v = chosen.load(std::memory_order_relaxed);
  if (v < 0) {
    v = int(vector_isa_setting(std::getenv("SHARDFLOW_CPU_VECTORS"), cpu_has_avx2()));
    int unset = -1;
    if (!chosen.compare_exchange_strong(unset, v, std::memory_order_relaxed)) v = unset;  // another thread's, or a test's
  }
  return VectorIsa(v);
}

VectorIsa use_vector_isa(VectorIsa isa) {
  if (isa == VectorIsa::avx2 && !cpu_has_avx2()) throw UsageError("AVX2 loops asked for on a CPU without AVX2");
  const VectorIsa before = vector_isa();
  chosen.store(int(isa), std::memory_order_relaxed);
  return before;
}

}  // namespace shardflow::kernels
