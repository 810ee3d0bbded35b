// Note [Rank 0's state everywhere]
// Data parallelism assumes every rank holds the same model; nothing in the gradients' average
// repairs ranks that started apart (the average is applied to different parameters, and they stay
// different forever, without a word). So, as PyTorch's DDP constructor does, finalize() broadcasts
// every parameter and registered buffer from rank 0 before the buckets are built (the fp32 masters
// and the optimizer state are made from the synced values). Config::sync.initial turns it off for
// trainers that guarantee equal starts themselves.
// With snapshots (Config::snapshot.dir) the broadcast waits for resumed_step(), which such a
// trainer must call before its first backward (or it is refused, naming it): a run that resumes
// gets its parameters from the snapshot, the same files on every rank, so broadcasting them first
// was wasted time, and on the link: every restart, every in-place recovery and every node that
// joins paid it (0.56 s of a join's pause at 64 MiB of parameters over 1 Gbit/s, bench/RESULTS.md
// "A node joins live"). A fresh start (step 0) broadcasts there instead, and the shard's fp32
// masters, made from this rank's own parameters at configure_optimizer(), are made again from the
// synced ones. Buffers, which snapshots do not hold, are broadcast either way. So between
// finalize() and resumed_step() each rank's parameters are still its own.
// Buffers (running statistics, counters) get no gradient, but forward updates them on each rank
// from its own batch. With Config::sync.buffers every synchronised iteration broadcasts them from
// rank 0, as DDP's broadcast_buffers does before each forward: here it is an entry of the
// collective schedule right after the last reduction (Note [Collective schedule]), handed to the
// comm stream when backward ends, since backward does not touch buffers and rank 0's values are
// final then. wait() returns only after it completed, with forward prefetch too, so the next
// forward never reads a buffer the link is writing.
#include "runtime/rank/runtime_impl.hpp"
#include "runtime/semantics/semantics_state.hpp"

namespace shardflow {
namespace {

// A buffer moves as raw 32- or 16-bit words (the backends copy a broadcast's elements without
// interpreting them).
CollectiveOp buffer_broadcast(const BufferSpec& b) {
  CollectiveOp op;
  op.kind = CollectiveKind::broadcast;
  op.dtype = b.bytes % 4 == 0 ? DType::f32 : DType::f16;
  op.send = op.recv = b.data;
  op.count = b.bytes / dtype_size(op.dtype);
  op.root = 0;
  op.tag = "buffer '" + b.name + "' from rank 0";
  return op;
}

}  // namespace

void Runtime::Impl::broadcast_params(int root, const char* what, bool frozen_only) {
  // The trainer may have written device parameters asynchronously on its compute stream.
  if (mem->on_gpu()) cuda::stream_sync(mem->stream);
  for (const auto& p : registry.params()) {
    if (frozen_only && p.requires_grad) continue;
    CollectiveOp op;
    op.kind = CollectiveKind::broadcast;
    op.dtype = p.dtype;
    op.send = op.recv = p.data;
    op.count = std::size_t(numel(p.shape));
    op.root = root;
    op.tag = std::string(what) + ": parameter '" + p.name + "' from rank " + std::to_string(root);
    if (op.count == 0) continue;
    run_now(op);
  }
}

void Runtime::Impl::sync_initial_state() {
  if (world == 1 || !cfg.sync.initial) return;
  semantics->state_sync.initial_deferred = true;
  if (cfg.snapshot.dir.empty()) finish_initial_sync(false);  // no resumed_step() to wait for
}

void Runtime::Impl::finish_initial_sync(bool loaded) {
  if (!std::exchange(semantics->state_sync.initial_deferred, false)) return;
  if (!loaded) {
    broadcast_params(0, "initial sync");
    if (shard) shard->masters_from_params();
  }
  sync_initial_buffers();
}

void Runtime::Impl::sync_initial_buffers() {
  for (const auto& b : registry.buffers()) {
    if (b.bytes == 0) continue;
    auto op = buffer_broadcast(b);
    op.tag = "initial sync: " + op.tag;
    run_now(op);
  }
}

bool Runtime::Impl::syncs_buffers() const {
  if (world == 1 || !cfg.sync.buffers) return false;
  for (const auto& b : registry.buffers())
    if (b.bytes > 0) return true;
  return false;
}

void Runtime::Impl::send_buffers() {
  CollectiveIssue issue;
  // Device buffers: forward wrote them on the compute stream; the broadcast waits for that on the
  // device (an event recorded now, after every kernel of this forward and backward was enqueued).
  void* written = nullptr;
  if (mem->on_gpu()) {
    if (!semantics->state_sync.buffers_event) semantics->state_sync.buffers_event = std::shared_ptr<void>(cuda::event_create(mem->device.index), [](void* e) { cuda::event_destroy(cuda::Event(e)); });
    cuda::event_record(cuda::Event(semantics->state_sync.buffers_event.get()), mem->stream);
    written = semantics->state_sync.buffers_event.get();
  }
  for (const auto& b : registry.buffers())
    if (b.bytes > 0) {
      issue.ops.push_back(buffer_broadcast(b));
      issue.ops.back().wait_event = written;
    }
  hand_over(ScheduledCollective::buffers, std::move(issue));
}

}  // namespace shardflow
