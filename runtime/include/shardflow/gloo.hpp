// The Gloo backend: CPU collectives between processes (or hosts) over TCP, rendezvous through the
// shardflow TCP store (Gloo has no TCP store of its own).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "shardflow/communicator.hpp"
#include "shardflow/store.hpp"

namespace shardflow {

struct GlooOptions : StoreRendezvous {
  GlooOptions() { key_prefix = "gloo/"; }
  std::string hostname = "127.0.0.1";  // the address this rank's Gloo transport listens on
};

// Connects to the store and to every peer (a collective over the store: every rank calls it).
std::shared_ptr<Communicator> make_gloo_communicator(const GlooOptions& options);

}  // namespace shardflow
