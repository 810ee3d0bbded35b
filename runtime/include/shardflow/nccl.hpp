// The NCCL backend: one process per GPU. Collectives run on the rank's comm stream (a
// high-priority CUDA stream) after the event in CollectiveOp::wait_event, completion reaches the
// caller through `done` from a watcher thread (Note [Device completions]), and every op has the
// timeout: past it the communicator is aborted (ncclCommAbort unblocks kernels stuck on a dead
// peer) and the op fails naming itself. The NCCL unique id travels through the store.
#pragma once

#include <memory>

#include "shardflow/communicator.hpp"
#include "shardflow/store.hpp"

namespace shardflow {

struct NcclOptions : StoreRendezvous {
  NcclOptions() { key_prefix = "nccl/"; }
  // The GPU this rank uses; -1: rank % visible devices (one process per GPU on each node; the
  // launcher's LOCAL_RANK is what init_process_group passes).
  int device = -1;
};

// Whether this build has NCCL (the CUDA toolkit and libnccl were found at configure time).
bool nccl_compiled();
std::shared_ptr<Communicator> make_nccl_communicator(const NcclOptions& options);

}  // namespace shardflow
