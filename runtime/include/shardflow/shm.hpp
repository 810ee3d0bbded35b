// The shared-memory backend: CPU collectives between processes on one host through one POSIX
// shared-memory segment. Rendezvous (the segment's name, a same-host check) goes through the
// shardflow TCP store. Ranks on several hosts use Gloo.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "shardflow/communicator.hpp"
#include "shardflow/store.hpp"

namespace shardflow {

struct ShmOptions : StoreRendezvous {
  ShmOptions() { key_prefix = "shm/"; }
  // Each rank's staging area in the segment; larger ops run in pieces of this size (three barriers
  // a piece). The segment takes world_size times this from /dev/shm.
  std::size_t staging_bytes = std::size_t{16} << 20;
};

// A collective over the store: every rank calls it. CommError if the ranks are not on one host
// (name the hosts) or /dev/shm refuses the segment.
std::shared_ptr<Communicator> make_shm_communicator(const ShmOptions& options);

}  // namespace shardflow
