// Where this rank's gradient pass stands: which gradients came in, in what order, and the phase the
// trainer's calls see. Megatron's bucket group keeps the same for its register_grad_ready. Plain
// state: Runtime::Impl's calls move it (runtime/rank/gradient_pass.cpp, runtime/rank/runtime.cpp).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace shardflow {

struct PassState {
  // Per backward pass. grad_ready may run on several threads at once: flags are atomic and the
  // observed order is appended through an atomic cursor.
  std::unique_ptr<std::atomic<std::uint8_t>[]> marked;
  std::vector<std::uint8_t> touched;  // got a gradient in a no_sync pass since the last sync
  std::vector<std::uint32_t> order;
  std::atomic<std::uint32_t> order_pos{0};
  std::atomic<bool> require_sync{true};
  // Note [Iteration phases]
  // Where this rank's synchronised pass stands, as the trainer's calls see it; every entry point
  // checks it. idle: between wait() and the first grad_ready of a synchronised pass (zero_grad,
  // set_lr, configure_optimizer, set_stream and no_sync are allowed only here). backward:
  // gradients arriving (grad_ready may run on several threads; the first moves idle -> backward).
  // reducing: finish_backward handed the pass over (no more grad_ready); wait() collects it and
  // returns to idle. Accumulation (no_sync) passes stay idle: nothing is reduced.
  enum class Phase : std::uint8_t { idle, backward, reducing };
  std::atomic<Phase> phase{Phase::idle};
  bool in_pass() const { return phase.load(std::memory_order_acquire) != Phase::idle; }
  bool wait_prefetching = false;  // how the pending wait() started (begin_wait)
  bool last_wait_prefetching = false;  // how the wait() before it did (Note [A window of another schedule])
  // A prefetched pass's syncs were awaited before a choice was made again, in this iteration's
  // window and in the last one's (Note [A window of another schedule]).
  bool syncs_awaited = false, syncs_awaited_last = false;
  bool rebuilt = false;           // the buckets were rebuilt from the observed order
  std::uint64_t iterations = 0;   // synchronised iterations the trainer completed
  std::size_t done_in_backward = 0;  // buckets complete when finish_backward ran (stats)
  // Once, at the first backward: settings that need the runtime's optimizer must have one.
  std::atomic<bool> settings_checked{false};
};

}  // namespace shardflow
