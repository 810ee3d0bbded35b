#include "runtime/comm/barrier.hpp"

#include <algorithm>
#include <atomic>
#include <thread>

#include "shardflow/errors.hpp"

namespace shardflow {

void RankBarrier::arrive_and_wait(int rank, std::chrono::milliseconds timeout,
                                  const std::function<std::string()>& what) {
  std::unique_lock lock(mu_);
  if (aborted_) throw CommError(what() + ": aborted: " + reason_);
  const std::uint64_t gen = generation_.load(std::memory_order_relaxed);
  arrived_[std::size_t(rank)] = 1;
  if (++count_ == n_) {
    count_ = 0;
    std::fill(arrived_.begin(), arrived_.end(), 0);
    generation_.store(gen + 1, std::memory_order_release);
    lock.unlock();
    cv_.notify_all();
    return;
  }
  // Peers usually arrive within microseconds: spin a little (yielding, so an oversubscribed core
  // still runs the rank we wait for) before paying for a futex sleep and wake-up.
  lock.unlock();
  const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
  while (generation_.load(std::memory_order_acquire) == gen && !aborted_.load(std::memory_order_relaxed) &&
         std::chrono::steady_clock::now() < spin_until)
    std::this_thread::yield();
  if (generation_.load(std::memory_order_acquire) != gen) return;
  lock.lock();
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (generation_ == gen && !aborted_) {
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && generation_ == gen && !aborted_) {
      std::string missing;
      for (int r = 0; r < n_; ++r)
        if (!arrived_[std::size_t(r)]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      const std::string msg = what() + ": rank(s) " + missing + " did not arrive within " +
                              std::to_string(timeout.count()) + " ms (Config::timeouts.collective)";
      aborted_.store(true);
      reason_ = "rank " + std::to_string(rank) + " timed out: " + msg;
      lock.unlock();
      cv_.notify_all();
      throw TimeoutError(msg);
    }
  }
  if (generation_ == gen) throw CommError(what() + ": aborted: " + reason_);
}

void RankBarrier::abort(const std::string& reason) {
  {
    std::lock_guard lock(mu_);
    if (aborted_) return;
    aborted_.store(true);
    reason_ = reason;
  }
  cv_.notify_all();
}

bool RankBarrier::aborted() const {
  std::lock_guard lock(mu_);
  return aborted_;
}

std::string RankBarrier::abort_reason() const {
  std::lock_guard lock(mu_);
  return reason_;
}

}  // namespace shardflow
