// A whole run's plan on every rank, computed without running it: the buckets (in reduce order),
// who owns which parameter or slice, and each rank's memory for parameters, gradients, optimizer
// state and communication buffers. `shardflow plan` prints it; the runtime builds its buckets and
// shards with the same functions (make_bucket_plan, make_shard_plan, bucket_caps), and
// memory_report() measures what this predicts.
//
// Note [Memory at the ZeRO formula]
// Per rank, Psi parameters of fp32, N ranks, Adam (two fp32 state words per owned element):
//   stage 0: params 4Psi + grads 4Psi   + state 8Psi
//   stage 1: params 4Psi + grads 4Psi   + state 8Psi/N
//   stage 2: params 4Psi + grads 4Psi/N + state 8Psi/N   + the buckets in flight
// (16-bit parameters: 2Psi each for params and grads, plus 4Psi/N of fp32 masters.) Stage 2 holds a
// bucket's full gradient buffer only from its first gradient until its reduce-scatter has landed
// in the rank's 1/N shard, and a staging buffer from its step until its parameter sync is done
// (Note [Pooled buckets (ZeRO-2)]). Its buckets in flight get a budget: two buckets of the larger
// of the cap and the default 25 MiB (or, if more, one slot per pool buffer of the largest
// parameter), but never more than sharding the gradients saves, 4Psi(N-1)/N, so that stage 2
// never holds more than stage 1 and a large model stays within the formula plus two buckets (the
// savings alone as the budget let the pool grow to all of them). By default the in-flight
// limits are kStage2GradsInFlight gradient buffers and kStagingInFlight staging buffers (with one
// overrun buffer: pool_buffers), and the bucket caps shrink until that many of the largest
// (padded) bucket fit in the budget; the gradient buffers in flight then grow to as many as the
// rest of the budget holds (bucket_caps: more in flight, less backpressure on a slow link). When
// one parameter alone is larger than that, holding buckets only while in flight could cost more
// than it saves: stage 2 then keeps whole buckets as stage 1 does and reduce-scatters each into
// the rank's own slice of it, in place (BucketCaps::pooled off, BucketCaps::warning says why).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "runtime/plans/bucket_plan.hpp"
#include "runtime/plans/network_plan.hpp"
#include "runtime/plans/shard_plan.hpp"
#include "shardflow/config.hpp"

namespace shardflow {

// Stage 2's buckets in flight by default (Config::zero.max_buckets_in_flight = 0): at least one
// gradient buffer being written while one is reduced, and two staging buffers (a step packs the
// next bucket while the previous one's sync is on the link); both more where the budget holds
// them (the bucket caps are sized for these least counts, then the counts grow into what is left
// of the budget: Note [Staging in flight], run_plan.cpp).
inline constexpr std::size_t kStage2GradsInFlight = 2;
inline constexpr std::size_t kStagingInFlight = 2;
// Buffers stage 2's pool may hold at once: the gradient buffers in flight, one more taken while
// every held one is still being written (backpressure waits only when a reduction is on its way,
// so that it never deadlocks: BucketBuffers::grad), and the staging buffers.
constexpr std::size_t pool_buffers(std::size_t grads_in_flight, std::size_t staging_in_flight = kStagingInFlight) {
  return grads_in_flight + 1 + staging_in_flight;
}

// How many gradient buffers must be free before a trainer that waited for one goes on (Note
// [Backpressure in refills], runtime/core/bucket_buffers.cpp): a quarter of those in flight.
constexpr std::size_t backpressure_refill(std::size_t grads_in_flight) { return grads_in_flight / 4 > 1 ? grads_in_flight / 4 : 1; }

struct PlanSettings {
  int world = 1;
  ZeroStage stage = ZeroStage::ddp;
  Partition partition = Partition::flat;
  std::size_t first_cap_bytes = BucketConfig{}.first_cap_bytes;
  std::size_t last_cap_bytes = BucketConfig{}.last_cap_bytes;  // 0: no small last bucket
  std::size_t cap_bytes = 0;                  // 0: the default, kDefaultBucketCapBytes (BucketConfig::cap_bytes)
  std::optional<std::size_t> min_buckets;     // unset: kDefaultMinBuckets with the default cap, none with a set one
  std::size_t max_buckets_in_flight = 0;  // 0: the stage-2 default
  std::size_t state_slots = 0;            // fp32 words of optimizer state per owned element (SGD 0, momentum 1, Adam 2)
  DType comm_dtype = DType::f32;
  bool optimizer = true;  // the runtime steps (configure_optimizer); off: plain DDP, no shard
  bool reduce_scatter = true;  // Config::zero.reduce_scatter
  std::size_t fuse_syncs_bytes = ZeroConfig{}.fuse_syncs_bytes;  // Note [Fused syncs]
  // Hosts the world spans (ranks in consecutive blocks per host), and whether collectives go in two
  // levels (the hierarchical backend) or the flat ring: what crosses the network (NetworkPlan).
  int hosts = 1;
  bool two_levels = true;
  // Note [Mirrored shards]: Config::zero.redundancy (2: each rank keeps a twin of the shard of the
  // rank twin_distance back) and twin_distance (0: a host's ranks with several hosts, else 1).
  int redundancy = 1;
  int twin_distance = 0;

