// The completion watcher behind the device backends (Note [Device completions]), driven by fake
// "events" so that it is checked on every machine, GPU or not; and how bucket completions wake the
// rank actor (Note [Watched completions]).
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include "runtime/comm/completion_queue.hpp"
#include "runtime/core/iteration_signal.hpp"
#include "shardflow/errors.hpp"

using namespace shardflow;
using namespace std::chrono_literals;
using State = CompletionQueue::State;

namespace {

// A fake device event: pending until fired.
struct FakeEvent {
  std::atomic<int> state{0};  // 0 pending, 1 done, 2 failed
  CompletionQueue::Poll poll() {
    return [this](std::string& err) {
      const int s = state.load();
      if (s == 2) err = "an illegal memory access was encountered";
      return s == 0 ? State::pending : s == 1 ? State::done : State::failed;
    };
  }
};

struct Recorder {
  std::mutex mu;
  std::vector<std::string> order;
  std::vector<std::exception_ptr> errors;
  CollectiveDone done(std::string name) {
    return [this, name](std::exception_ptr e) {
      std::lock_guard lock(mu);
      order.push_back(name);
      errors.push_back(e);
    };
  }
  std::size_t count() {
    std::lock_guard lock(mu);
    return order.size();
  }
  bool wait_for(std::size_t n, std::chrono::milliseconds limit = 5s) {
    const auto end = std::chrono::steady_clock::now() + limit;
    while (count() < n && std::chrono::steady_clock::now() < end) std::this_thread::sleep_for(1ms);
    return count() >= n;
  }
};

std::string message(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
  return {};
}

CompletionQueue::Options options(std::chrono::milliseconds timeout = 10s) {
  CompletionQueue::Options o;
  o.who = "rank 1 (test)";
  o.timeout = timeout;
  return o;
}

}  // namespace

TEST_CASE("device completions: ops are reported in submission order even when a later one finishes first") {
  CompletionQueue q(options());
  Recorder r;
  FakeEvent a, b, c;
  q.push("allreduce 'bucket 0'", a.poll(), r.done("bucket 0"));
  q.push("allreduce 'bucket 1'", b.poll(), r.done("bucket 1"));
  q.push("allreduce 'bucket 2'", c.poll(), r.done("bucket 2"));
  c.state = 1;
  b.state = 1;
  std::this_thread::sleep_for(20ms);
  CHECK(r.count() == 0);  // bucket 0 still runs: a stream completes in order, so nothing is reported
  a.state = 1;
  REQUIRE(r.wait_for(3));
  CHECK(r.order == std::vector<std::string>{"bucket 0", "bucket 1", "bucket 2"});
  for (auto& e : r.errors) CHECK(!e);
  CHECK(!q.busy());
}

TEST_CASE("device completions: keep_alive is held until the op's completion has run") {
  CompletionQueue q(options());
  FakeEvent a;
  auto buffer = std::make_shared<int>(7);
  std::weak_ptr<int> watch = buffer;
  std::promise<bool> alive_in_done;
  q.push("allgather 'sync bucket 0'", a.poll(), [&](std::exception_ptr) { alive_in_done.set_value(!watch.expired()); }, buffer);
  buffer.reset();
  std::this_thread::sleep_for(10ms);
  CHECK(!watch.expired());
  a.state = 1;
  CHECK(alive_in_done.get_future().get());
  for (int i = 0; i < 500 && !watch.expired(); ++i) std::this_thread::sleep_for(1ms);
  CHECK(watch.expired());
}

TEST_CASE("device completions: an op that never completes fails after the timeout naming it — the backend is aborted, later ops fail at once") {
  auto o = options(150ms);
  std::promise<std::string> aborted;
  o.on_failure = [&](const std::string& reason) { aborted.set_value(reason); };
  CompletionQueue q(o);
  Recorder r;
  FakeEvent stuck, behind;
  const auto start = std::chrono::steady_clock::now();
  q.push("allreduce 'bucket 3'", stuck.poll(), r.done("bucket 3"));
  q.push("allreduce 'bucket 4'", behind.poll(), r.done("bucket 4"));
  REQUIRE(r.wait_for(2));
  const auto took = std::chrono::steady_clock::now() - start;
  CHECK(took >= 150ms);
  CHECK(took < 2s);
  CHECK_THROWS_AS(std::rethrow_exception(r.errors[0]), TimeoutError);
  CHECK(message(r.errors[0]).find("rank 1 (test): allreduce 'bucket 3' did not complete within 150 ms") != std::string::npos);
  CHECK(message(r.errors[1]).find("bucket 3") != std::string::npos);  // the cause, not a second timeout
  CHECK(aborted.get_future().get().find("bucket 3") != std::string::npos);
  // Sticky: a new op fails on the spot instead of waiting for another timeout.
  FakeEvent later;
  q.push("allreduce 'bucket 0'", later.poll(), r.done("next iteration"));
  REQUIRE(r.count() == 3);
  CHECK(message(r.errors[2]).find("bucket 3") != std::string::npos);
}

