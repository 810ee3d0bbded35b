#pragma once

#include <caf/fwd.hpp>
#include <caf/stateful_actor.hpp>

#include <cstdint>
#include <memory>
#include <vector>

#include "runtime/collective_log.hpp"
#include "runtime/logging.hpp"
#include "shardflow/communicator.hpp"

namespace shardflow {

struct CommStreamState {
  std::shared_ptr<Communicator> comm;
  std::vector<CollectiveOp> ops;  // one per bucket, prebuilt: buffers, count, fused 1/world scale
  std::vector<caf::actor> owners;  // the bucket actor to tell when op b completes
  std::vector<char> ready;
  std::uint32_t next = 0;  // the next bucket to issue; collectives go out strictly in this order
  std::shared_ptr<CollectiveLog> log;
  std::shared_ptr<spdlog::logger> logger;
  static inline const char* name = "comm_stream";
};

// Owns the order of collectives on one rank: bucket b is issued only after buckets 0..b-1, so
// every rank issues the same sequence whatever order gradients and messages arrive in.
caf::behavior comm_stream_actor(caf::stateful_actor<CommStreamState>* self, std::shared_ptr<Communicator> comm,
                                std::vector<CollectiveOp> ops, std::shared_ptr<CollectiveLog> log);

}  // namespace shardflow
