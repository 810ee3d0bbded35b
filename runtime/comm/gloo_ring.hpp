// A reduce-scatter that Gloo's new-style API lacks, and an all-gather that posts its receives
// first, built on Gloo's unbound buffers (Note [Ring reduce-scatter]). Run on the rank's comm
// stream, like every Gloo collective.
#pragma once

#include <gloo/context.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "runtime/comm/scratch_pool.hpp"
#include "shardflow/types.hpp"

namespace shardflow {

// Note [Ring reduce-scatter]
// Every rank's `send` holds world blocks of `count` elements; block r, summed over the ranks and
// multiplied by `scale`, lands in rank r's `recv` (which may be block r of its own `send`: in
// place). Around the ring rank -> rank + 1, world - 1 steps: in step s a rank passes on the
// partial sum of block (rank - 1 - s) mod world (its own values in step 0) and receives the
// partial sum of block (rank - 2 - s), to which it adds its own values; the last step receives
// its own block. Each rank sends and receives (world - 1) / world of the buffer, half of what an
// all-reduce of a copy moved. Each step's block travels in segments so that adding one segment
// overlaps the next one's transfer and the next step's send starts before the block is whole.
// 16-bit blocks are summed through fp32 and travel rounded, as Gloo's own 16-bit reductions do.
// Deterministic: every element's sum is taken in the same ring order on every run.
//
// Every receive is posted before the first send. Gloo's unbound sends wait for the receiver's
// notice that its receive is posted, and that notice travels on the same TCP connection as the
// receiver's own data: posted after a block of sends, it queued behind them, so on a 1 Gbit/s
// link one direction of the exchange started a whole block late and a collective took up to 2x
// its time (seen in traces of ZeRO-1 between two hosts; Gloo's own all-gather posts its send
// first and has the same trouble, hence allgather() here).
class GlooRing {
 public:
  GlooRing(std::shared_ptr<gloo::Context> context, std::chrono::milliseconds timeout);
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype, float scale, std::uint32_t tag);
  // Block rank of recv (world blocks of count) from every rank's send (in place when send is that block).
  void allgather(const void* send, void* recv, std::size_t count, DType dtype, std::uint32_t tag);
  // Note [Shift]: `count` to rank + distance, `recv_count` from rank - distance, both in segments.
  void shift(const void* send, std::size_t count, void* recv, std::size_t recv_count, DType dtype, int distance, std::uint32_t tag);

  // Bytes per segment: large enough that a segment's latency is small next to its transfer, small
  // enough that a step's first segment goes on before its block has arrived whole.
  static constexpr std::size_t kSegmentBytes = std::size_t{256} << 10;

 private:
  void wait_recv(gloo::transport::UnboundBuffer& b, const char* op, const char* what, int from);
  void wait_send(gloo::transport::UnboundBuffer& b, const char* op, int to);

  std::shared_ptr<gloo::Context> context_;
  std::chrono::milliseconds timeout_;
  int rank_, world_;
  // reduce_scatter: world - 1 blocks, step s receives into block s. The largest is kept from one
  // call to the next (Note [Scratch kept between collectives]); it comes from alloc_zeroed, so a
  // new context's first reduce-scatter faults its pages in 2 MiB at a time (Note [Huge pages for
  // large blocks]).
  ScratchPool scratch_{1};
};

}  // namespace shardflow