TEST_CASE("device completions: the timeout runs from when an op became the oldest, not from its submission") {
  CompletionQueue q(options(300ms));
  Recorder r;
  FakeEvent slow, next;
  q.push("allreduce 'bucket 0'", slow.poll(), r.done("bucket 0"));
  q.push("allreduce 'bucket 1'", next.poll(), r.done("bucket 1"));
  std::this_thread::sleep_for(200ms);
  slow.state = 1;  // 200 ms: inside its own timeout
  std::this_thread::sleep_for(200ms);  // bucket 1 has waited 400 ms since submission, 200 ms as the oldest
  next.state = 1;
  REQUIRE(r.wait_for(2));
  CHECK(!r.errors[0]);
  CHECK(!r.errors[1]);
}

TEST_CASE("device completions: an idle queue longer than the timeout (an evaluation between steps) does not count against the next op") {
  CompletionQueue q(options(100ms));
  Recorder r;
  FakeEvent first, after_idle;
  first.state = 1;
  q.push("allreduce 'bucket 0'", first.poll(), r.done("bucket 0"));
  REQUIRE(r.wait_for(1));
  std::this_thread::sleep_for(250ms);  // nothing queued: the completion thread idles
  q.push("allreduce 'bucket 0'", after_idle.poll(), r.done("bucket 0, next step"));
  std::this_thread::sleep_for(20ms);
  after_idle.state = 1;
  REQUIRE(r.wait_for(2));
  CHECK(!r.errors[0]);
  CHECK(!r.errors[1]);
}

TEST_CASE("device completions: a backend error (a peer died) fails every pending op with the backend's reason") {
  auto o = options();
  std::atomic<bool> broken{false};
  o.health = [&]() -> std::optional<std::string> {
    if (broken) return "NCCL reports remote process exited or there was a network error";
    return std::nullopt;
  };
  CompletionQueue q(o);
  Recorder r;
  FakeEvent a, b;
  q.push("reduce_scatter 'bucket 2'", a.poll(), r.done("a"));
  q.push("allgather 'sync bucket 2'", b.poll(), r.done("b"));
  std::this_thread::sleep_for(10ms);
  broken = true;
  REQUIRE(r.wait_for(2, 2s));
  CHECK_THROWS_AS(std::rethrow_exception(r.errors[0]), CommError);
  CHECK(message(r.errors[0]).find("reduce_scatter 'bucket 2' cannot complete: NCCL reports remote process exited") !=
        std::string::npos);
}

TEST_CASE("device completions: a failed op reports the device's message") {
  CompletionQueue q(options());
  Recorder r;
  FakeEvent a;
  q.push("allreduce 'bucket 5'", a.poll(), r.done("a"));
  a.state = 2;
  REQUIRE(r.wait_for(1));
  CHECK(message(r.errors[0]).find("allreduce 'bucket 5' failed on the device: an illegal memory access") != std::string::npos);
}

TEST_CASE("device completions: abort fails pending ops promptly with the reason — destroying the queue never hangs") {
  Recorder r;
  FakeEvent a, b;
  {
    CompletionQueue q(options());
    q.push("allreduce 'bucket 0'", a.poll(), r.done("a"));
    q.fail("rank 0 aborted: finish_backward: 1 parameter(s) got no gradient");
    REQUIRE(r.wait_for(1, 1s));
    CHECK(message(r.errors[0]).find("got no gradient") != std::string::npos);
    q.push("allreduce 'bucket 1'", b.poll(), r.done("b"));  // never watched: destroyed right away
  }
  CHECK(r.count() == 2);
  Recorder r2;
  FakeEvent never;
  const auto start = std::chrono::steady_clock::now();
  {
    CompletionQueue q(options());
    q.push("allreduce 'bucket 0'", never.poll(), r2.done("a"));
  }
  CHECK(std::chrono::steady_clock::now() - start < 1s);
  REQUIRE(r2.count() == 1);
  CHECK(message(r2.errors[0]).find("destroyed with 1 collective(s) pending") != std::string::npos);
}

