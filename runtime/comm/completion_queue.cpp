#include "runtime/comm/completion_queue.hpp"
#include "runtime/process/thread_priority.hpp"

#include <algorithm>
#include <optional>
#include <vector>

#include "shardflow/errors.hpp"

namespace shardflow {

CompletionQueue::CompletionQueue(Options options) : opt_(std::move(options)), thread_([this] { loop(); }) {}

CompletionQueue::~CompletionQueue() {
  {
    std::unique_lock lock(mu_);
    stop_ = true;
    if (!queue_.empty())
      fail_locked(std::make_exception_ptr(CommError(opt_.who + ": communicator destroyed with " +
                                                    std::to_string(queue_.size()) + " collective(s) pending")),
                  lock);
  }
  cv_.notify_all();
  thread_.join();
}

void CompletionQueue::push(std::string what, Poll poll, CollectiveDone done, std::shared_ptr<const void> keep_alive) {
  std::unique_lock lock(mu_);
  if (failure_) {
    auto f = failure_;
    lock.unlock();
    if (done) done(f);
    return;
  }
  queue_.push_back(Entry{++next_id_, std::move(what), std::move(poll), std::move(done), std::move(keep_alive)});
  lock.unlock();
  cv_.notify_one();
}

void CompletionQueue::fail(const std::string& reason) {
  std::unique_lock lock(mu_);
  if (failure_) return;
  fail_locked(std::make_exception_ptr(CommError(reason)), lock);
}

bool CompletionQueue::busy() const {
  std::lock_guard lock(mu_);
  return !queue_.empty();
}

std::exception_ptr CompletionQueue::failure() const {
  std::lock_guard lock(mu_);
  return failure_;
}

// Completions run without the lock (they send messages, and a test's callback may push again).
void CompletionQueue::fail_locked(std::exception_ptr e, std::unique_lock<std::mutex>& lock) {
  if (!failure_) failure_ = e;
  std::deque<Entry> failed;
  failed.swap(queue_);
  lock.unlock();
  for (auto& entry : failed)
    if (entry.done) entry.done(e);
  failed.clear();  // keep_alive released after done
  lock.lock();
}

void CompletionQueue::loop() {
  runtime_thread_started("sf-completions");
  if (opt_.on_start) {
    try {
      opt_.on_start();
    } catch (const std::exception& e) {
      std::unique_lock lock(mu_);
      fail_locked(std::make_exception_ptr(CommError(opt_.who + ": completion thread could not start: " + e.what())), lock);
    }
  }
  using clock = std::chrono::steady_clock;
  std::unique_lock lock(mu_);
  // When the current oldest op became the oldest. Taken when an op is first seen at the head, not
  // when the last one completed: after an idle queue (an evaluation, a checkpoint between steps)
  // the idle time must not count against the next op's timeout.
  auto head_since = clock::now();
  std::optional<std::uint64_t> head;  // the op head_since is for
  auto interval = std::chrono::microseconds(2);
  for (;;) {
    cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopped and drained (pending ops were failed by the destructor)
    // Poll the oldest op without the lock: submitters keep pushing meanwhile.
    Poll poll = queue_.front().poll;
    const std::string what = queue_.front().what;
    const std::uint64_t id = queue_.front().id;
    if (head != id) {
      head = id;
      head_since = clock::now();
      interval = std::chrono::microseconds(2);
    }
    lock.unlock();
    std::string error;
    State state = State::failed;
    try {
      state = poll(error);
    } catch (const std::exception& e) {
      error = e.what();
    }
    std::optional<std::string> broken;
    if (state == State::pending && opt_.health) broken = opt_.health();
    lock.lock();
    if (queue_.empty() || queue_.front().id != id) continue;  // failed meanwhile
    if (state == State::done) {
      Entry entry = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      if (entry.done) entry.done(nullptr);
      entry = Entry{};  // keep_alive released after done, outside the lock
      lock.lock();
      continue;
    }
    std::exception_ptr verdict;
    std::string reason;
    if (state == State::failed) {
      reason = opt_.who + ": " + what + " failed on the device: " + error;
      verdict = std::make_exception_ptr(CommError(reason));
    } else if (broken) {
      reason = opt_.who + ": " + what + " cannot complete: " + *broken;
      verdict = std::make_exception_ptr(CommError(reason));
    } else if (clock::now() - head_since > opt_.timeout) {
      reason = opt_.who + ": " + what + " did not complete within " + std::to_string(opt_.timeout.count()) +
               " ms (a peer is missing, stuck or dead)";
      verdict = std::make_exception_ptr(TimeoutError(reason));
    }
    if (verdict) {
      // The ops fail with the verdict first (a timeout stays a TimeoutError), then the backend
      // aborts, which fails nothing more: the queue has failed already.
      fail_locked(verdict, lock);
      lock.unlock();
      if (opt_.on_failure) opt_.on_failure(reason);
      lock.lock();
      continue;
    }
    // Still running: back off from spinning to short sleeps (a bucket's collective takes from
    // tens of microseconds to milliseconds).
    cv_.wait_for(lock, interval, [this] { return stop_; });
    interval = std::min(interval * 2, std::chrono::duration_cast<std::chrono::microseconds>(opt_.max_poll_interval));
  }
}

}  // namespace shardflow
