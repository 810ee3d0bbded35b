// Two-level collectives for several ranks per host (Note [Two-level collectives],
// runtime/comm/hierarchical_comm.cpp): one communicator among the ranks of this host (shared
// memory), one among the ranks of the same local index on every host (the network). An all-reduce
// is a reduce-scatter inside the host, an all-reduce of 1/L of the buffer across hosts by each
// local rank at once, and an all-gather inside the host: the network carries 1/L of the flat
// ring's bytes per rank.
#pragma once

#include <memory>

#include "shardflow/communicator.hpp"

namespace shardflow {

// Rank = cross->rank() * local->world_size() + local->rank() (hosts hold consecutive ranks, as
// `shardflow run` numbers them); every host has the same number of ranks. Host memory only.
// UsageError for a null or mismatched pair.
std::shared_ptr<Communicator> make_hierarchical(std::shared_ptr<Communicator> local, std::shared_ptr<Communicator> cross);

}  // namespace shardflow