  static PlanSettings from(const Config& cfg, int world, std::size_t state_slots, bool optimizer);
};

// Bucket caps after stage 2's memory budget (Note [Memory at the ZeRO formula]); the caps as
// configured otherwise. `pooled`: whether stage 2 holds buckets only while in flight.
struct BucketCaps {
  std::size_t first = 0, cap = 0;
  std::size_t last = 0;  // Note [A small last bucket] (0: none); never above `cap`
  // Which rule set each cap, for `shardflow plan` and the runtime's log: "as set", "the default",
  // "min_buckets 4: 32.03 MiB / 4", "stage 2's in-flight budget".
  std::string first_rule, cap_rule, last_rule;
  // The buckets these caps make of `params` walked in `order`.
  BucketPlan plan(const std::vector<ParamSpec>& params, const std::vector<std::uint32_t>& order) const;
  bool pooled = false;
  std::size_t grads_in_flight = 0;  // gradient buffers held at once (pooled)
  std::size_t staging_in_flight = kStagingInFlight;  // stepped buckets whose sync has not landed (pooled)
  std::size_t budget = 0;           // stage 2: bytes the buckets in flight may take
  std::string warning;              // stage 2 over its budget: which parameter, and what to do
  // Pooled: the pool in one line, as `shardflow plan` and the runtime's log give it ("stage 2's
  // pool: 36 gradient bucket(s) and 13 sync(s) in flight within 0.49 MiB, refilled 9 at a time ...").
  std::string pool_line() const;
};
// The twin distance these settings give (twin_distance as the runtime resolves it under a launcher
// that runs the hosts' ranks), 0 when no rank keeps a twin (redundancy 1, world 1, no sharded
// optimizer); UsageError for redundancy 2 where the runtime refuses it, naming why.
int plan_twin_distance(const PlanSettings& s);
// Note [Syncs from the twin]: whether the twins give the syncs under these settings (world 2 on
// two hosts, as twins_give_syncs decides in the runtime; or two levels at two hosts with the twin a
// host away, as Shard decides it: Note [Syncs from the twin, two levels]).
bool plan_syncs_from_twin(const PlanSettings& s);

// UsageError, naming `setting`, when a limit of stage 2's gradient buffers in flight (`limit`, 0:
// none set) is not what these caps do: another stage, or stage 2 keeping whole buckets (sharding
// saves too little on the model, or nothing at world 1), holds every bucket's buffer, so the limit
// would silently hold nothing back. Every rank makes the same caps and refuses at the same point.
void check_in_flight_honoured(const BucketCaps& caps, std::size_t limit, int stage, const std::string& setting);
// `order`: the gradient order the buckets will be made in (make_bucket_plan's).
BucketCaps bucket_caps(const std::vector<ParamSpec>& params, const std::vector<std::uint32_t>& order, const PlanSettings& s);

struct RankMemory {
  std::size_t params = 0, grads = 0, optimizer_state = 0, comm_buffers = 0;
  std::size_t total() const { return params + grads + optimizer_state + comm_buffers; }
};

// What rank `rank` allocates for this plan: exactly, except stage 2's pooled gradient buffers,
// which are counted at their bound (pool_buffers of the largest bucket).
RankMemory plan_memory(const std::vector<ParamSpec>& params, const BucketPlan& plan, const ShardPlan& shard,
                       const PlanSettings& s, const BucketCaps& caps);

struct RunPlan {
  PlanSettings settings;
  BucketCaps caps;
  std::vector<ParamSpec> params;
  BucketPlan buckets;
  std::vector<ShardPlan> shards;    // per rank
  std::vector<RankMemory> memory;   // per rank
  // The ZeRO formula for these parameters (stage, N, state slots, 16-bit masters), per rank.
  RankMemory formula;
  NetworkPlan network;  // per step, between hosts (one host: nothing)
  // Note [Mirrored shards]: the twin distance (0: none), and what the twins cost each rank: the
  // state (in `memory` already) and the bytes each rank shifts per step (syncs_from_twin: at world
  // 2, in place of the all-gather, Note [Syncs from the twin]; over two levels, of its stage
  // between the hosts).
  int twin_distance = 0;
  std::size_t twin_state_bytes = 0, twin_shift_bytes = 0;
  bool syncs_from_twin = false;

  std::string describe() const;  // for people: buckets, owners, memory per rank
  std::string to_json() const;   // {"buckets": [...], "ranks": [...]}
};

// UsageError for a world below 1, no parameters, or hosts that do not divide the world.
RunPlan make_run_plan(std::vector<ParamSpec> params, const PlanSettings& s);

}  // namespace shardflow
