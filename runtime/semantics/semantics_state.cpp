// SemanticsState's making and what concerns all of the folder's features at once.
#include "runtime/semantics/semantics_state.hpp"

#include "runtime/rank/runtime_impl.hpp"

namespace shardflow {

std::shared_ptr<SemanticsState> Runtime::Impl::make_semantics_state() { return std::make_shared<SemanticsState>(); }

void Runtime::Impl::size_param_counts(std::size_t params) {
  semantics->unused.reset(params);
  semantics->graph.reset(params);
}

}  // namespace shardflow
