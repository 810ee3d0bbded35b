// What one bucket puts on the link: its reduction (with the 16-bit cast around it) and, with a
// sharded optimizer, the sync of its updated parameters. Each bucket actor owns one of these and
// hands it to the comm stream with its readiness (Note [Collective schedule]: the comm stream
// decides when, the bucket decides what).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shardflow/comm_hook.hpp"
#include "shardflow/communicator.hpp"

namespace shardflow {

class BucketBuffers;
class BucketEvents;
class Shard;
class Timeline;
struct BucketPlan;

// One schedule entry's collectives, built when the entry is issued, not before: pooled buckets
// (ZeRO-2) hold a different buffer every iteration. The ops go out back to back; `on_complete` (if
// any) runs on the stream thread once the last one completed, before anyone is told (casting a
// 16-bit reduction back into fp32, Config::precision.comm_dtype).
struct CollectiveIssue {
  std::vector<CollectiveOp> ops;
  std::function<void()> on_complete;
  // A comm hook's phase (Note [Comm hooks]): runs on the stream thread once the ops completed;
  // true with the next phase in `next`, false when the reduction is done.
  std::function<bool(CollectiveIssue& next)> then;
};

// Where a bucket's ops find their buffers. `shard` is null without the runtime's optimizer.
struct BucketSources {
  const BucketPlan* plan = nullptr;
  std::shared_ptr<BucketBuffers> bufs;
  std::shared_ptr<Shard> shard;
  std::shared_ptr<BucketEvents> events;
  std::shared_ptr<Timeline> timeline;
  int rank = 0, world = 1;
  std::shared_ptr<CommHook> hook;                // null: the runtime's own reduction
  const std::vector<ParamSpec>* params = nullptr;  // names and shapes for the hook's GradBucket
  // Config::join.uneven_inputs: 1 / the ranks training this iteration (Note [Uneven inputs]).
  std::shared_ptr<const std::atomic<float>> divisor;
};

class BucketCollectives {
 public:
  BucketCollectives(std::uint32_t bucket, const BucketSources& from);

  std::uint32_t bucket() const { return b_; }
  // The averaged reduction of the bucket's gradients: an all-reduce, or a reduce-scatter into this
  // rank's gradient shard (ZeRO-2, flat partition); cast to the wire dtype first and back after.
  // With a comm hook, the hook's phases instead (all-reduce reductions only). `iteration`: the
  // synchronised iteration being issued.
  CollectiveIssue reduction(std::uint64_t iteration) const;
  // The updated parameters from their owners: an all-gather of the packed slices (flat partition)
  // or one broadcast per owning rank. Only with a sharded optimizer (ZeRO 1 and 2). With twins at
  // world 2, or a host away over two levels, the shift of the reduced slice to the twin instead
  // (Note [Syncs from the twin]; Note [Syncs from the twin, two levels]).
  CollectiveIssue sync() const;
  // Note [Syncs from the twin, two levels]: after the shift, the all-gather inside the hosts of
  // the slices the owners and the twins packed.
  CollectiveIssue twin_gather() const;
  // This bucket leads fused group g (Note [Fused syncs]): one all-gather of every member's slices
  // in the group's buffer, after `last_packed`'s pack (the member packed last: the shard's packs
  // follow each other on its stream).
  CollectiveIssue group_sync(std::uint32_t g, std::uint32_t last_packed) const;

 private:
  // Note [Mirrored shards]: the shift of this bucket's reduced slice (`slice`, kept alive by its
  // owner) to the twin; shift_as_sync: that shift as the bucket's sync (Note [Syncs from the twin]).
  CollectiveOp twin_shift(std::shared_ptr<std::byte> slice_owner, std::byte* slice, std::string tag) const;
  CollectiveIssue shift_as_sync() const;
  CollectiveOp staged_op(CollectiveKind kind, std::size_t count, std::string tag) const;
  std::uint32_t b_;
  std::size_t numel_;
  DType dtype_;
  std::shared_ptr<BucketBuffers> bufs_;
  std::shared_ptr<Shard> shard_;
  std::shared_ptr<BucketEvents> events_;
  std::shared_ptr<Timeline> timeline_;
  std::shared_ptr<CommHook> hook_;
  std::shared_ptr<const std::atomic<float>> divisor_;
  GradBucket layout_;  // what the hook sees, less the iteration
  int rank_, world_;
};

// The clipping norm exchange: every rank's partial norm to every rank.
CollectiveIssue norm_exchange(const std::shared_ptr<Shard>& shard);

}  // namespace shardflow
