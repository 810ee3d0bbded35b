// Two-level collectives for several ranks per host (Note [Two-level collectives],
// runtime/comm/hierarchical_comm.cpp): one communicator among the ranks of this host (shared
// memory), one among the ranks of the same local index on every host (the network). An all-reduce
// is a reduce-scatter inside the host, an all-reduce of 1/L of the buffer across hosts by each
// local rank at once, and an all-gather inside the host: each rank sends only its 1/L across
// hosts. At 2 hosts x 2 ranks that is 2/3 of what the flat ring puts on the network, the least an
// exact reduction can (Note [Bytes on the network], runtime/plans/network_plan.hpp).
#pragma once

#include <memory>

#include "shardflow/communicator.hpp"

namespace shardflow {

// Rank = cross->rank() * local->world_size() + local->rank() (hosts hold consecutive ranks, as
// `shardflow run` numbers them); every host has the same number of ranks. Host memory only.
// `local_after`, a second communicator among the same ranks of this host, carries the stages after
// the network (the all-gathers), so that collectives overlap: one bucket is gathered inside the
// host while the next crosses the network and the one after is reduced inside the host. Without
// it the collectives run one after the other. UsageError for a null or mismatched communicator.
std::shared_ptr<Communicator> make_hierarchical(std::shared_ptr<Communicator> local, std::shared_ptr<Communicator> cross,
                                                std::shared_ptr<Communicator> local_after = nullptr);

}  // namespace shardflow
