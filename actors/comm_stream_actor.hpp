#pragma once

#include <caf/fwd.hpp>
#include <caf/stateful_actor.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "runtime/collective_log.hpp"
#include "runtime/logging.hpp"
#include "shardflow/communicator.hpp"

namespace shardflow {

// One step of a rank's collective schedule. Every rank builds the same schedule from the same plan,
// so issuing strictly in schedule order keeps the ranks' collectives in the same order.
struct ScheduleEntry {
  enum Kind : std::uint8_t { reduce, norm, sync };
  Kind kind = reduce;
  std::uint32_t bucket = 0;
  // Builds the entry's collectives when it is issued, not before: pooled buckets (ZeRO-2) hold a
  // different buffer every iteration. The ops go out back to back; `on_complete` (if any) runs on
  // the stream thread once the last one completed, before anyone is told (casting a 16-bit
  // reduction back into fp32, Config::comm_dtype).
  struct Issue {
    std::vector<CollectiveOp> ops;
    std::function<void()> on_complete;
  };
  std::function<Issue()> make_ops;
};

// The order of a rank's collectives for one iteration (Note [Collective schedule] in
// comm_stream_actor.cpp).
// interleave_syncs: the first `interleaved` syncs (in sync order) go out between the reductions,
// S(i) after R(i + lag); the others after the last reduction.
std::vector<ScheduleEntry::Kind> schedule_shape(std::size_t buckets, bool syncs, bool norm, bool interleave_syncs,
                                                std::size_t lag = 0, std::size_t interleaved = ~std::size_t{0});

struct CommStreamState {
  std::shared_ptr<Communicator> comm;
  std::vector<ScheduleEntry> entries;
  std::vector<char> ready;
  std::vector<std::uint32_t> reduce_entry, sync_entry;  // by bucket
  std::uint32_t norm_entry = ~0u, last_reduce_entry = 0;
  std::vector<caf::actor> owners;  // the bucket actor to tell when its reduction completes
  caf::actor shard;                // the shard actor, when the runtime runs the optimizer
  std::uint32_t next = 0;          // the next entry to issue
  std::uint64_t iteration = 0;     // the runtime's synchronised iteration being issued (timeline)
  std::shared_ptr<CollectiveLog> log;
  std::shared_ptr<spdlog::logger> logger;
  static inline const char* name = "comm_stream";
};

// Owns the order of collectives on one rank: entry i is issued only after entries 0..i-1, so every
// rank issues the same sequence whatever order gradients, steps and messages arrive in.
caf::behavior comm_stream_actor(caf::stateful_actor<CommStreamState>* self, std::shared_ptr<Communicator> comm,
                                std::vector<ScheduleEntry> entries, std::shared_ptr<CollectiveLog> log,
                                std::uint64_t first_iteration);

}  // namespace shardflow
