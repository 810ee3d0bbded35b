// OverlapState's making and what concerns both overlap choices at once.
#include "runtime/overlap/overlap_state.hpp"

#include "runtime/rank/runtime_impl.hpp"

namespace shardflow {

std::shared_ptr<OverlapState> Runtime::Impl::make_overlap_state(const Config& cfg) { return std::make_shared<OverlapState>(cfg); }

void Runtime::Impl::forget_overlap_choices() {
  overlap->prefetch.forget();
  overlap->lag.forget(cfg);
}

}  // namespace shardflow
