// Which vector instructions the CPU kernels' element loops use (Note [Vector loops, the same bits]).
#pragma once

namespace shardflow::kernels {

enum class VectorIsa { baseline, avx2 };

const char* name(VectorIsa isa);

// SHARDFLOW_CPU_VECTORS's value (null: not set) -> the loops to use on a CPU that has AVX2 or not:
// "auto" (the default: AVX2 where the CPU has it), "baseline" (x86-64's SSE2), "avx2" (raises on a
// CPU without it); anything else raises, naming the variable.
VectorIsa vector_isa_setting(const char* value, bool cpu_has_avx2);

bool cpu_has_avx2();

// The loops in use: chosen from SHARDFLOW_CPU_VECTORS and the CPU at the first call.
VectorIsa vector_isa();

// Uses `isa` from now on, process-wide, and returns the previous choice (the test suites compare
// the paths); AVX2 on a CPU without it raises.
VectorIsa use_vector_isa(VectorIsa isa);

}  // namespace shardflow::kernels
