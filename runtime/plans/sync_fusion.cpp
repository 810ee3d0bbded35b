#include "runtime/plans/sync_fusion.hpp"

#include <algorithm>

namespace shardflow {

std::size_t SyncFusion::fused_buckets() const {
  std::size_t n = 0;
  for (const auto& g : groups) n += g.members.size();
  return n;
}

std::size_t fusable_bytes(const ShardPlan& shard, std::size_t b, DType wire, std::size_t max_bytes) {
  const auto& bs = shard.buckets[b];
  if (max_bytes == 0 || !shard.sharded || shard.world < 2 || !bs.flat || bs.slice == 0) return 0;
  // At most half the cap, so that any two can share a group: a bucket that could only sync alone
  // takes no room in the fusion buffer (bench_overlap's 16 x 256 KiB: none).
  const std::size_t bytes = std::size_t(shard.world) * bs.slice * dtype_size(wire);
  return bytes <= max_bytes / 2 ? bytes : 0;
}

std::size_t fusion_buffer_bytes(const ShardPlan& shard, const std::vector<DType>& wire, std::size_t max_bytes) {
  std::size_t total = 0, n = 0;
  for (std::size_t b = 0; b < shard.buckets.size(); ++b)
    if (const auto bytes = fusable_bytes(shard, b, wire[b], max_bytes)) total += bytes, ++n;
  return n < 2 ? 0 : std::min(total, kFusedGroups * max_bytes);
}

SyncFusion fuse_syncs(const std::vector<ScheduledCollective>& order, const ShardPlan& shard, const std::vector<DType>& wire,
                      std::size_t max_bytes) {
  SyncFusion out;
  out.group_of.assign(shard.buckets.size(), SyncFusion::kAlone);
  out.position.assign(shard.buckets.size(), 0);
  if (max_bytes == 0 || !shard.sharded || shard.world < 2) return out;
  SyncGroup open;
  std::size_t held = 0;  // the groups' buffers so far
  auto close = [&] {
    if (open.members.size() >= 2 && held + open.bytes(shard.world) <= kFusedGroups * max_bytes) {
      open.at = held;
      held += open.bytes(shard.world);
      for (std::size_t m = 0; m < open.members.size(); ++m) {
        out.group_of[open.members[m]] = std::uint32_t(out.groups.size());
        out.position[open.members[m]] = std::uint32_t(m);
      }
      out.groups.push_back(std::move(open));
    }
    open = SyncGroup{};
  };
  for (const auto& e : order) {
    if (e.kind != ScheduledCollective::sync) {  // only syncs with nothing between them fuse
      close();
      continue;
    }
    const auto& bs = shard.buckets[e.bucket];
    const DType dt = wire[e.bucket];
    const std::size_t bytes = fusable_bytes(shard, e.bucket, dt, max_bytes);
    if (bytes == 0) {  // syncs alone, and ends the run
      close();
      continue;
    }
    if (!open.members.empty() && (dt != open.dtype || open.bytes(shard.world) + bytes > max_bytes)) close();
    open.dtype = dt;
    open.members.push_back(e.bucket);
    open.offset.push_back(open.slice);
    open.slice += bs.slice;
  }
  close();
  return out;
}

}  // namespace shardflow
