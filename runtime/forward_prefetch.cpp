// Note [Forward prefetch]
// With Config::zero.forward_prefetch, wait() returns once backward is handed over, and the trainer
// calls wait_param(p) before its forward uses p. The first iteration waits fully (buckets are
// rebuilt after it); in the second the runtime records the order in which forward first asks
// for each bucket; at its end rank 0's order is broadcast and the syncs are issued in it from
// then on, so the parameters the next forward needs first arrive first.
// Syncs after backward overlap the next forward; but when backward leaves the link idle between
// reductions (compute-bound), syncs sent then (interleaved, each after the next bucket's
// reduction) are free, and fewer are left for the forward to wait on. So the sync order is: K
// buckets in backward's order, then the rest in forward order. K (Config::
// prefetch_syncs_in_backward, or chosen here from this iteration, rank 0's) is how many syncs
// fit in backward's idle link time: backward's length minus its reductions' link time. When the
// link is the bottleneck that is none, and every sync overlaps the next forward (sending syncs
// in backward then would only push the forward's first sync further back: measured, 4 ms of
// idle link per iteration at link/compute 4).
#include "runtime/runtime_impl.hpp"

namespace shardflow {

void Runtime::Impl::establish_sync_order() {
  std::vector<std::uint32_t> order;
  {
    std::lock_guard lock(forward_mu);
    observing_forward = false;
    order = forward_order;
  }
  const std::size_t B = plan.buckets.size();
  std::vector<char> have(B, 0);
  for (auto b : order) have[b] = 1;
  for (std::size_t b = B; b-- > 0;)  // never asked for: forward runs back to front
    if (!have[b]) order.push_back(std::uint32_t(b));
  order.push_back(std::uint32_t(choose_early_syncs()));  // rank 0's choice travels with its order
  if (world > 1) {
    CollectiveOp op;
    op.kind = CollectiveKind::broadcast;
    op.dtype = DType::f32;  // 32-bit words copied as they are
    op.send = op.recv = order.data();
    op.count = order.size();
    op.tag = "forward order";
    collectives->record(op);
    comm->run(op, cfg.timeouts.collective);
  }
  prefetch_early = std::min<std::size_t>(order.back(), B);
  order.pop_back();
  // Early syncs in bucket (backward) order, then the rest in forward order.
  std::vector<char> late(B, 0);
  for (std::size_t i = 0; i < B - prefetch_early; ++i) late[order[i]] = 1;
  sync_order.clear();
  for (std::uint32_t b = 0; b < B; ++b)
    if (!late[b]) sync_order.push_back(b);
  for (std::size_t i = 0; i < B - prefetch_early; ++i) sync_order.push_back(order[i]);
  log->info("forward prefetch: {} of {} parameter syncs interleaved with backward, {} overlap the next forward", prefetch_early, B,
            B - prefetch_early);
  prefetch_active = true;
  stop_actors();
  spawn_actors(iterations + 1);  // inside wait(): the actors start the next iteration
}

std::size_t Runtime::Impl::choose_early_syncs() const {
  const std::size_t B = plan.buckets.size();
  if (cfg.zero.overlap != Overlap::interleaved || !shard || !shard->syncs()) return 0;
  if (cfg.zero.prefetch_syncs_in_backward >= 0) return std::min<std::size_t>(std::size_t(cfg.zero.prefetch_syncs_in_backward), B);
  const auto open = timeline->stats().open_window();
  std::vector<double> bytes(B);
  double total = 0;
  for (std::size_t b = 0; b < B; ++b) total += bytes[b] = double(shard->shard_plan().buckets[b].padded) * dtype_size(shard->sync_dtype(b));
  if (total <= 0 || open.sync_ms <= 0) return 0;
  const double ms_per_byte = open.sync_ms / total;
  const double idle = open.backward_ms - open.reduce_ms;
  // The syncs forward needs last (backward's first buckets) go first; the one forward needs first
  // cannot go before backward ends anyway.
  std::size_t k = 0;
  double t = 0;
  while (k + 1 < B && (t += bytes[k] * ms_per_byte) <= idle) ++k;
  return k;
}

}  // namespace shardflow
