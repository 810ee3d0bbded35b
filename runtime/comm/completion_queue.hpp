// Note [Device completions]
// Device backends (NCCL, in-process over GPU memory) enqueue a collective on their CUDA stream and
// return at once; the op is finished when an event recorded after it has fired. One thread per
// communicator watches those events in submission order (a stream completes in order, so only the
// oldest op needs looking at) and runs each op's `done`: that turns device completion into an
// actor message without a CAF scheduler thread or the trainer ever waiting on the GPU. Watching
// rather than blocking in cudaEventSynchronize is what lets every op have a deadline: an op that
// has not completed within the timeout after it became the oldest fails with an error naming it,
// the backend is told (NCCL aborts its communicator, which unblocks kernels waiting for a dead
// peer) and everything behind it fails too. A health check (NCCL's asynchronous error) is polled
// on the same thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "shardflow/communicator.hpp"

namespace shardflow {

class CompletionQueue {
 public:
  enum class State { pending, done, failed };
  // Polls one op: must not block. On failure it may fill in the reason.
  using Poll = std::function<State(std::string& error)>;

  struct Options {
    std::string who;  // "rank 1 (nccl)": errors start with it
    std::chrono::milliseconds timeout = std::chrono::minutes(10);
    std::function<void()> on_start;  // on the watcher thread before anything else (cudaSetDevice)
    // Called while ops are pending; returns an error when the backend broke (a peer died).
    std::function<std::optional<std::string>()> health;
    // The first failure (timeout, failed op, health): the backend aborts itself here.
    std::function<void(const std::string& reason)> on_failure;
    // Sleep between polls grows from 2 us to this while the oldest op is pending.
    std::chrono::microseconds max_poll_interval{200};
  };

  explicit CompletionQueue(Options options);
  // Ops still pending fail with CommError; joins the watcher.
  ~CompletionQueue();
  CompletionQueue(const CompletionQueue&) = delete;
  CompletionQueue& operator=(const CompletionQueue&) = delete;

  // `what` names the op in errors ("allreduce 'bucket 3'"). `keep_alive` is released after `done`.
  // Once the queue has failed, `done` runs at once (on the caller's thread) with that failure.
  void push(std::string what, Poll poll, CollectiveDone done, std::shared_ptr<const void> keep_alive = {});
  // Fails every pending op and all later ones with `error` (CommError with `reason`).
  void fail(const std::string& reason);
  bool busy() const;
  // The sticky failure, or null.
  std::exception_ptr failure() const;

 private:
  struct Entry {
    std::uint64_t id = 0;
    std::string what;
    Poll poll;
    CollectiveDone done;
    std::shared_ptr<const void> keep_alive;
  };
  void loop();
  void fail_locked(std::exception_ptr e, std::unique_lock<std::mutex>& lock);

  Options opt_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Entry> queue_;
  std::exception_ptr failure_;
  std::uint64_t next_id_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace shardflow
