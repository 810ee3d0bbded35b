// Who this rank is and what every role on it shares: its settings, its communicator, where its
// buckets live, its parameters, its logs and its sticky failure. Held by Runtime::Impl
// (runtime/rank/runtime_impl.hpp); every other role of the rank reads it.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <string>

#include "runtime/core/bucket_buffers.hpp"
#include "runtime/core/device_memory.hpp"
#include "runtime/core/param_registry.hpp"
#include "runtime/core/rank_failure.hpp"
#include "runtime/observe/collective_log.hpp"
#include "runtime/observe/logging.hpp"
#include "runtime/observe/timeline.hpp"
#include "runtime/process/process_actor_system.hpp"
#include "shardflow/communicator.hpp"
#include "shardflow/config.hpp"
#include "shardflow/errors.hpp"
#include "shardflow/types.hpp"

namespace shardflow {

struct RankContext {
  Config cfg;
  std::shared_ptr<Communicator> comm;
  int rank = 0, world = 1;
  std::uint32_t owner = 0;  // tells this Runtime's parameter handles from another's
  std::shared_ptr<spdlog::logger> log;
  std::shared_ptr<ProcessActorSystem> actors;  // the process's CAF actor system, shared by its Runtimes
  ParamRegistry registry;
  // Where the buckets live: the parameters' device (all of a Runtime's parameters share one), and
  // for CUDA the trainer's compute stream that bucket copies, zeroing and events go on.
  std::shared_ptr<MemoryOps> mem = std::make_shared<MemoryOps>();  // shared with the zeroer and events
  bool device_bound = false;  // set by the first registered parameter
  std::shared_ptr<CollectiveLog> collectives = std::make_shared<CollectiveLog>();
  // Spans of this rank's work and the figures of stats() (Note [Timeline]); a file with trace_path.
  std::shared_ptr<Timeline> timeline;
  RankFailure failure;  // sticky: once a collective failed, this rank's run is over

  // Bucket memory from the backend (Communicator::allocate): shared memory for shm, so that its
  // collectives read the peers' buckets in place.
  // Weak: buffers (and the shard holding them) may be released last on a backend thread, which
  // must never be the one to destroy the communicator that owns the thread.
  BucketBuffers::Allocate allocator() const {
    return [w = std::weak_ptr<Communicator>(comm)](std::size_t n) {
      const auto c = w.lock();
      if (!c) throw CommError("bucket memory requested after the communicator was destroyed");
      return c->allocate(n);
    };
  }
  BucketBuffers::Zero zeroer() const {
    return [m = mem](std::byte* p, std::size_t n) { m->zero(p, n); };
  }

  void throw_if_failed() const { failure.rethrow_if_failed(); }
  // Records the failure (the first one stays), tells the peers (they fail promptly instead of
  // waiting for the timeout).
  void record_failure(std::exception_ptr e, const char* what) {
    log->error("{}", what);
    failure.record(std::move(e));
    comm->abort(what);
  }
  // The same, then throws it.
  template <class E>
  [[noreturn]] void fail(E error) {
    record_failure(std::make_exception_ptr(error), error.what());
    throw error;
  }

  std::uint32_t check_handle(Param p, const char* where) const {
    if (p.owner != owner)
      throw UsageError(std::string(where) + ": parameter handle #" + std::to_string(p.index) +
                       (p.owner == 0 ? " was never registered" : " belongs to another Runtime"));
    if (p.index >= registry.size())
      throw UsageError(std::string(where) + ": unknown parameter handle #" + std::to_string(p.index) + " (rank " +
                       std::to_string(rank) + " has " + std::to_string(registry.size()) + " parameters)");
    return p.index;
  }
  // A frozen parameter (ParamSpec::requires_grad false) has no gradient to ask for or report.
  std::uint32_t check_trainable(Param p, const char* where) const {
    const auto i = check_handle(p, where);
    if (!registry.params()[i].requires_grad)
      throw UsageError(std::string(where) + ": parameter '" + name_of(i) + "' is frozen (requires_grad = false) and gets no gradient; "
                       "set_requires_grad(p, true) and refresh_trainable() to train it");
    return i;
  }
  const std::string& name_of(std::uint32_t i) const { return registry.params()[i].name; }
};

}  // namespace shardflow
