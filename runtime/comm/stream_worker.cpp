#include "runtime/comm/stream_worker.hpp"

#include "runtime/process/thread_priority.hpp"

namespace shardflow {

StreamWorker::StreamWorker(Execute exec) : exec_(std::move(exec)), thread_([this] { loop(); }) {}
StreamWorker::StreamWorker(Enqueue enqueue) : enqueue_(std::move(enqueue)), thread_([this] { loop(); }) {}

StreamWorker::~StreamWorker() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void StreamWorker::push(CollectiveOp op, CollectiveDone done) {
  {
    std::lock_guard lock(mu_);
    queue_.emplace_back(std::move(op), std::move(done));
  }
  cv_.notify_one();
}

bool StreamWorker::busy() const {
  std::lock_guard lock(mu_);
  return running_op_ || !queue_.empty();
}

void StreamWorker::loop() {
  runtime_thread_started("sf-comm-stream");
  for (;;) {
    std::pair<CollectiveOp, CollectiveDone> item;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      item = std::move(queue_.front());
      queue_.pop_front();
      running_op_ = true;
    }
    std::exception_ptr error;
    try {
      if (enqueue_)
        enqueue_(item.first, item.second);  // takes item.second over unless it throws
      else
        exec_(item.first);
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard lock(mu_);
      running_op_ = false;
    }
    // The completion runs on this thread; it must be cheap (a message send), never a wait.
    if (item.second) item.second(error);
  }
}

}  // namespace shardflow
