#include "runtime/comm/gloo_ring.hpp"

#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <algorithm>
#include <string>

#include "kernels/cpu/elementwise.hpp"
#include "shardflow/errors.hpp"

namespace shardflow {
namespace {

// Gloo gives each collective kind a slot prefix (gloo/types.h uses 0x01-0x08); ours stays clear
// of them, so a reduce-scatter and a Gloo collective with the same tag never match each other.
constexpr std::uint8_t kReduceScatterSlotPrefix = 0x40;

}  // namespace

GlooRing::GlooRing(std::shared_ptr<gloo::Context> context, std::chrono::milliseconds timeout)
    : context_(std::move(context)), timeout_(timeout), rank_(context_->rank), world_(context_->size) {}

void GlooRing::wait_recv(gloo::transport::UnboundBuffer& b, const char* what) {
  if (!b.waitRecv(timeout_))
    throw CommError("gloo rank " + std::to_string(rank_) + ": reduce-scatter: receiving " + what + " from rank " +
                    std::to_string((rank_ + world_ - 1) % world_) + " was aborted");
}

void GlooRing::wait_send(gloo::transport::UnboundBuffer& b) {
  if (!b.waitSend(timeout_))
    throw CommError("gloo rank " + std::to_string(rank_) + ": reduce-scatter: a send to rank " + std::to_string((rank_ + 1) % world_) +
                    " was aborted");
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
  auto block_of = [&](int s) { return std::size_t(((s % world_) + world_) % world_); };
  const auto* local = static_cast<const std::byte*>(send);

  const std::size_t seg_elems = std::max<std::size_t>(1, kSegmentBytes / es);
  const std::size_t segments = (count + seg_elems - 1) / seg_elems;
  auto seg_len = [&](std::size_t k) { return std::min(seg_elems, count - k * seg_elems) * es; };

  scratch_.resize(2 * block);
  auto in = context_->createUnboundBuffer(const_cast<void*>(send), std::size_t(world_) * block);
  std::unique_ptr<gloo::transport::UnboundBuffer> half[2] = {
      context_->createUnboundBuffer(scratch_.data(), block), context_->createUnboundBuffer(scratch_.data() + block, block)};
  std::size_t pending[2] = {0, 0};  // sends out of each half not yet known complete

  // Step 0 passes this rank's own values of block rank - 1.
  const std::size_t first = block_of(rank_ - 1) * block;
  for (std::size_t k = 0; k < segments; ++k) in->send(right, slot, first + k * seg_elems * es, seg_len(k));

  for (int s = 0; s < world_ - 1; ++s) {
    auto& buf = *half[s % 2];
    std::byte* base = scratch_.data() + std::size_t(s % 2) * block;
    // This half was passed on two steps ago: those sends must be out before it is overwritten.
    for (; pending[s % 2] > 0; --pending[s % 2]) wait_send(buf);
    for (std::size_t k = 0; k < segments; ++k) buf.recv(left, slot, k * seg_elems * es, seg_len(k));
    const bool last = s == world_ - 2;
    const std::byte* mine = local + block_of(rank_ - 2 - s) * block;  // the last step: block rank
    for (std::size_t k = 0; k < segments; ++k) {
      wait_recv(buf, "a partial sum from the previous rank");
      const std::size_t off = k * seg_elems * es, n = seg_len(k) / es;
      const void* srcs[2] = {base + off, mine + off};
      if (last) {
        kernels::reduce_sum(dtype, static_cast<std::byte*>(recv) + off, srcs, 2, n, scale);
      } else {
        kernels::reduce_sum(dtype, base + off, srcs, 2, n, 1.0f);
        buf.send(right, slot, off, seg_len(k));
        ++pending[s % 2];
      }
    }
  }
  for (std::size_t k = 0; k < segments; ++k) wait_send(*in);
  for (int h = 0; h < 2; ++h)
    for (; pending[h] > 0; --pending[h]) wait_send(*half[h]);
}

}  // namespace shardflow
