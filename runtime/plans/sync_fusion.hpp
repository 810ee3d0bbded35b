// Which parameter syncs go out as one all-gather.
//
// Note [Fused syncs]
// A sync costs a bucket three hops and two crossings between the CAF workers and the backend's
// thread (step_done to the comm stream, the submission, the completion back to the shard), whatever
// its size. For small buckets that is most of their cost: bench_overhead's 100 buckets of 10 KiB
// made ZeRO-1 1.7-2x DDP's per-iteration overhead, DDP's bucket making 4 hops where ZeRO-1's makes 7
// (bench/RESULTS.md, "Per-bucket overhead"). So syncs that follow each other in the schedule, with
// nothing between them, go out as one all-gather when together they move at most
// Config::zero.fuse_syncs_bytes: every rank packs its slice of each member into its region of a
// group buffer laid out rank by rank ([rank 0: member 0's slice, member 1's, ...][rank 1: ...]),
// one all-gather fills the others' regions, and each member unpacks from there.
// The grouping is a function of the schedule and the shard plan, so every rank forms the same
// groups and issues the same collectives. Only runs of consecutive syncs fuse: a group waits for
// the last of its members to step, and a member's reduction always comes before its sync in the
// schedule (Note [An early sync after its own reduction]), so every member's reduction precedes
// the group's entry and the wait cannot close a cycle. Only flat partitions (one all-gather a
// bucket) of one wire dtype fuse, each bucket at most half the cap; a group of one is no group.
// The price: a member's parameters are ready when the group's last member stepped and the group
// synced, not when its own sync would have; the cap keeps that to small buckets (the default
// 256 KiB is 2 ms at 1 Gbit/s). And memory: each group has a buffer of its own for the plan's life
// (the members' padded bytes), beside the buckets (stage 1) or instead of pooled staging (stage 2).
// The groups live in one buffer per plan, made once whatever the schedule (the interleave lag and
// the forward order are chosen later, and change the groups): every bucket that could fuse, at most
// kFusedGroups x the cap (1 MiB by default), none when fewer than two buckets could fuse. It counts
// in MemoryReport::comm_buffers and in `shardflow plan`'s; the runs beyond it sync alone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "runtime/plans/collective_schedule.hpp"
#include "runtime/plans/shard_plan.hpp"
#include "shardflow/types.hpp"

namespace shardflow {

struct SyncGroup {
  std::vector<std::uint32_t> members;  // in schedule order
  std::vector<std::size_t> offset;     // [member] elements into each rank's region
  std::size_t slice = 0;               // elements of each rank's region (the members' slices)
  std::size_t at = 0;                  // bytes into the plan's fusion buffer
  DType dtype = DType::f32;            // the wire dtype every member syncs in
  std::size_t bytes(int world) const { return std::size_t(world) * slice * dtype_size(dtype); }
};

struct SyncFusion {
  static constexpr std::uint32_t kAlone = ~0u;
  std::vector<SyncGroup> groups;
  std::vector<std::uint32_t> group_of;  // [bucket] index into groups, or kAlone
  std::vector<std::uint32_t> position;  // [bucket] its place among its group's members
  bool fused(std::size_t b) const { return b < group_of.size() && group_of[b] != kAlone; }
  std::size_t fused_buckets() const;
};

// The groups' buffers together hold at most this many caps.
inline constexpr std::size_t kFusedGroups = 4;

// What bucket b's sync moves if it can fuse (flat, not empty, within half the cap), else 0.
std::size_t fusable_bytes(const ShardPlan& shard, std::size_t b, DType wire, std::size_t max_bytes);
// The plan's fusion buffer: every group of any schedule fits in it.
std::size_t fusion_buffer_bytes(const ShardPlan& shard, const std::vector<DType>& wire, std::size_t max_bytes);

// The groups of `order` (the iteration's schedule) for this shard plan: `wire[b]` is bucket b's
// sync dtype, `max_bytes` the most one group's all-gather moves (0: nothing fuses), and all the
// groups' buffers at most kFusedGroups x max_bytes.
SyncFusion fuse_syncs(const std::vector<ScheduledCollective>& order, const ShardPlan& shard, const std::vector<DType>& wire,
                      std::size_t max_bytes);

}  // namespace shardflow
