// The flat buffers behind the buckets, per iteration.
//
// Note [Pooled buckets (ZeRO-2)]
// Without pooling (DDP, stage 0/1) every bucket has its own buffer for the life of the plan; it is
// the gradient storage and, after the step, the parameter-sync staging. With pooling (stage 2) a
// bucket holds a buffer only while it needs one: its gradient buffer from the first gradient
// written into it until its reduction has landed in the rank's 1/N gradient shard, and a staging
// buffer from its step until its parameter sync completed. Buffers come from a free list, so a
// rank's gradient memory is "buckets in flight + 1/N", not "all buckets".
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "kernels/cpu/host_memory.hpp"  // alloc_zeroed, the default allocator

namespace shardflow {

class BucketBuffers {
 public:
  using Allocate = std::function<std::shared_ptr<std::byte>(std::size_t)>;  // zeroed, 64-byte aligned
  using Zero = std::function<void(std::byte*, std::size_t)>;
  // bytes: each bucket's buffer size (padded for flat shards). `allocate`: the communicator's
  // (Communicator::allocate), so that collectives on the buckets need no staging copy. `zero`:
  // how a held buffer is cleared (memset; an async memset on the compute stream for GPU buckets).
  BucketBuffers(std::vector<std::size_t> bytes, bool pooled, Allocate allocate, Zero zero = {});

  bool pooled() const { return pooled_; }
  std::size_t bytes(std::size_t b) const { return bytes_[b]; }

  // The gradient buffer of bucket b; pooled, the first call of an iteration takes a zeroed buffer.
  // With `limit` > 0, taking one waits while `limit` gradient buffers are held *and* one of them is
  // marked reducing (backpressure: gradient memory stays near "buckets in flight + 1/N" however far
  // backward runs ahead of the reductions). When every held bucket is still being written, no
  // release can come, so it takes a buffer beyond the limit instead of waiting: gradients that
  // arrive in an order unrelated to the buckets never deadlock. A wait, once it has to happen,
  // lasts until `refill` buffers are free (or no reduction is left on its way), not one: Note
  // [Backpressure in refills]. TimeoutError after `timeout`; null, at once, for a wait the
  // iteration's failure cut short (interrupt()).
  std::shared_ptr<std::byte> grad(std::size_t b, std::size_t limit = 0,
                                  std::chrono::milliseconds timeout = std::chrono::milliseconds::zero(), std::size_t refill = 1);
  // Bucket b's gradient buffer if it holds one now, else null; never takes one or waits.
  std::shared_ptr<std::byte> held_grad(std::size_t b) const;
  // Pooled only (no-op otherwise): bucket b's reduction has landed, its buffer goes back. With
  // `zero` (the shard's, on its own thread), the buffer is cleared on its way back, whole,
  // and the trainer that takes it next skips the clearing: Note [Zeroed on the way back].
  void release_grad(std::size_t b, const Zero& zero = {});
  // b's reduction will be issued with no further trainer action (b and every earlier bucket are
  // complete): its release is on its way, so waiting for a buffer is safe.
  void mark_reducing(std::size_t b);
  std::size_t waiting() const;  // callers waiting in grad() now (for tests and diagnostics)
  // The iteration failed (Note [A failure ends the wait for a buffer]): the reductions in flight
  // will never release their buffers, so every caller waiting in grad() returns null now, and so
  // does any later one that would wait, until release_all().
  void interrupt();

  // Sync staging: pooled, a separate buffer taken at the step; otherwise the bucket itself.
  std::shared_ptr<std::byte> acquire_staging(std::size_t b);
  std::shared_ptr<std::byte> staging(std::size_t b) const;
  void release_staging(std::size_t b);

  void zero_held();                  // zero_grad(): zeroes the gradient buffers held now
  // Frees every buffer now (the plan is being replaced); holders of a buffer keep theirs alive.
  void release_all();
  std::size_t allocated_bytes() const;  // the most ever allocated at once (pooled: the peak in flight)

 private:
  // Best fit from the free list, else a new buffer of exactly the bucket's size (buckets differ a
  // lot: one slot size for all would make a pool of small buckets cost the largest one each).
  // `zero`: the taker needs a zeroed buffer (a gradient accumulator); it prefers one cleared on its
  // way back, and the others prefer one that was not (a staging buffer overwrites it anyway).
  std::shared_ptr<std::byte> take(std::size_t b, std::size_t& capacity, bool zero);  // mu_ held
  void give_back(std::shared_ptr<std::byte> buf, std::size_t capacity, bool zeroed = false);  // mu_ held

  struct Free {
    std::shared_ptr<std::byte> buf;
    std::size_t capacity;
    bool zeroed;  // every byte of it zero (cleared on its way back, or never written)
  };
  const bool pooled_;
  Allocate allocate_;
  Zero zero_;
  std::vector<std::size_t> bytes_;
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<std::byte>> grad_, staging_;
  std::vector<std::size_t> grad_cap_, staging_cap_;  // capacity of the buffer each one holds
  std::vector<Free> free_;
  std::size_t allocated_ = 0, peak_ = 0;
  std::size_t held_grads_ = 0, reducing_ = 0;
  // Callers waiting in grad(), and the held count at which they may go on (Note [Backpressure in
  // refills]): a release wakes them only then, not at every buffer.
  std::size_t waiting_ = 0, resume_at_ = 0;
  std::vector<char> is_reducing_;
  bool interrupted_ = false;
  std::condition_variable released_;
};

}  // namespace shardflow
