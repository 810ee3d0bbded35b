// PersistenceState's making, and the background save's end with the runtime.
#include "runtime/checkpoint/background_save.hpp"

#include "runtime/rank/runtime_impl.hpp"

namespace shardflow {

std::shared_ptr<PersistenceState> Runtime::Impl::make_persistence_state() { return std::make_shared<PersistenceState>(); }

void Runtime::Impl::finish_background_save() { persistence->saves.finish_writer(); }

}  // namespace shardflow