namespace {

// A signal of `slots` whose on_done counts the wake-ups it asks for.
struct Watched {
  std::atomic<int> wakes{0};
  IterationSignal signal;
  explicit Watched(std::size_t slots)
      : signal(slots, [this](std::uint32_t, std::uint64_t, const BucketFailure&, bool wake) { wakes += wake ? 1 : 0; }) {}
};

}  // namespace

TEST_CASE("watched completions: a completion wakes the rank actor only when it meets what the actor waits for, or fails — a new signal, and one whose watch was met, wake on every completion") {
  Watched w(3);
  w.signal.bucket_done(0, {});
  CHECK(w.wakes == 1);  // nothing watched yet: every completion wakes
  // Every slot at 1: slots 1 and 2 are still below.
  CHECK_FALSE(w.signal.watch({1, {}}));
  w.signal.bucket_done(1, {});
  CHECK(w.wakes == 1);
  w.signal.bucket_done(2, {});
  CHECK(w.wakes == 2);
  w.signal.bucket_done(0, {});  // the watch was met: wakes until the next watch
  CHECK(w.wakes == 3);
  // Slot 1 at 2 and slot 2 at 3: slot 0's completions and slot 2's second say nothing.
  CHECK_FALSE(w.signal.watch({0, {{1, 2}, {2, 3}}}));
  w.signal.bucket_done(0, {});
  w.signal.bucket_done(2, {});
  CHECK(w.wakes == 3);
  w.signal.bucket_done(1, {});
  CHECK(w.wakes == 4);
  // Given what is met already, watch() says so (look again), and the next completion wakes.
  CHECK(w.signal.watch({2, {}}));
  CHECK(w.signal.watch({0, {{0, 1}}}));
  CHECK_FALSE(w.signal.watch({5, {}}));
  w.signal.bucket_done(2, BucketFailure{BucketFailure::comm, "rank 1 lost"});  // a failure always wakes
  CHECK(w.wakes == 5);
}

TEST_CASE("watched completions: with no wait left the rank actor watches nothing — completions between two waits wake nobody, a failure still does, the next watch works as before") {
  // Note [Idle between waits] (rank_actor.cpp): the empty watch the actor sets once it answered its last wait.
  Watched w(2);
  CHECK_FALSE(w.signal.watch({}));
  for (int i = 0; i < 5; ++i) {
    w.signal.bucket_done(0, {});
    w.signal.bucket_done(1, {});
  }
  CHECK(w.wakes == 0);
  CHECK(w.signal.all_done(5));  // counted all the same: the next request reads them when it looks
  CHECK_FALSE(w.signal.watch({6, {}}));
  w.signal.bucket_done(0, {});
  CHECK(w.wakes == 0);
  w.signal.bucket_done(1, {});
  CHECK(w.wakes == 1);
  CHECK_FALSE(w.signal.watch({}));
  w.signal.bucket_done(1, BucketFailure{BucketFailure::comm, "rank 1 lost"});
  CHECK(w.wakes == 2);
}

TEST_CASE("watched completions: a waiter that looks, then watches, never misses the completion it needs — 2,000 iterations of 8 buckets completed by another thread") {
  // The rank actor's loop (rank_actor.cpp, check): look at the signal; if the iteration is not
  // complete, watch for it; if watch() says it is met already, look again; else sleep until woken.
  constexpr std::size_t slots = 8;
  constexpr std::uint64_t iterations = 2000;
  std::mutex mu;
  std::condition_variable cv;
  int pending_wakes = 0;
  IterationSignal signal(slots, [&](std::uint32_t, std::uint64_t, const BucketFailure&, bool wake) {
    if (!wake) return;
    std::lock_guard lock(mu);
    ++pending_wakes;
    cv.notify_one();
  });
  std::thread completer([&] {
    for (std::uint64_t it = 1; it <= iterations; ++it)
      for (std::uint32_t b = 0; b < slots; ++b) signal.bucket_done(b, {});
  });
  std::uint64_t missed = 0;
  for (std::uint64_t it = 1; it <= iterations; ++it) {
    while (!signal.all_done(it)) {
      if (signal.watch({it, {}})) continue;
      std::unique_lock lock(mu);
      if (!cv.wait_for(lock, 2s, [&] { return pending_wakes > 0; })) {
        ++missed;
        break;
      }
      pending_wakes = 0;
    }
  }
  completer.join();
  CHECK(missed == 0);
}
