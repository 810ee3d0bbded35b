#include "runtime/plans/collective_schedule.hpp"

#include <string>

#include "runtime/bucket_buffers.hpp"
#include "runtime/plans/bucket_plan.hpp"
#include "runtime/device_memory.hpp"
#include "runtime/zero/shard.hpp"
#include "runtime/timeline.hpp"

namespace shardflow {
namespace {

// The kinds in order; the buckets are assigned by collective_order.
std::vector<ScheduleEntry::Kind> shape(std::size_t B, bool syncs, bool norm, bool interleave, std::size_t lag,
                                       std::size_t interleaved) {
  std::vector<ScheduleEntry::Kind> k;
  if (syncs && interleave && !norm) {
    std::size_t synced = 0;
    for (std::size_t b = 0; b < B; ++b) {
      k.push_back(ScheduleEntry::reduce);
      if (b >= lag && synced < interleaved) {
        k.push_back(ScheduleEntry::sync);  // S(b - lag)
        ++synced;
      }
    }
    for (; synced < B; ++synced) k.push_back(ScheduleEntry::sync);
    return k;
  }
  for (std::size_t b = 0; b < B; ++b) k.push_back(ScheduleEntry::reduce);
  if (norm) k.push_back(ScheduleEntry::norm);
  if (syncs)
    for (std::size_t b = 0; b < B; ++b) k.push_back(ScheduleEntry::sync);
  return k;
}

}  // namespace

std::vector<ScheduledCollective> collective_order(const ScheduleSpec& s) {
  std::vector<ScheduledCollective> out;
  std::uint32_t reduced = 0, synced = 0;
  for (auto kind : shape(s.buckets, s.syncs, s.norm, s.interleave, s.lag, s.interleaved_syncs)) {
    std::uint32_t bucket = 0;
    if (kind == ScheduleEntry::reduce) bucket = reduced++;
    if (kind == ScheduleEntry::sync) {
      bucket = s.sync_order.empty() ? synced : s.sync_order[synced];
      ++synced;
    }
    out.push_back({kind, bucket});
  }
  return out;
}

std::vector<ScheduleEntry> make_collective_schedule(const std::vector<ScheduledCollective>& order, const ScheduleSources& from) {
  const auto& plan = *from.plan;
  const auto& bufs = from.bufs;
  const auto& shard = from.shard;
  const auto& events = from.events;
  const auto& timeline = from.timeline;
  const int rank = from.rank, world = from.world;
  std::vector<ScheduleEntry> entries;
  for (const auto& c : order) {
    ScheduleEntry e;
    e.kind = c.kind;
    e.bucket = c.bucket;
    if (c.kind == ScheduleEntry::reduce) {
      const auto b = c.bucket;
      const auto& bk = plan.buckets[b];
      const bool rs = shard && shard->reduce_scatters();
      const std::size_t count = rs ? shard->shard_plan().buckets[b].slice : bk.numel;
      const float scale = 1.0f / float(world);  // the average, fused into the reduction
      // Config::precision.comm_dtype: fp32 gradients travel as 16-bit (cast at issue, back on completion).
      const DType wire = shard ? shard->sync_dtype(b) : bk.dtype;
      e.make_ops = [bufs = bufs, sh = shard, ev = events, b, rs, count, scale, dtype = bk.dtype, wire, tl = timeline] {
        ScheduleEntry::Issue issue;
        CollectiveOp op;
        op.wait_event = ev->get(b);  // GPU buckets: after the backward kernels that wrote them
        op.dtype = wire;
        op.scale = scale;
        op.tag = "bucket " + std::to_string(b);
        auto grad = bufs->grad(b);
        op.count = count;
        std::shared_ptr<std::byte> send = grad, recv = rs ? sh->grad_shard(b) : grad;
        if (wire != dtype) {
          // Cast the whole (padded) bucket; the result comes back into the fp32 buffer it left.
          auto wire_buf = sh->wire_buffer(b);
          const std::size_t n = sh->shard_plan().buckets[b].padded;
          const auto c0 = Timeline::now();
          op.wait_event = sh->to_wire(b, ev->get(b));
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
        issue.ops.push_back(std::move(op));
        return issue;
      };
    } else if (c.kind == ScheduleEntry::norm) {
      e.make_ops = [sh = shard, r = rank] {
        ScheduleEntry::Issue issue;
        CollectiveOp op;
        op.kind = CollectiveKind::allgather;
        op.send = sh->norm_buffer().get() + r;
        op.recv = sh->norm_buffer().get();
        op.count = 1;
        op.tag = "grad norm";
        op.wait_event = sh->norm_event();
        op.keep_alive = sh->norm_buffer();
        issue.ops.push_back(std::move(op));
        return issue;
      };
    } else {
      const auto b = c.bucket;
      e.make_ops = [bufs = bufs, sh = shard, bs = shard->shard_plan().buckets[b], b, r = rank, W = world,
                    dtype = shard->sync_dtype(b)] {
        ScheduleEntry::Issue issue;
        auto& ops = issue.ops;
        auto staging_buf = bufs->staging(b);  // taken by the step's pack
        std::byte* staging = staging_buf.get();
        const std::size_t es = dtype_size(dtype);
        if (bs.flat) {
          CollectiveOp op;
          op.kind = CollectiveKind::allgather;
          op.dtype = dtype;
          op.send = staging + std::size_t(r) * bs.slice * es;
          op.recv = staging;
          op.count = bs.slice;
          op.tag = "sync bucket " + std::to_string(b);
          op.wait_event = sh->pack_event(b);
          op.keep_alive = staging_buf;
          ops.push_back(std::move(op));
        } else {
          for (int k = 0; k < W; ++k) {
            if (bs.packed[std::size_t(k)] == 0) continue;
            CollectiveOp op;
            op.kind = CollectiveKind::broadcast;
            op.dtype = dtype;
            op.send = op.recv = staging + bs.packed_start[std::size_t(k)] * es;
            op.count = bs.packed[std::size_t(k)];
            op.root = k;
            op.tag = "sync bucket " + std::to_string(b) + " from rank " + std::to_string(k);
            op.wait_event = sh->pack_event(b);
            op.keep_alive = staging_buf;
            ops.push_back(std::move(op));
          }
        }
        return issue;
      };
    }
    entries.push_back(std::move(e));
  }
  return entries;
}

}  // namespace shardflow
