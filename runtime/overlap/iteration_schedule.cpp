// The iteration's collectives in the order every rank issues them (Note [Collective schedule],
// plans/collective_schedule.cpp), from the overlap choices this folder made: the interleave lag and,
// with forward prefetch, the sync order and how many syncs go inside backward.
#include "runtime/rank/runtime_impl.hpp"
#include "runtime/overlap/overlap_state.hpp"
#include "runtime/plans/sync_fusion.hpp"

namespace shardflow {

std::vector<ScheduledCollective> Runtime::Impl::build_schedule() const {
  ScheduleSpec spec;
  spec.buckets = plan.buckets.size();
  spec.syncs = shard && shard->syncs();
  spec.norm = spec.syncs && shard->exchanges_norm();
  spec.buffers = syncs_buffers();
  spec.unused = finds_unused();
  // Syncs in the observed forward order: only the first prefetch.early interleave, each after the
  // next bucket's reduction (Note [Forward prefetch]): a reduction never queues behind a step
  // then, and the sync left over for after backward is needed second by forward, which waits
  // for the first.
  const bool in_forward_order = !overlap->prefetch.sync_order.empty();
  spec.interleave = cfg.zero.overlap == Overlap::interleaved && (!in_forward_order || overlap->prefetch.early > 0);
  spec.lag = in_forward_order ? std::max<std::size_t>(1, overlap->lag.lag) : overlap->lag.lag;
  spec.sync_order = overlap->prefetch.sync_order;
  spec.interleaved_syncs = in_forward_order ? overlap->prefetch.early : spec.buckets;
  // Note [Syncs from the twin, two levels]: the sync shifts to the twin, the gather follows.
  spec.twin_gathers = spec.syncs && shard->twin_in_host();
  // Note [Syncs in batches]: what each sync would move where it could fuse (the buckets
  // fuse_syncs may group), 0 where it syncs alone. Syncs the twins give never fuse.
  if (spec.syncs && cfg.zero.fuse_syncs_bytes > 0 && !shard->shifts_in_sync()) {
    spec.fuse_bytes = cfg.zero.fuse_syncs_bytes;
    for (std::size_t b = 0; b < spec.buckets; ++b)
      spec.sync_bytes.push_back(fusable_bytes(shard->shard_plan(), b, shard->sync_dtype(b), spec.fuse_bytes));
  }
  return collective_order(spec);
}

}  // namespace shardflow
