// `shardflow doctor`'s checks: each looks at one thing on this machine that would make a job slow,
// wrong or hang, and says how to fix what it finds (DeepSpeed's ds_report and PyTorch's
// collect_env list versions; these check them against what a job needs).
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

namespace shardflow::cli {

struct Check {
  enum class Status { ok, warn, fail };  // fail: a job would break (doctor exits 1)
  std::string name;
  Status status = Status::ok;
  std::string detail;  // what was found
  std::string fix;     // what to do (empty when ok)
};
const char* status_name(Check::Status s);

// What the job will be, where the user said (the plan's flags): sizes /dev/shm and open files.
struct JobShape {
  int ranks_per_host = 0;             // 0: this host's cores
  int world = 0;                      // 0: ranks_per_host
  std::size_t plan_shm_bytes = 0;     // from the plan: the two levels' second segment per rank
  std::size_t snapshot_bytes = 0;     // from the plan: one snapshot of the whole model (0: no --params)
  bool snapshots = false;             // --snapshots: in-memory snapshots (shardflow run --max-restarts)
};

Check check_cpu();
Check check_openblas();
Check check_blas_probe();
Check check_vector_loops();
// libshardflow and its libraries (CAF, Gloo, spdlog, OpenBLAS, CUDA, NCCL) load, with their versions;
// then the GPUs the CUDA runtime sees.
std::vector<Check> check_library();
Check check_python();
Check check_shm(const JobShape& job);
Check check_open_files(const JobShape& job);
Check check_locked_memory();
// Transparent huge pages and what a first write to fresh memory costs here (Note [Huge pages for large blocks]).
Check check_huge_pages();
// Whether a Runtime here keeps the trainer's freed memory for reuse, or what leaves it to malloc
// (Note [Keeping the trainer's freed memory]).
Check check_freed_memory();
Check check_network();

}  // namespace shardflow::cli
