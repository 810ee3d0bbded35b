// The overlap choices' state, one struct per choice, held together in OverlapState (below) and
// worked on by this folder's files; the core reads the choices only through the named calls
// declared with them in runtime/rank/runtime_impl.hpp (prefetching(), build_schedule(), ...).
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include "shardflow/config.hpp"

namespace shardflow {

// Note [Forward prefetch] (forward_prefetch.cpp): the first-use order of buckets observed in one
// forward, and the sync order chosen from it.
struct ForwardPrefetchState {
  std::mutex mu;  // wait_param may run on several trainer threads
  bool observing = false;  // recording the first-use order of buckets in forward
  std::vector<char> seen;
  std::vector<std::uint32_t> forward_order;
  std::vector<std::int64_t> asked_us;  // when forward first asked for forward_order[i]
  std::vector<std::uint32_t> sync_order;  // S entries, empty = bucket order
  std::size_t early = 0;  // syncs interleaved into backward (the first of sync_order)
  bool active = false;
  // Note [Choosing on a settled iteration]: the iteration whose end starts observing forward once
  // more, to choose `early` again on steady times (~0: none pending).
  std::uint64_t recheck_after = ~std::uint64_t{0};
  // What was measured on one plan's buckets is measured again on the next's.
  void forget() {
    active = false;
    observing = false;
    sync_order.clear();
    early = 0;
    recheck_after = ~std::uint64_t{0};
  }
};

// Note [Choosing on a settled iteration] (forward_prefetch.cpp): both automatic choices are made
// once more on the fifth iteration of a plan, the lag kLagSettleIterations after its first choice
// and the syncs in backward kPrefetchSettleIterations after theirs (made on the second).
inline constexpr std::uint64_t kLagSettleIterations = 4;
inline constexpr std::uint64_t kPrefetchSettleIterations = 3;

// Note [Choosing the interleave lag] (lag_choice.cpp): bucket b's sync goes after the reduction
// of b + lag. Config's, or 0 until chosen after the first iteration.
struct InterleaveLagState {
  std::size_t lag = 0;
  bool chosen = false;
  std::uint64_t recheck_after = ~std::uint64_t{0};  // the iteration at whose end it is chosen again (~0: none)
  explicit InterleaveLagState(const Config& cfg)
      : lag(cfg.zero.interleave_lag >= 0 ? std::size_t(cfg.zero.interleave_lag) : 0), chosen(cfg.zero.interleave_lag >= 0) {}
  InterleaveLagState() = default;
  // A new plan: chosen again after its first iteration, unless the Config fixed it.
  void forget(const Config& cfg) {
    chosen = cfg.zero.interleave_lag >= 0;
    recheck_after = ~std::uint64_t{0};
  }
};

// All of the folder's state. Runtime::Impl holds it through a pointer (`overlap`, made by
// make_overlap_state), so the rank's floor never includes this header.
struct OverlapState {
  explicit OverlapState(const Config& cfg) : lag(cfg) {}
  InterleaveLagState lag;         // Note [Choosing the interleave lag]
  ForwardPrefetchState prefetch;  // Note [Forward prefetch]
};

}  // namespace shardflow
