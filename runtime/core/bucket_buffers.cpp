#include "runtime/core/bucket_buffers.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "shardflow/errors.hpp"

namespace shardflow {

BucketBuffers::BucketBuffers(std::vector<std::size_t> bytes, bool pooled, Allocate allocate, Zero zero)
    : pooled_(pooled),
      allocate_(allocate ? std::move(allocate) : Allocate(alloc_zeroed)),
      zero_(zero ? std::move(zero) : Zero([](std::byte* p, std::size_t n) { std::memset(p, 0, n); })),
      bytes_(std::move(bytes)),
      grad_(bytes_.size()),
      staging_(bytes_.size()),
      grad_cap_(bytes_.size(), 0),
      staging_cap_(bytes_.size(), 0),
      is_reducing_(bytes_.size(), 0) {
  if (pooled_) return;
  for (std::size_t b = 0; b < bytes_.size(); ++b) {
    grad_[b] = allocate_(bytes_[b]);
    staging_[b] = grad_[b];
    allocated_ += bytes_[b];
  }
  peak_ = allocated_;
}

std::shared_ptr<std::byte> BucketBuffers::take(std::size_t b, std::size_t& capacity, bool zero) {
  const std::size_t need = bytes_[b];
  std::size_t best = free_.size();
  // Best fit; of equal fits, the one whose zeroing the taker needs (or not).
  const auto better = [&](const Free& f, const Free& than) {
    return f.capacity < than.capacity || (f.capacity == than.capacity && f.zeroed == zero && than.zeroed != zero);
  };
  for (std::size_t i = 0; i < free_.size(); ++i)
    if (free_[i].capacity >= need && (best == free_.size() || better(free_[i], free_[best]))) best = i;
  if (best == free_.size()) {
    // None fits: a free buffer too small for this bucket goes, so the pool never holds more
    // buffers than were ever in use at once (the bound `shardflow plan` states).
    if (!free_.empty()) {
      const auto small = std::max_element(free_.begin(), free_.end(), [](const Free& a, const Free& b) { return a.capacity < b.capacity; });
      allocated_ -= small->capacity;
      free_.erase(small);
    }
    capacity = need;
    allocated_ += need;
    peak_ = std::max(peak_, allocated_);
    return allocate_(need);
  }
  auto buf = std::move(free_[best].buf);
  capacity = free_[best].capacity;
  const bool zeroed = free_[best].zeroed;
  free_.erase(free_.begin() + std::ptrdiff_t(best));
  if (zero && !zeroed) zero_(buf.get(), capacity);  // a fresh accumulator, padding included
  return buf;
}

void BucketBuffers::give_back(std::shared_ptr<std::byte> buf, std::size_t capacity, bool zeroed) {
  // Callers release only after the collective on the buffer completed (reduced / broadcast_done),
  // so handing it out again cannot race with a collective still reading or writing it.
  if (buf) free_.push_back(Free{std::move(buf), capacity, zeroed});
}

// Note [Backpressure in refills]
// Stage 2's trainer waits for a free gradient buffer when `limit` are held and one is being
// reduced. Woken at each release, a trainer that runs ahead of the link (small buckets, or a
// link slower than backward) went back to sleep after one bucket, and each release while it
// waited woke it whether or not it could go on: a thread switch a bucket at the limit (bench_
// overhead's 100 buckets of 10 KiB with 36 buffers: the trainer slept 8.6 times an iteration,
// 5.9 since; RESULTS.md, "Backpressure in refills"). So a wait, once it has to happen, lasts
// until a quarter of the limit is free (at least one buffer), and the releases before that wake
// no one; the trainer then writes that many buckets without stopping. The link loses nothing:
// the reductions of the other held buckets are still ahead of it while the trainer sleeps.
// Limits under 8 (the default's few large buckets) refill one at a time, as before. The escape is unchanged: when no reduction is left on its way, nothing more
// can be released, and the waiter goes on at once (no deadlock however gradients arrive). The
// replay of the schedule models the same refill (Note [Backpressure in the replay]).
std::shared_ptr<std::byte> BucketBuffers::grad(std::size_t b, std::size_t limit, std::chrono::milliseconds timeout, std::size_t refill) {
  std::unique_lock lock(mu_);
  if (grad_[b]) return grad_[b];
  const bool limited = pooled_ && limit > 0;
  const auto may_take = [&] { return !limited || held_grads_ < limit || grad_[b] || reducing_ == 0; };
  if (limited && !may_take()) {
    // Every waiter resumes at the same count: the limit less the refill (Note [Backpressure in refills]).
    resume_at_ = limit - std::clamp<std::size_t>(refill, 1, limit);
    const auto may_resume = [&] { return held_grads_ <= resume_at_ || grad_[b] || reducing_ == 0 || interrupted_; };
    ++waiting_;
    const bool resumed = released_.wait_for(lock, timeout, may_resume);
    --waiting_;
    if (!resumed)
      throw TimeoutError("no gradient bucket was freed within " + std::to_string(timeout.count()) + " ms while " +
                         std::to_string(held_grads_) + " bucket(s) were in flight (Config::zero.max_buckets_in_flight = " +
                         std::to_string(limit) + "). Report each gradient with grad_ready() as soon as it is written, "
                         "or raise max_buckets_in_flight.");
  }
  if (!may_take()) return nullptr;  // interrupted (Note [A failure ends the wait for a buffer])
  if (!grad_[b]) {
    grad_[b] = take(b, grad_cap_[b], true);
    ++held_grads_;
  }
  return grad_[b];
}

std::shared_ptr<std::byte> BucketBuffers::held_grad(std::size_t b) const {
  std::lock_guard lock(mu_);
  return grad_[b];
}

// Note [Zeroed on the way back]
// A pooled gradient buffer must be zero when backward takes it (gradients accumulate into it).
// Cleared as it was taken, the memset ran on the trainer's thread at each bucket's first gradient,
// inside backward: 39 us a 1 MiB bucket on a Sapphire Rapids VM, 0.66 ms of the 16 x 512 MLP's
// 16.9 ms iteration (link/compute 1, stage 2, prefetch), and it was counted as a wait (the time
// in grad() is the trainer held up), so the iteration's bound left it out of backward and the
// trace called it backpressure. On the CPU the shard clears the buffer instead when its reduction
// has landed (Shard::take_grad_shard, on the shard's thread), outside the pool's lock, and the
// trainer takes it as it is. A buffer that comes back uncleared (a staging buffer; any buffer of a
// GPU shard, whose clearing as it is taken is an async memset on the compute stream) is still
// cleared when taken for gradients.
void BucketBuffers::release_grad(std::size_t b, const Zero& zero) {
  if (!pooled_) return;
  if (zero) {
    std::shared_ptr<std::byte> buf;
    std::size_t capacity = 0;
    {
      std::lock_guard lock(mu_);
      buf = grad_[b];
      capacity = grad_cap_[b];
    }
    // Nobody else writes it now: its reduction completed, and backward is done with bucket b.
    if (buf) zero(buf.get(), capacity);
  }
  std::lock_guard lock(mu_);
  if (!grad_[b]) return;
  give_back(std::move(grad_[b]), grad_cap_[b], bool(zero));
  grad_[b] = nullptr;
  --held_grads_;
  if (is_reducing_[b]) {
    is_reducing_[b] = 0;
    --reducing_;
  }
  if (waiting_ && (held_grads_ <= resume_at_ || reducing_ == 0)) released_.notify_all();
}

void BucketBuffers::mark_reducing(std::size_t b) {
  if (!pooled_) return;
  std::lock_guard lock(mu_);
  if (grad_[b] && !is_reducing_[b]) {
    is_reducing_[b] = 1;
    ++reducing_;
  }
}

std::size_t BucketBuffers::waiting() const {
  std::lock_guard lock(mu_);
  return waiting_;
}

// Note [A failure ends the wait for a buffer]
// Backpressure waits for a reduction in flight to release its buffer. When the iteration fails (a
// peer lost, an abort), those reductions fail instead and release nothing, so the wait lasted the
// whole collective timeout and then blamed the trainer: "no gradient bucket was freed ... Report
// each gradient with grad_ready() as soon as it is written, or raise max_buckets_in_flight"
// (test_zero: 30 s at a 30 s timeout, with the peer lost 0.3 s in). A survivor recovering in place
// reached the next round that much later, after the others' rendezvous had given up on it. The
// signal's first failure interrupts the wait (Runtime::Impl::signal_listener), and the trainer's
// call throws that failure instead.
void BucketBuffers::interrupt() {
  {
    std::lock_guard lock(mu_);
    interrupted_ = true;
  }
  released_.notify_all();
}

std::shared_ptr<std::byte> BucketBuffers::acquire_staging(std::size_t b) {
  std::lock_guard lock(mu_);
  // Not zeroed: the pack writes every element a sync reads. (On a GPU the zeroing would go on the
  // compute stream and race with the pack on the shard's: Note [Shard streams].)
  if (!staging_[b]) staging_[b] = take(b, staging_cap_[b], false);
  return staging_[b];
}

std::shared_ptr<std::byte> BucketBuffers::staging(std::size_t b) const {
  std::lock_guard lock(mu_);
  return staging_[b];
}

void BucketBuffers::release_staging(std::size_t b) {
  if (!pooled_) return;
  std::lock_guard lock(mu_);
  give_back(std::move(staging_[b]), staging_cap_[b]);
  staging_[b] = nullptr;
}

void BucketBuffers::zero_held() {
  std::lock_guard lock(mu_);
  for (std::size_t b = 0; b < grad_.size(); ++b)
    if (grad_[b]) zero_(grad_[b].get(), pooled_ ? grad_cap_[b] : bytes_[b]);
}

void BucketBuffers::release_all() {
  std::lock_guard lock(mu_);
  interrupted_ = false;
  for (auto& g : grad_) g.reset();
  for (auto& st : staging_) st.reset();
  free_.clear();
  allocated_ = 0;
}

std::size_t BucketBuffers::allocated_bytes() const {
  std::lock_guard lock(mu_);
  return peak_;
}

}  // namespace shardflow
