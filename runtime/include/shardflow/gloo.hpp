// The Gloo backend: CPU collectives between processes (or hosts) over TCP, rendezvous through the
// shardflow TCP store (Gloo has no TCP store of its own).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "shardflow/communicator.hpp"

namespace shardflow {

struct GlooOptions {
  int rank = 0;
  int world_size = 1;
  std::string store_host = "127.0.0.1";
  std::uint16_t store_port = 0;
  std::string token;
  std::string key_prefix = "gloo/";  // several communicators can share one store
  std::string hostname = "127.0.0.1";  // the address this rank's Gloo transport listens on
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
};

// Connects to the store and to every peer (a collective over the store: every rank calls it).
std::shared_ptr<Communicator> make_gloo_communicator(const GlooOptions& options);

}  // namespace shardflow
