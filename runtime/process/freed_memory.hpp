// Note [Keeping the trainer's freed memory]
// A training step allocates the same tensors every iteration: activations in forward, freed in
// backward, asked for again in the next forward. glibc's malloc gives a block above its mmap
// threshold (128 KiB, raised on the fly to at most 32 MiB) a mapping of its own, returned to the
// kernel on free, and trims the heap's free top: the next forward faults its tensors in again,
// each page zeroed by the kernel. On examples/gpt across two netns hosts at 1 Gbit/s (ZeRO-1,
// forward prefetch) the trainer thread spent 10 % of its samples in the page-fault handler and
// 5 % in memset (3 % and 2.4 % without prefetch, whose forward runs alone and meets the heap
// as the last backward left it), and the two ranks 1.65 cores against 1.43 for the same steps.
// So the first Runtime of a process fixes glibc's mmap threshold at 32 MiB, the ceiling glibc's
// own adjustment would reach, and its trim threshold at 2 GiB: freed blocks stay in the heap for
// the next iteration (as PyTorch's CUDA caching allocator keeps them on a GPU, and the jemalloc or
// tcmalloc that CPU training guides preload keep them on the host). Measured there: ZeRO-1 +
// prefetch 0.80x the step with malloc left alone (bench/RESULTS.md, "Keeping the trainer's freed
// memory"). The cost is resident memory: blocks freed early stay beside later ones (the peak of
// mlp_train 8 x Linear(1024, 1024) +10 % at world 1, +14 % at world 2; test_plan bounds it). A
// threshold of 1 GiB gained the same but let test_overlap's timing scenario miss its bound in 3
// of 31 runs (0 of 20 at 32 MiB, 0 of 25 left alone). Left alone where the user chose:
// Config::keep_freed_memory = false, SHARDFLOW_KEEP_FREED_MEMORY=0, or glibc's own malloc settings
// in the environment (GLIBC_TUNABLES' glibc.malloc.mmap_threshold or trim_threshold,
// MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_). A preloaded allocator does not read glibc's
// settings, so it is not affected either way.
#pragma once

#include <string>

namespace shardflow {

struct FreedMemoryChoice {
  bool keep = false;
  std::string why;  // for the log: what was set, or what left malloc as it is
};

// The choice from the Config and the environment's values (null: unset). UsageError naming
// SHARDFLOW_KEEP_FREED_MEMORY for a value other than 0 or 1.
FreedMemoryChoice choose_freed_memory(bool configured, const char* switch_env, const char* glibc_tunables,
                                      const char* mmap_threshold_env, const char* trim_threshold_env);

// choose_freed_memory with this process's environment (the Runtime's choice, and doctor's report).
FreedMemoryChoice choose_freed_memory_from_env(bool configured);

// The first call of the process decides (from the environment) and applies; later calls return
// that first choice, or throw UsageError naming Config::keep_freed_memory when they ask for the
// other value (the setting is the process's). The Runtime's constructor calls it.
const FreedMemoryChoice& keep_freed_memory(bool configured);

}  // namespace shardflow
