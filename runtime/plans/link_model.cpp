// The simulated link's model (Note [Simulated link] in shardflow/sim.hpp): pure, so that `shardflow
// plan --timings` prices collectives with the very formula the simulated backend charges.
#include <cstdio>
#include <string>

#include "shardflow/errors.hpp"
#include "shardflow/sim.hpp"

namespace shardflow {
namespace {
std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", v);
  return b;
}
}  // namespace

void SimLink::validate(int real_world) const {
  if (!(latency_us >= 0.0)) throw UsageError("sim link: latency must be >= 0 microseconds, got " + num(latency_us));
  if (!(gbytes_per_s > 0.0))
    throw UsageError("sim link: bandwidth must be > 0 GB/s, got " + num(gbytes_per_s));
  if (sim_world != 0 && sim_world < real_world)
    throw UsageError("sim link: simulated world " + std::to_string(sim_world) + " is smaller than the real world " +
                     std::to_string(real_world) + " (it charges an N-rank ring to the real ranks: N >= world size)");
  if (!(charge_factor > 0.0)) throw UsageError("sim link: charge factor must be > 0, got " + num(charge_factor));
  if (sim_world < 0) throw UsageError("sim link: simulated world must be >= 0 (0: the real world size)");
}

std::chrono::nanoseconds SimLink::cost(CollectiveKind kind, std::size_t bytes, int world) const {
  const double N = sim_world > 0 ? sim_world : world;
  if (N <= 1) return std::chrono::nanoseconds(0);
  const double alpha = latency_us * 1e3;            // ns
  const double per_byte = 1.0 / gbytes_per_s;      // ns per byte (10^9 bytes/s = 1 byte/ns)
  const double B = double(bytes) * charge_factor;
  double ns = 0;
  switch (kind) {
    case CollectiveKind::allreduce: ns = 2 * (N - 1) * (alpha + B / N * per_byte); break;
    case CollectiveKind::reduce_scatter:
    case CollectiveKind::allgather: ns = (N - 1) * (alpha + B / N * per_byte); break;
    case CollectiveKind::broadcast: ns = (N - 1) * alpha + B * per_byte; break;
    case CollectiveKind::barrier: ns = 2 * (N - 1) * alpha; break;
    case CollectiveKind::shift: ns = alpha + B * per_byte; break;  // each rank's block once, all at the same time
  }
  return std::chrono::nanoseconds(std::int64_t(ns));
}

}  // namespace shardflow
