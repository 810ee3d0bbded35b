#include "runtime/comm/gloo_ring.hpp"

#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "kernels/cpu/elementwise.hpp"
#include "shardflow/communicator.hpp"
#include "shardflow/errors.hpp"

namespace shardflow {
namespace {

// Gloo gives each collective kind a slot prefix (gloo/types.h uses 0x01-0x08); ours stays clear
// of them, so a reduce-scatter and a Gloo collective with the same tag never match each other.
constexpr std::uint8_t kReduceScatterSlotPrefix = 0x40;
constexpr std::uint8_t kRingAllgatherSlotPrefix = 0x41;
constexpr std::uint8_t kShiftSlotPrefix = 0x42;

// A block cut into segments of GlooRing::kSegmentBytes (the last one shorter).
struct Segments {
  Segments(std::size_t elems, std::size_t es) : es(es), per(std::max<std::size_t>(1, GlooRing::kSegmentBytes / es)), elems(elems) {
    count = (elems + per - 1) / per;
  }
  std::size_t offset(std::size_t k) const { return k * per * es; }
  std::size_t bytes(std::size_t k) const { return std::min(per, elems - k * per) * es; }
  std::size_t es, per, elems, count = 0;
};

// Block k of a ring of `world`, for any k (rank - 1 - step may be negative).
std::size_t ring_block(int k, int world) { return std::size_t(((k % world) + world) % world); }

}  // namespace

GlooRing::GlooRing(std::shared_ptr<gloo::Context> context, std::chrono::milliseconds timeout)
    : context_(std::move(context)), timeout_(timeout), rank_(context_->rank), world_(context_->size) {}

void GlooRing::wait_recv(gloo::transport::UnboundBuffer& b, const char* op, const char* what, int from) {
  if (!b.waitRecv(timeout_))
    throw CommError("gloo rank " + std::to_string(rank_) + ": " + op + ": receiving " + what + " from rank " +
                    std::to_string(from) + " was aborted");
}

void GlooRing::wait_send(gloo::transport::UnboundBuffer& b, const char* op, int to) {
  if (!b.waitSend(timeout_))
    throw CommError("gloo rank " + std::to_string(rank_) + ": " + op + ": a send to rank " + std::to_string(to) + " was aborted");
}

void GlooRing::reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype, float scale, std::uint32_t tag) {
  const std::size_t es = dtype_size(dtype);
  const std::size_t block = count * es;
  if (world_ == 1 || count == 0) {
    if (count) kernels::reduce_sum(dtype, recv, &send, 1, count, scale);
    return;
  }
  const auto slot = gloo::Slot::build(kReduceScatterSlotPrefix, tag);
  const int right = (rank_ + 1) % world_, left = (rank_ + world_ - 1) % world_;
  const auto* local = static_cast<const std::byte*>(send);
  const Segments seg(count, es);

  // Every step's partial sum lands in a block of its own, so every receive is posted before the
  // first send: the peers' "ready to receive" notices then never queue behind our data on the
  // connection (posted after the sends, they arrived a whole block late and the ring ran at half
  // its speed in one direction).
  const int steps = world_ - 1;
  const auto held = scratch_.take(std::size_t(steps) * block);  // back to the pool when this call returns
  std::byte* const scratch = held.get();
  auto partial = context_->createUnboundBuffer(scratch, std::size_t(steps) * block);
  for (int s = 0; s < steps; ++s)
    for (std::size_t k = 0; k < seg.count; ++k) partial->recv(left, slot, std::size_t(s) * block + seg.offset(k), seg.bytes(k));
  // Step 0 passes this rank's own values of block rank - 1.
  auto in = context_->createUnboundBuffer(const_cast<void*>(send), std::size_t(world_) * block);
  const std::size_t first = ring_block(rank_ - 1, world_) * block;
  for (std::size_t k = 0; k < seg.count; ++k) in->send(right, slot, first + seg.offset(k), seg.bytes(k));

  std::size_t sent = 0;
  for (int s = 0; s < steps; ++s) {
    std::byte* base = scratch + std::size_t(s) * block;
    const bool last = s == steps - 1;
    const std::byte* mine = local + ring_block(rank_ - 2 - s, world_) * block;  // the last step: block rank
    for (std::size_t k = 0; k < seg.count; ++k) {
      wait_recv(*partial, "reduce-scatter", "a partial sum", left);
      const std::size_t off = seg.offset(k), n = seg.bytes(k) / es;
      const void* srcs[2] = {base + off, mine + off};
      if (last) {
        kernels::reduce_sum(dtype, static_cast<std::byte*>(recv) + off, srcs, 2, n, scale);
      } else {
        kernels::reduce_sum(dtype, base + off, srcs, 2, n, 1.0f);
        partial->send(right, slot, std::size_t(s) * block + off, seg.bytes(k));
        ++sent;
      }
    }
  }
  for (std::size_t k = 0; k < seg.count; ++k) wait_send(*in, "reduce-scatter", right);
  for (; sent > 0; --sent) wait_send(*partial, "reduce-scatter", right);
}

