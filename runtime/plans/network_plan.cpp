#include "runtime/plans/network_plan.hpp"

#include <algorithm>

#include "shardflow/errors.hpp"
#include "shardflow/shm.hpp"
#include "shardflow/types.hpp"

namespace shardflow {

std::size_t network_bytes(CollectiveKind kind, std::size_t bytes, int hosts, int per_host, bool two_levels) {
  if (hosts <= 1) return 0;
  const auto H = std::size_t(hosts), W = H * std::size_t(per_host);
  // Note [Bytes on the network]; the rings' shares divide evenly here (whole blocks per rank).
  switch (kind) {
    case CollectiveKind::allreduce:
      return two_levels ? 2 * (H - 1) * bytes : 2 * H * (W - 1) * bytes / W;
    case CollectiveKind::reduce_scatter:
    case CollectiveKind::allgather:
      return two_levels ? (H - 1) * bytes : H * (W - 1) * bytes / W;
    case CollectiveKind::broadcast:
      return (H - 1) * bytes;
    case CollectiveKind::barrier:
      return 0;
    case CollectiveKind::shift:  // by whole hosts (Note [Shift]): every rank's block crosses once
      return W * bytes;
  }
  return 0;
}

NetworkPlan make_network_plan(const BucketPlan& plan, const ShardPlan& shard, int world, int hosts, bool two_levels, DType comm_dtype,
                              bool sharded, bool stage2, bool reduce_scatter, int twin_distance, bool twin_syncs) {
  if (hosts < 1 || world % hosts != 0)
    throw UsageError("--hosts " + std::to_string(hosts) + " does not divide the world of " + std::to_string(world) +
                     " ranks into hosts of as many ranks each");
  NetworkPlan np;
  np.hosts = hosts;
  np.per_host = world / hosts;
  np.two_levels = two_levels && hosts > 1 && np.per_host > 1;
  // `in_host`: only the stages inside the hosts run (CollectiveOp::in_host): nothing leaves them,
  // and no scratch between the levels.
  auto add = [&](std::vector<NetworkCollective>& out, CollectiveKind kind, std::size_t bytes, bool in_host = false) {
    NetworkCollective c{kind, bytes, in_host ? 0 : network_bytes(kind, bytes, hosts, np.per_host, np.two_levels),
                        network_bytes(kind, bytes, hosts, np.per_host, false)};
    np.per_step += c.network;
    np.flat_ring_per_step += c.flat_ring;
    if (np.two_levels && !in_host)
      np.scratch_largest = std::max(np.scratch_largest, (bytes + std::size_t(np.per_host) - 1) / std::size_t(np.per_host));
    out.push_back(c);
  };
  if (np.two_levels) np.second_segment = ShmOptions{}.staging_bytes;
  // A shift's blocks leave a host only from the ranks whose twin lives on another host.
  std::size_t crossing = 0;
  for (int r = 0; twin_distance && r < world; ++r) crossing += r / np.per_host != ((r + twin_distance) % world) / np.per_host;
  auto shift = [&](std::vector<NetworkCollective>& out, std::size_t slice) {
    const std::size_t leaving = hosts > 1 ? crossing * slice : 0;
    np.per_step += leaving;
    np.flat_ring_per_step += leaving;
    out.push_back(NetworkCollective{CollectiveKind::shift, slice * std::size_t(world), leaving, leaving});
  };
  for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
    const auto& bk = plan.buckets[b];
    const auto& bs = shard.buckets[b];
    // What the bucket travels as (Shard::sync_dtype): fp32 buckets as comm_dtype.
    const std::size_t es = dtype_size(bk.dtype == DType::f32 ? comm_dtype : bk.dtype);
    auto& out = np.buckets.emplace_back();
    if (!sharded) {
      add(out, CollectiveKind::allreduce, bk.numel * es);
      continue;
    }
    if (bs.flat && (stage2 || reduce_scatter))
      add(out, CollectiveKind::reduce_scatter, bs.padded * es);
    else
      add(out, CollectiveKind::allreduce, bk.numel * es);
    if (twin_distance) shift(out, bs.slice * es);
    if (twin_syncs && !np.two_levels) continue;  // Note [Syncs from the twin]: at world 2 the shift is the sync
    if (bs.flat)  // Note [Syncs from the twin, two levels]: with twin_syncs, gathered inside the hosts alone
      add(out, CollectiveKind::allgather, bs.padded * es, twin_syncs);
    else
      for (std::size_t k = 0; k < bs.packed.size(); ++k)
        if (bs.packed[k]) add(out, CollectiveKind::broadcast, bs.packed[k] * es);
  }
  return np;
}

}  // namespace shardflow
