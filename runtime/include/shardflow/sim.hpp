// The simulated link: a backend that moves the real data through another backend (in-process by
// default) and completes each collective only when an alpha-beta model of a link says the link is
// done with it. It costs time but no CPU, so overlap can be measured on a machine whose cores are
// busy with compute, and a run at 2 real ranks can be charged the time of an N-rank ring.
//
// Note [Simulated link]
// Per rank, one link that carries one collective at a time, in issue order (one NCCL stream). A
// collective occupies the link from max(when the real data movement finished, when the link became
// free) — the data cannot move before every rank issued it — for its model cost:
//   allreduce        2(N-1) (alpha + bytes / (N beta))   ring: reduce-scatter then allgather
//   reduce_scatter    (N-1) (alpha + bytes / (N beta))   bytes: the full (unscattered) buffer
//   allgather         (N-1) (alpha + bytes / (N beta))   bytes: the full (gathered) buffer
//   broadcast         (N-1) alpha + bytes / beta          a chunked pipeline along the ring
//   barrier           2(N-1) alpha
// Completions are held by a timer thread that sleeps until the deadline (no spinning) and are
// delivered in issue order. Failures of the wrapped backend are delivered at once (behind
// completions already due), so a failing peer is never hidden behind link time.
#pragma once

#include <chrono>
#include <memory>

#include "shardflow/communicator.hpp"

namespace shardflow {

struct SimLink {
  double latency_us = 5.0;        // alpha: per message step, microseconds (>= 0)
  double gbytes_per_s = 10.0;     // beta: 10^9 bytes per second (> 0)
  // N in the model: 0 charges the real world size; larger values project an N-rank ring while the
  // real ranks run (must not be smaller than the real world).
  int sim_world = 0;
  // Each byte moved is charged as this many: projections of a large model run on scaled-down
  // buffers (the link's time is that of the full model; the real data stay small). 1: off.
  double charge_factor = 1.0;
  // Throws UsageError naming the field for negative latency, non-positive bandwidth, or a
  // sim_world below `real_world`.
  void validate(int real_world) const;
  // The model's time for one collective of `bytes` (as described in Note [Simulated link]).
  std::chrono::nanoseconds cost(CollectiveKind kind, std::size_t bytes, int world) const;
};

// Wraps any backend: the data moves through `inner`, completions wait for the modelled link.
std::shared_ptr<Communicator> simulate_link(std::shared_ptr<Communicator> inner, SimLink link);

// N ranks as threads over the in-process backend, each behind a simulated link.
std::shared_ptr<InProcessWorld> make_sim_world(int world_size, SimLink link,
                                               std::chrono::milliseconds timeout = std::chrono::minutes(10));

}  // namespace shardflow