void GlooRing::allgather(const void* send, void* recv, std::size_t count, DType dtype, std::uint32_t tag) {
  const std::size_t es = dtype_size(dtype);
  const std::size_t block = count * es;
  auto* out = static_cast<std::byte*>(recv);
  if (count == 0) return;
  if (send != out + std::size_t(rank_) * block) std::memcpy(out + std::size_t(rank_) * block, send, block);
  if (world_ == 1) return;
  const auto slot = gloo::Slot::build(kRingAllgatherSlotPrefix, tag);
  const int right = (rank_ + 1) % world_, left = (rank_ + world_ - 1) % world_;
  const Segments seg(count, es);
  // Receives first, each straight into its block of the output (see reduce_scatter); step s
  // receives block rank - 1 - s and passes on block rank - s.
  auto buf = context_->createUnboundBuffer(out, std::size_t(world_) * block);
  for (int s = 0; s < world_ - 1; ++s)
    for (std::size_t k = 0; k < seg.count; ++k) buf->recv(left, slot, ring_block(rank_ - 1 - s, world_) * block + seg.offset(k), seg.bytes(k));
  std::size_t sent = 0;
  for (std::size_t k = 0; k < seg.count; ++k, ++sent) buf->send(right, slot, std::size_t(rank_) * block + seg.offset(k), seg.bytes(k));
  for (int s = 0; s < world_ - 1; ++s)
    for (std::size_t k = 0; k < seg.count; ++k) {
      wait_recv(*buf, "all-gather", "a block", left);
      if (s + 1 < world_ - 1) {  // pass it on as it arrives
        buf->send(right, slot, ring_block(rank_ - 1 - s, world_) * block + seg.offset(k), seg.bytes(k));
        ++sent;
      }
    }
  for (; sent > 0; --sent) wait_send(*buf, "all-gather", right);
}

void GlooRing::shift(const void* send, std::size_t count, void* recv, std::size_t recv_count, DType dtype, int distance,
                     std::uint32_t tag) {
  const std::size_t es = dtype_size(dtype);
  const int to = (rank_ + distance % world_ + world_) % world_, from = shift_source(rank_, world_, distance);
  if (to == rank_) {
    std::memcpy(recv, send, count * es);
    return;
  }
  const auto slot = gloo::Slot::build(kShiftSlotPrefix, tag);
  // The receive posted before the send, for the reason reduce_scatter's are; one buffer each, so
  // that the send and the receive never share memory Gloo's threads touch. Either may be empty
  // (CollectiveOp::recv_count: the source sends nothing this time, or this rank does).
  std::unique_ptr<gloo::transport::UnboundBuffer> in, out;
  const Segments in_seg(recv_count, es), out_seg(count, es);
  if (recv_count) {
    in = context_->createUnboundBuffer(recv, recv_count * es);
    for (std::size_t k = 0; k < in_seg.count; ++k) in->recv(from, slot, in_seg.offset(k), in_seg.bytes(k));
  }
  if (count) {
    out = context_->createUnboundBuffer(const_cast<void*>(send), count * es);
    for (std::size_t k = 0; k < out_seg.count; ++k) out->send(to, slot, out_seg.offset(k), out_seg.bytes(k));
  }
  if (in)
    for (std::size_t k = 0; k < in_seg.count; ++k) wait_recv(*in, "shift", "a block", from);
  if (out)
    for (std::size_t k = 0; k < out_seg.count; ++k) wait_send(*out, "shift", to);
}

}  // namespace shardflow
