// A CPU "comm stream": one thread that runs a rank's collectives in submission order, the way a
// CUDA stream runs NCCL kernels. Backends whose collectives block (in-process, Gloo, shared memory)
// run them here, so no CAF scheduler thread and no trainer thread ever blocks on a peer.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "shardflow/communicator.hpp"

namespace shardflow {

class StreamWorker {
 public:
  using Execute = std::function<void(const CollectiveOp&)>;  // throws on failure
  // For backends whose ops finish later than they are enqueued (device streams): the function
  // takes `done` over (moves it out) once the op is on its way, and it runs on completion. If it
  // throws with `done` still in place, the worker reports the failure.
  using Enqueue = std::function<void(CollectiveOp&, CollectiveDone&)>;

  explicit StreamWorker(Execute exec);
  explicit StreamWorker(Enqueue enqueue);
  ~StreamWorker();  // finishes queued work, then joins
  StreamWorker(const StreamWorker&) = delete;
  StreamWorker& operator=(const StreamWorker&) = delete;

  void push(CollectiveOp op, CollectiveDone done);
  // Ops queued or running: a backend aborts its peers when it is destroyed with work pending.
  bool busy() const;

 private:
  void loop();

  Execute exec_;
  Enqueue enqueue_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<CollectiveOp, CollectiveDone>> queue_;
  bool running_op_ = false;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace shardflow
