// Note [One count per bucket]
// A bucket is ready when every one of its gradients of this synchronised pass is in. That count
// has one home: this class, decremented on the trainer's threads as each grad_ready arrives (any
// thread, lock-free). The bucket actor does not count again; it hears once, "all n are in", and
// owns the bucket from there (in flight, reduced, handed to the shard or the iteration).
// Why the count is not the actor's: the bucket's last gradient must do two things on the trainer
// thread at once, record the bucket's device event on the trainer's compute stream (after the
// kernels that wrote it) and release backpressure (a ZeRO-2 buffer counts as reducing from then
// on); and one actor message per gradient cost ~1 us each in scheduler turns here (1 ms per
// iteration at 1,000 parameters, bench_overhead), twice the whole runtime's budget.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace shardflow {

class BucketReadiness {
 public:
  // `sizes[b]`: the gradients bucket b gets per synchronised pass.
  explicit BucketReadiness(std::vector<std::uint32_t> sizes);
  // Every bucket waits for all its gradients again.
  void reset();
  // A gradient of bucket b is in. True exactly once per pass: for the bucket's last gradient.
  bool gradient_in(std::uint32_t b) { return pending_[b].fetch_sub(1, std::memory_order_acq_rel) == 1; }
  std::uint32_t size(std::uint32_t b) const { return sizes_[b]; }
  // Bucket b became ready: returns how far the run of ready buckets from bucket 0 now reaches
  // (`from` .. result-1 are newly in it). The comm stream issues reductions in bucket order, so
  // only the buffers of that run are sure to come back without any further trainer action.
  std::pair<std::size_t, std::size_t> extend_ready_run(std::uint32_t b);
  // When bucket b's last gradient came in (Timeline microseconds), kept until the next pass's:
  // forward prefetch sizes its split from one pass's times (Note [Choosing the syncs in
  // backward]). Written by the thread whose gradient_in() returned true, read after the pass has
  // been waited for (the iteration signal orders the two).
  void ready_at(std::uint32_t b, std::int64_t us) { ready_us_[b] = us; }
  const std::vector<std::int64_t>& ready_times() const { return ready_us_; }

 private:
  std::vector<std::uint32_t> sizes_;
  std::unique_ptr<std::atomic<std::uint32_t>[]> pending_;
  std::mutex run_mu_;
  std::vector<char> ready_;
  std::vector<std::int64_t> ready_us_;
  std::size_t run_ = 0;
};

}  // namespace shardflow
