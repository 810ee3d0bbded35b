// OverlapState's making and what concerns both overlap choices at once.
#include "runtime/overlap/overlap_state.hpp"

#include "runtime/rank/runtime_impl.hpp"

namespace shardflow {

std::shared_ptr<OverlapState> Runtime::Impl::make_overlap_state(const Config& cfg) { return std::make_shared<OverlapState>(cfg); }

void Runtime::Impl::forget_overlap_choices() {
  overlap->prefetch.forget();
  overlap->lag.forget(cfg);
}

// Note [Choosing on a settled iteration]: prefetching, this pass's syncs are still on their way.
// A choice's broadcast must not go out among them (every rank would issue them in its own order),
// and the actors stop only between complete iterations, so the iteration that chooses again waits
// as wait() without prefetch does (the compute stream following the updates too). Once complete,
// a second call returns at once.
void Runtime::Impl::complete_prefetched_pass() {
  if (!prefetching()) return;
  await_iterations(passes_handed);
  syncs_awaited = true;  // Note [A window of another schedule]
  if (shard) shard->join_compute();
}

}  // namespace shardflow
