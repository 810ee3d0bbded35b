// The plan this rank runs now: its buckets, their buffers, readiness and events, the shard and the
// actors spawned for it, and the signal they report to. Megatron's _ParamAndGradBuffer holds the
// like. Installed, rebuilt and stopped by Runtime::Impl (runtime_plan.cpp); replaced whole when
// the buckets are rebuilt.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "actors/messages.hpp"
#include "runtime/core/bucket_buffers.hpp"
#include "runtime/core/bucket_readiness.hpp"
#include "runtime/core/device_memory.hpp"
#include "runtime/core/iteration_signal.hpp"
#include "runtime/plans/bucket_plan.hpp"
#include "runtime/plans/run_plan.hpp"
#include "runtime/zero/shard.hpp"

namespace shardflow {

struct InstalledPlan {
  std::mutex finalize_mu;
  std::atomic<bool> finalized{false};
  BucketPlan plan;
  BucketCaps caps;  // the plan's bucket caps and stage 2's in-flight limits (Note [Memory at the ZeRO formula])
  std::shared_ptr<BucketBuffers> bufs;  // the buckets' flat buffers (Note [Pooled buckets (ZeRO-2)])
  // Each bucket's gradients still to come in this synchronised pass (Note [One count per bucket]).
  std::unique_ptr<BucketReadiness> readiness;
  std::shared_ptr<BucketEvents> events;  // per bucket of the current plan (no-ops on the CPU)

  // The runtime's optimizer (configure_optimizer): the groups' hyper-parameters and this rank's shard.
  std::shared_ptr<OptimizerGroups> groups;
  std::shared_ptr<Shard> shard;

  // Actors of the current plan (replaced once if the buckets are rebuilt).
  msg::comm_stream_actor_t comm_actor_h;
  msg::shard_actor_t shard_actor_h;  // none without the runtime's optimizer
  std::vector<msg::bucket_actor_t> bucket_actors;
  std::shared_ptr<IterationSignal> signal;
  std::uint64_t passes_handed = 0;  // synchronised iterations handed to the current actors
};

}  // namespace shardflow
