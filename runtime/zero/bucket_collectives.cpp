#include "runtime/zero/bucket_collectives.hpp"

#include <string>

#include "runtime/core/bucket_buffers.hpp"
#include "runtime/core/device_memory.hpp"
#include "runtime/plans/bucket_plan.hpp"
#include "runtime/observe/timeline.hpp"
#include "runtime/zero/shard.hpp"

namespace shardflow {

BucketCollectives::BucketCollectives(std::uint32_t bucket, const BucketSources& from)
    : b_(bucket),
      numel_(from.plan->buckets[bucket].numel),
      dtype_(from.plan->buckets[bucket].dtype),
      bufs_(from.bufs),
      shard_(from.shard),
      events_(from.events),
      timeline_(from.timeline),
      hook_(from.hook),
      divisor_(from.divisor),
      rank_(from.rank),
      world_(from.world) {
  if (!hook_) return;
  const auto& bk = from.plan->buckets[bucket];
  layout_.index = bucket;
  layout_.rank = rank_;
  layout_.world = world_;
  layout_.dtype = dtype_;
  layout_.numel = numel_;
  for (const auto& e : bk.entries) layout_.params.push_back({(*from.params)[e.param].name, (*from.params)[e.param].shape, e.offset});
}

namespace {

// A hook's phase as the comm stream issues it: its all-reduces, and its continuation as `then`
// (Note [Comm hooks]). A phase that submits nothing runs its continuation at once.
CollectiveIssue hook_phase(HookRun run, std::uint32_t b, const std::string& hook, int phase, std::shared_ptr<std::byte> bucket) {
  while (run.ops().empty() && run.next()) {
    HookRun next;
    run.next()(next);
    run = std::move(next);
  }
  CollectiveIssue issue;
  for (const auto& o : run.ops()) {
    CollectiveOp op;
    op.kind = CollectiveKind::allreduce;
    op.dtype = o.dtype;
    op.send = op.recv = o.data;
    op.count = o.count;
    op.scale = o.scale;
    op.tag = "bucket " + std::to_string(b) + " (comm hook " + hook + ", phase " + std::to_string(phase) + ")";
    op.keep_alive = bucket;
    issue.ops.push_back(std::move(op));
  }
  if (issue.ops.empty()) return issue;
  issue.then = [next = std::move(run.next()), b, hook, phase, bucket](CollectiveIssue& out) {
    if (!next) return false;
    HookRun r;
    next(r);
    out = hook_phase(std::move(r), b, hook, phase + 1, bucket);
    return !out.ops.empty();
  };
  return issue;
}

}  // namespace

CollectiveIssue BucketCollectives::reduction(std::uint64_t iteration) const {
  const auto b = b_;
  if (hook_) {
    auto grad = bufs_->grad(b);
    GradBucket bucket = layout_;
    bucket.iteration = iteration;
    bucket.average = divisor_ ? divisor_->load(std::memory_order_acquire) : 1.0f / float(world_);
    bucket.data = grad.get();
    HookRun run;
    hook_->reduce(bucket, run);
    auto issue = hook_phase(std::move(run), b, hook_->name(), 1, grad);
    if (issue.ops.empty())
      throw UsageError("comm hook '" + hook_->name() + "' issued no collective for bucket " + std::to_string(b) +
                       ": a hook must reduce the bucket across the ranks");
    return issue;
  }
  const auto& sh = shard_;
  const auto& tl = timeline_;
  const bool rs = sh && sh->reduce_scatters();
  const std::size_t count = rs ? sh->shard_plan().buckets[b].slice : numel_;
  // Config::precision.comm_dtype: fp32 gradients travel as 16-bit (cast at issue, back on completion).
  const DType wire = sh ? sh->sync_dtype(b) : dtype_;
  CollectiveIssue issue;
  CollectiveOp op;
  op.wait_event = events_->get(b);  // GPU buckets: after the backward kernels that wrote them
  op.dtype = wire;
  // The average, fused into the reduction: over the ranks still training with uneven inputs.
  op.scale = divisor_ ? divisor_->load(std::memory_order_acquire) : 1.0f / float(world_);
  op.tag = "bucket " + std::to_string(b);
  op.count = count;
  auto grad = bufs_->grad(b);
  std::shared_ptr<std::byte> send = grad, recv = grad;
  if (rs) {  // into the rank's own shard, or (not pooled) its slice of the bucket, in place
    recv = sh->grad_shard(b);
    if (!recv) recv = std::shared_ptr<std::byte>(grad, grad.get() + std::size_t(rank_) * count * dtype_size(dtype_));
  }
  if (wire != dtype_) {
    // Cast the whole (padded) bucket; the result comes back into the fp32 buffer it left.
    auto wire_buf = sh->wire_buffer(b);
    const std::size_t n = sh->shard_plan().buckets[b].padded;
    const auto c0 = Timeline::now();
    op.wait_event = sh->to_wire(b, events_->get(b));
    if (tl->tracing())
      tl->span("cast bucket " + std::to_string(b) + " to " + dtype_name(wire), "cast", Lane::cast_to, c0, Timeline::now(),
               SpanArgs{std::int64_t(b), std::int64_t(n * 4), dtype_name(wire), -1, -1});
    const std::size_t out = rs ? count : n;
    std::byte* out_wire = rs ? wire_buf.get() + n * dtype_size(wire) : wire_buf.get();
    issue.on_complete = [sh, b, out_wire, out, recv, wire_buf, tl, wire] {
      const auto c1 = Timeline::now();
      sh->from_wire(b, reinterpret_cast<float*>(recv.get()), out_wire, out);
      if (tl->tracing())
        tl->span("cast bucket " + std::to_string(b) + " from " + dtype_name(wire), "cast", Lane::cast_from, c1, Timeline::now(),
                 SpanArgs{std::int64_t(b), std::int64_t(out * 4), "fp32", -1, -1});
    };
    send = wire_buf;
    recv = wire_buf;
    op.recv = out_wire;
  } else {
    op.recv = recv.get();
  }
  op.send = send.get();
  op.kind = rs ? CollectiveKind::reduce_scatter : CollectiveKind::allreduce;
  op.keep_alive = std::make_shared<std::pair<std::shared_ptr<std::byte>, std::shared_ptr<std::byte>>>(send, recv);
  auto* mirror = sh ? sh->mirror() : nullptr;
  CollectiveOp shift;
  // Note [Mirrored shards]: the reduced slice, as it landed, to the twin `distance` ranks on (Note
  // [Syncs from the twin]: in the sync's place instead).
  if (mirror && rs && !sh->shifts_in_sync()) shift = twin_shift(recv, static_cast<std::byte*>(op.recv), "mirror bucket " + std::to_string(b));
  issue.ops.push_back(std::move(op));
  if (shift.kind == CollectiveKind::shift) issue.ops.push_back(std::move(shift));
  return issue;
}

CollectiveOp BucketCollectives::twin_shift(std::shared_ptr<std::byte> slice_owner, std::byte* slice, std::string tag) const {
  auto* mirror = shard_->mirror();
  CollectiveOp shift;
  shift.kind = CollectiveKind::shift;
  shift.dtype = shard_->sync_dtype(b_);
  shift.send = slice;
  shift.recv = mirror->landing(b_).get();
  shift.count = shard_->shard_plan().buckets[b_].slice;
  shift.distance = mirror->distance();
  shift.tag = std::move(tag);
  shift.keep_alive = std::make_shared<std::pair<std::shared_ptr<std::byte>, std::shared_ptr<std::byte>>>(std::move(slice_owner), mirror->landing(b_));
  return shift;
}

// Note [Syncs from the twin]: the reduced slice where the reduction left it, untouched since: the
// owner's step read it and packed nothing (over two levels it packs once this shift has landed:
// Shard::twin_shifted), and the next reduction of this bucket comes after forward took its
// parameters, so after this shift landed.
CollectiveIssue BucketCollectives::shift_as_sync() const {
  const auto& bs = shard_->shard_plan().buckets[b_];
  std::shared_ptr<std::byte> owner;
  std::byte* slice = nullptr;
  if (shard_->sync_dtype(b_) != dtype_) {  // after the padded bucket in its wire buffer
    owner = shard_->wire_buffer(b_);
    slice = owner.get() + bs.padded * dtype_size(shard_->sync_dtype(b_));
  } else if ((owner = shard_->grad_shard(b_))) {
    slice = owner.get();
  } else {
    owner = bufs_->grad(b_);
    slice = owner.get() + std::size_t(rank_) * bs.slice * dtype_size(dtype_);
  }
  CollectiveIssue issue;
  // It is the bucket's sync (the collective log, the fault injection's "sync" phase say so).
  issue.ops.push_back(twin_shift(std::move(owner), slice, "sync bucket " + std::to_string(b_) + " (the shift to the twin)"));
  return issue;
}

CollectiveIssue BucketCollectives::sync() const {
  if (shard_->shifts_in_sync()) return shift_as_sync();
  const auto b = b_;
  const auto& bs = shard_->shard_plan().buckets[b];
  CollectiveIssue issue;
  if (bs.flat) {
    issue.ops.push_back(staged_op(CollectiveKind::allgather, bs.slice, "sync bucket " + std::to_string(b)));
    auto& op = issue.ops.back();
    op.send = static_cast<std::byte*>(op.recv) + std::size_t(rank_) * bs.slice * dtype_size(op.dtype);
    return issue;
  }
  for (int k = 0; k < world_; ++k) {
    if (bs.packed[std::size_t(k)] == 0) continue;
    auto op = staged_op(CollectiveKind::broadcast, bs.packed[std::size_t(k)], "sync bucket " + std::to_string(b) + " from rank " + std::to_string(k));
    op.send = op.recv = static_cast<std::byte*>(op.recv) + bs.packed_start[std::size_t(k)] * dtype_size(op.dtype);
    op.root = k;
    issue.ops.push_back(std::move(op));
  }
  return issue;
}

// Note [Syncs from the twin, two levels]: every rank's staging holds its own block and its twin's
// (the source's, a host away), so the gather runs inside each host alone.
CollectiveIssue BucketCollectives::twin_gather() const {
  const auto& bs = shard_->shard_plan().buckets[b_];
  CollectiveIssue issue;
  issue.ops.push_back(staged_op(CollectiveKind::allgather, bs.slice, "sync bucket " + std::to_string(b_) + " (inside the host, after the twin's step)"));
  auto& op = issue.ops.back();
  op.send = static_cast<std::byte*>(op.recv) + std::size_t(rank_) * bs.slice * dtype_size(op.dtype);
  op.in_host = true;
  return issue;
}

// An op on the bucket's staging (recv at its start), taken by the step's pack, after the pack.
CollectiveOp BucketCollectives::staged_op(CollectiveKind kind, std::size_t count, std::string tag) const {
  auto staging = bufs_->staging(b_);
  CollectiveOp op;
  op.kind = kind;
  op.dtype = shard_->sync_dtype(b_);
  op.count = count;
  op.tag = std::move(tag);
  op.wait_event = shard_->pack_event(b_);
  op.recv = staging.get();
  op.keep_alive = std::move(staging);
  return op;
}

CollectiveIssue BucketCollectives::group_sync(std::uint32_t g, std::uint32_t last_packed) const {
  const auto* fused = shard_->fused_syncs();
  const auto& group = fused->fusion.groups[g];
  const auto& buf = fused->buffers[g];
  const std::size_t es = dtype_size(group.dtype);
  CollectiveOp op;
  op.kind = CollectiveKind::allgather;
  op.dtype = group.dtype;
  op.count = group.slice;
  op.send = buf.get() + std::size_t(rank_) * group.slice * es;
  op.recv = buf.get();
  op.tag = "sync bucket " + std::to_string(b_) + " and " + std::to_string(group.members.size() - 1) + " more (fused)";
  op.wait_event = shard_->pack_event(last_packed);
  op.keep_alive = buf;
  CollectiveIssue issue;
  issue.ops.push_back(std::move(op));
  return issue;
}

CollectiveIssue norm_exchange(const std::shared_ptr<Shard>& shard) {
  CollectiveIssue issue;
  CollectiveOp op;
  op.kind = CollectiveKind::allgather;
  op.send = shard->norm_buffer().get() + shard->shard_plan().rank;
  op.recv = shard->norm_buffer().get();
  op.count = 1;
  op.tag = "grad norm";
  op.wait_event = shard->norm_event();
  op.keep_alive = shard->norm_buffer();
  issue.ops.push_back(std::move(op));
  return issue;
}

}  // namespace shardflow
