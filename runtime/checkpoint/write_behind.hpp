// A writer thread that runs a consolidated save's writes behind its stream (Note [Checkpoints]):
// while the ranks export and reduce the next window, the recipient's previous window (and,
// before any window, the parameters) goes into the file. Writes run in the order queued, so a
// tensor's CRC still runs front to back. A write that fails stops the rest and is reported by
// finish(); the caller keeps streaming meanwhile, because the other ranks are in the stream's
// collectives and must not be left waiting for a rank that stopped at its disk's error.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace shardflow {

class WriteBehind {
 public:
  WriteBehind() : thread_([this] { run(); }) {}
  WriteBehind(const WriteBehind&) = delete;
  WriteBehind& operator=(const WriteBehind&) = delete;
  ~WriteBehind() {
    {
      std::lock_guard lock(mu_);
      closing_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  // Queues `write`; returns its ticket. Whatever memory it reads must stay as it is until
  // wait_done(ticket) returns.
  std::uint64_t submit(std::function<void()> write) {
    std::lock_guard lock(mu_);
    queue_.push_back(std::move(write));
    cv_.notify_all();
    return ++submitted_;
  }
  // Blocks until the write with this ticket (and every one before it) has run or been dropped
  // after a failure.
  void wait_done(std::uint64_t ticket) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return done_ >= ticket; });
  }
  bool failed() const {
    std::lock_guard lock(mu_);
    return bool(error_);
  }
  // Every write queued has run; rethrows the first failure.
  void finish() {
    wait_done(submitted());
    std::lock_guard lock(mu_);
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::uint64_t submitted() const {
    std::lock_guard lock(mu_);
    return submitted_;
  }
  void run() {
    std::unique_lock lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return closing_ || !queue_.empty(); });
      if (queue_.empty()) return;
      auto write = std::move(queue_.front());
      queue_.pop_front();
      const bool skip = error_ || closing_;  // closing with writes queued: the caller gave up on them
      lock.unlock();
      std::exception_ptr e;
      if (!skip) try {
          write();
        } catch (...) {
          e = std::current_exception();
        }
      lock.lock();
      if (e && !error_) error_ = e;
      ++done_;
      cv_.notify_all();
    }
  }

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  std::uint64_t submitted_ = 0, done_ = 0;
  std::exception_ptr error_;
  bool closing_ = false;
  std::thread thread_;  // last: starts once the members it reads exist
};

}  // namespace shardflow
