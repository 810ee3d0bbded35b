// Which OpenBLAS kernel a process runs, choosing it where OpenBLAS cannot, and a probe of whether
// its results depend on anything but the inputs.
//
// Note [OpenBLAS on CPUs it does not know]
// Debian 12's OpenBLAS 0.3.21 is built with DYNAMIC_ARCH: at load it reads the CPU's family and
// model and picks a kernel set. A model newer than its tables (Sapphire/Emerald Rapids Xeons,
// e.g. family 6 model 207 on the CI VMs) gets "Prescott", its SSE3 fallback, although the CPU has
// AVX-512 and BF16. Two consequences, measured on such a VM
// (kernels::blas::probe, `shardflow doctor`; bench/RESULTS.md):
//   - about 2x slower GEMMs (gpt_train's GPT 1798 ms an iteration against 893 with Cooperlake);
//   - results that depend on the thread count. Prescott's sgemm kernel adds up a C element in
//     another order in a full register tile (4 columns) than in an edge tile (2 or 1), and the
//     threaded driver splits M or N between the threads, which moves the edges: sgemm NT
//     4096x6x24 (mlp_train's synthetic teacher) at 1 and 2 threads differs in columns 0-3 of
//     4069 of 4096 rows and not in columns 4-5. The numbers are reordered, not wrong: both are
//     within 2e-7 (relative to the sum of |terms|) of a float64 reference. Buffer alignment and
//     concurrent callers were ruled out (same bits at every 16-byte offset, 2 threads calling at
//     once). The suites failed because mlp::train generated its data before fixing the BLAS thread
//     count, so the first run in a process saw other data than the next.
// OpenBLAS's newer releases pick by features (BF16 -> Cooperlake, AVX-512 -> SkylakeX, AVX2 ->
// Haswell, or Zen on AMD) when they do not know the model; shardflow does the same at load, before any GEMM,
// when OpenBLAS fell back to a pre-AVX kernel on a CPU with AVX2 or better and OPENBLAS_CORETYPE
// is unset (SHARDFLOW_BLAS_KERNEL=keep keeps OpenBLAS's choice), and exports OPENBLAS_CORETYPE so
// that child processes load the same kernel. `shardflow run`, which links no BLAS, has a child of
// its own probe and choose (probe_in_child) and hands the choice to its ranks, so that torch in a
// Python rank loads that kernel before shardflow is even imported.
// SkylakeX and Cooperlake sum every tile alike (0 of 8232 shapes vary with threads); Haswell,
// the AVX2 kernel, has the same edge effect for M (1347 of 8232 shapes): on AVX2 CPUs results are
// reproducible at a fixed thread count, which the trainers and the launcher fix per rank, and
// Sandybridge (slower) makes them independent of it. probe() measures this on the running kernel.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace shardflow::kernels::blas {

struct Kernel {
  bool openblas = false;     // false: another BLAS (nothing below is known about it)
  std::string config;        // openblas_get_config(): version and build options
  std::string name;          // the kernel set in use ("Cooperlake", "Prescott", ...)
  std::string chosen_by;     // "OPENBLAS_CORETYPE", "OpenBLAS" (its own detection) or "shardflow"
  std::string replaced;      // chosen_by shardflow: what OpenBLAS had picked
  std::string best_for_cpu;  // the fastest kernel set this CPU's features allow
  int threads = 0;           // OpenBLAS's thread count now
};

// One of the kernel sets OpenBLAS falls back to for a CPU it does not know, all older than AVX.
bool pre_avx(const std::string& kernel_name);

// The kernel in use (loads nothing: an OpenBLAS not yet in the process is loaded by load()).
Kernel kernel();

// Loads OpenBLAS into a process that does not link it (the launcher, after it blocked its
// signals, so that OpenBLAS's worker threads inherit the mask) and applies the choice above.
// False when no OpenBLAS could be loaded.
bool load();

struct Probe {
  bool ran = false;              // false: no OpenBLAS to probe
  bool thread_invariant = true;  // the same bits at 1, 2 and 3 threads
  bool repeatable = true;        // the same bits call after call and at other buffer offsets
  double max_rel_error = 0;      // against a float64 sum, relative to the sum of |terms|
  std::string moved;             // the first case whose bits moved: shape and what changed
  std::string kernel;            // the kernel probed
  int threads_probed = 0;        // the thread counts compared: 1 to this
  // One line: the verdict and, when bits move, the setting that fixes it.
  std::string line() const;
};

// A few sgemm calls shaped like the ones that showed the effect, at 1, 2 and 3 OpenBLAS threads and
// at shifted buffers, compared bit for bit (a few milliseconds). It lowers the thread count and
// restores it, never above what OpenBLAS started with (growing 0.3.21's running pool is not safe):
// run it where no other thread is using BLAS, best through probe_in_child.
Probe probe();

// probe() in a child process: `exe` run with `arg` must call probe_child_main(). OpenBLAS starts
// there with 3 threads, so the probe only lowers the count, and whatever OpenBLAS does cannot take
// the caller down (the launcher, which links no BLAS). `kernel_env` gets the OPENBLAS_CORETYPE and
// SHARDFLOW_BLAS_REPLACED the child chose, for the ranks. ran = false when the child failed or took
// longer than 20 s.
Probe probe_in_child(const std::string& exe, const std::string& arg, std::vector<std::pair<std::string, std::string>>* kernel_env);
// The child's side: loads OpenBLAS, probes, prints the result for probe_in_child; exit status 0.
int probe_child_main();

}  // namespace shardflow::kernels::blas
