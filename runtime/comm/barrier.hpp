// A reusable barrier for N threads with a deadline and an abort flag. On timeout it names the ranks
// that did not arrive, then poisons itself so that every other waiter fails too instead of hanging.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace shardflow {

class RankBarrier {
 public:
  explicit RankBarrier(int n) : n_(n), arrived_(std::size_t(n), 0) {}

  // Blocks until all n ranks arrived. `what` describes the wait for the error message; it is only
  // called on failure. Throws TimeoutError (naming the missing ranks) or CommError (aborted).
  void arrive_and_wait(int rank, std::chrono::milliseconds timeout, const std::function<std::string()>& what);

  // Fails every current and future wait with `reason` (the first reason wins).
  void abort(const std::string& reason);
  bool aborted() const;
  std::string abort_reason() const;

 private:
  static constexpr int kSpinMicros = 50;
  const int n_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<char> arrived_;
  int count_ = 0;
  // Atomic so that waiters can spin on them without the mutex before they go to sleep.
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<bool> aborted_{false};
  std::string reason_;
};

}  // namespace shardflow
