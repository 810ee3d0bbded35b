// In-process collectives: every op, sizes 0, 1, odd and big (64 MiB; 4 MiB under the sanitizers),
// worlds 1 to 5, checked element by element against what the op promises; and the failures a real
// cluster produces (a rank that never shows up, ranks that disagree on the op) end in clear errors,
// never a hang.
#include <doctest/doctest.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <cstring>
#include <numeric>

#include "support/helpers.hpp"
#include "kernels/cpu/dtype.hpp"

using namespace shardflow;
using namespace std::chrono_literals;

namespace {

using test::make;

// Small integers: every sum is exact in fp32, so "element-wise" can mean bitwise.
float value(int rank, std::size_t i) { return float((rank + 1) * int(i % 61) - 7 * rank); }

// The big size: past every cache, many pages per rank's chunk. Under a sanitizer 4 MiB: the
// in-process ops have no path that depends on the size (peer_collective.cpp splits by rank alone),
// and 64 MiB there cost CI two minutes of TSan for no code the smaller size does not run.
const std::size_t kBig = (std::size_t{test::kSanitized ? 4 : 64} << 20) / sizeof(float);

// The rank-ordered sum of every rank's value(k, i), i in [first, first + count): computed once,
// not once per receiving rank.
std::vector<float> rank_sums(int n, std::size_t first, std::size_t count) {
  std::vector<float> sums(count, 0.0f);
  for (int k = 0; k < n; ++k)
    for (std::size_t i = 0; i < count; ++i) sums[i] += value(k, first + i);
  return sums;
}

}  // namespace

TEST_CASE("allreduce: every rank ends with the rank-ordered sum, in place, for sizes 0, 1, odd, big and worlds 1-5") {
  for (int n = 1; n <= 5; ++n) {
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{1023}, std::size_t{4099}, kBig}) {
      CAPTURE(n);
      CAPTURE(count);
      auto world = InProcessWorld::create(n, 60s);
      std::vector<std::vector<float>> bufs(static_cast<std::size_t>(n));
      auto errors = test::run_ranks(n, [&](int r) {
        auto& b = bufs[std::size_t(r)];
        b.resize(count);
        for (std::size_t i = 0; i < count; ++i) b[i] = value(r, i);
        world->communicator(r)->run(make(CollectiveKind::allreduce, b.data(), b.data(), count), 60s);
      });
      test::require_all_ok(errors);
      const auto want = rank_sums(n, 0, count);
      std::size_t bad = 0;
      for (int r = 0; r < n; ++r)
        for (std::size_t i = 0; i < count; ++i) bad += bufs[std::size_t(r)][i] != want[i];
      CHECK(bad == 0);
    }
  }
}

TEST_CASE("allreduce with the 1/world scale fused: the average, identical on every rank") {
  for (int n : {2, 3, 5}) {
    const std::size_t count = 10007;
    auto world = InProcessWorld::create(n, 60s);
    std::vector<std::vector<float>> bufs(static_cast<std::size_t>(n), std::vector<float>(count));
    auto errors = test::run_ranks(n, [&](int r) {
      for (std::size_t i = 0; i < count; ++i) bufs[std::size_t(r)][i] = value(r, i) * 0.37f;
      world->communicator(r)->run(make(CollectiveKind::allreduce, bufs[std::size_t(r)].data(), bufs[std::size_t(r)].data(),
                                       count, 1.0f / float(n)),
                                  60s);
    });
    test::require_all_ok(errors);
    for (std::size_t i = 0; i < count; ++i) {
      double want = 0;
      for (int k = 0; k < n; ++k) want += double(value(k, i) * 0.37f);
      want /= n;
      REQUIRE(std::abs(bufs[0][i] - want) <= 1e-5 * (1 + std::abs(want)));
      for (int r = 1; r < n; ++r) REQUIRE(std::memcmp(&bufs[std::size_t(r)][i], &bufs[0][i], 4) == 0);
    }
  }
}

TEST_CASE("allreduce out of place leaves the send buffer alone") {
  const int n = 3;
  const std::size_t count = 777;
  auto world = InProcessWorld::create(n, 60s);
  std::vector<std::vector<float>> send(n, std::vector<float>(count)), recv(n, std::vector<float>(count, -1));
  test::require_all_ok(test::run_ranks(n, [&](int r) {
    for (std::size_t i = 0; i < count; ++i) send[std::size_t(r)][i] = value(r, i);
    world->communicator(r)->run(make(CollectiveKind::allreduce, send[std::size_t(r)].data(), recv[std::size_t(r)].data(), count), 60s);
  }));
  for (int r = 0; r < n; ++r)
    for (std::size_t i = 0; i < count; ++i) {
      REQUIRE(send[std::size_t(r)][i] == value(r, i));
      REQUIRE(recv[std::size_t(r)][i] == value(0, i) + value(1, i) + value(2, i));
    }
}

TEST_CASE("reduce_scatter: rank r receives the sum of everyone's r-th block") {
  for (int n = 1; n <= 5; ++n) {
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{333}, kBig / 5}) {
      CAPTURE(n);
      CAPTURE(count);
      auto world = InProcessWorld::create(n, 60s);
      std::vector<std::vector<float>> send(static_cast<std::size_t>(n)), recv(static_cast<std::size_t>(n));
      test::require_all_ok(test::run_ranks(n, [&](int r) {
        send[std::size_t(r)].resize(count * std::size_t(n));
        recv[std::size_t(r)].assign(count, -1);
        for (std::size_t i = 0; i < send[std::size_t(r)].size(); ++i) send[std::size_t(r)][i] = value(r, i);
        world->communicator(r)->run(make(CollectiveKind::reduce_scatter, send[std::size_t(r)].data(), recv[std::size_t(r)].data(), count), 60s);
      }));
      std::size_t bad = 0;
      for (int r = 0; r < n; ++r) {
        const auto want = rank_sums(n, std::size_t(r) * count, count);
        for (std::size_t i = 0; i < count; ++i) bad += recv[std::size_t(r)][i] != want[i];
      }
      CHECK(bad == 0);
    }
  }
}

TEST_CASE("allgather: every rank receives all blocks in rank order") {
  for (int n = 1; n <= 5; ++n) {
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{513}, kBig / 5}) {
      CAPTURE(n);
      CAPTURE(count);
      auto world = InProcessWorld::create(n, 60s);
      std::vector<std::vector<float>> send(static_cast<std::size_t>(n)), recv(static_cast<std::size_t>(n));
      test::require_all_ok(test::run_ranks(n, [&](int r) {
        send[std::size_t(r)].resize(count);
        recv[std::size_t(r)].assign(count * std::size_t(n), -1);
        for (std::size_t i = 0; i < count; ++i) send[std::size_t(r)][i] = value(r, i);
        world->communicator(r)->run(make(CollectiveKind::allgather, send[std::size_t(r)].data(), recv[std::size_t(r)].data(), count), 60s);
      }));
      std::size_t bad = 0;
      for (int r = 0; r < n; ++r)
        for (int k = 0; k < n; ++k)
          for (std::size_t i = 0; i < count; ++i) bad += recv[std::size_t(r)][std::size_t(k) * count + i] != value(k, i);
      CHECK(bad == 0);
    }
  }
}

TEST_CASE("broadcast: every rank receives the root's buffer, for every root") {
  for (int n = 1; n <= 5; ++n) {
    for (int root = 0; root < n; ++root) {
      for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{999}, kBig}) {
        if (count == kBig && root != n - 1) continue;  // one big size per world is enough
        CAPTURE(n);
        CAPTURE(root);
        CAPTURE(count);
        auto world = InProcessWorld::create(n, 60s);
        std::vector<std::vector<float>> bufs(static_cast<std::size_t>(n));
        test::require_all_ok(test::run_ranks(n, [&](int r) {
          bufs[std::size_t(r)].resize(count);
          for (std::size_t i = 0; i < count; ++i) bufs[std::size_t(r)][i] = value(r, i);
          world->communicator(r)->run(make(CollectiveKind::broadcast, bufs[std::size_t(r)].data(), bufs[std::size_t(r)].data(), count, 1.0f, root), 60s);
        }));
        std::size_t bad = 0;
        for (int r = 0; r < n; ++r)
          for (std::size_t i = 0; i < count; ++i) bad += bufs[std::size_t(r)][i] != value(root, i);
        CHECK(bad == 0);
      }
    }
  }
}

// Note [Shift]: what a mirrored shard's twin takes from its owner.
TEST_CASE("shift: rank r receives rank (r - distance) mod world's block, for every distance (negative, zero, past the world) at worlds 1-5") {
  for (int n = 1; n <= 5; ++n) {
    auto world = InProcessWorld::create(n, 30s);
    for (int distance = -n - 1; distance <= n + 1; ++distance) {
      CAPTURE(n);
      CAPTURE(distance);
      const std::size_t count = 999;
      std::vector<std::vector<float>> in(static_cast<std::size_t>(n), std::vector<float>(count));
      std::vector<std::vector<float>> out(static_cast<std::size_t>(n), std::vector<float>(count, -1.0f));
      test::require_all_ok(test::run_ranks(n, [&](int r) {
        for (std::size_t i = 0; i < count; ++i) in[std::size_t(r)][i] = value(r, i);
        auto op = make(CollectiveKind::shift, in[std::size_t(r)].data(), out[std::size_t(r)].data(), count);
        op.distance = distance;
        world->communicator(r)->run(op, 30s);
      }));
      std::size_t bad = 0;
      for (int r = 0; r < n; ++r) {
        const int from = ((r - distance) % n + n) % n;
        for (std::size_t i = 0; i < count; ++i) bad += out[std::size_t(r)][i] != value(from, i);
      }
      CHECK(bad == 0);
    }
  }
}

TEST_CASE("shift: one buffer as send and recv is refused on every rank, naming the op, and ranks shifting by different distances fail with a MismatchError naming both") {
  const int n = 3;
  {
    auto world = InProcessWorld::create(n, 30s);
    std::vector<std::vector<float>> bufs(n, std::vector<float>(10));
    auto errors = test::run_ranks(n, [&](int r) {
      auto op = make(CollectiveKind::shift, bufs[std::size_t(r)].data(), bufs[std::size_t(r)].data(), 10);
      op.distance = 1;
      op.tag = "mirror bucket 4";
      world->communicator(r)->run(op, 30s);
    });
    // The rank that refused first names the op; the others fail at once with its reason, not at the timeout.
    for (int r = 0; r < n; ++r) CHECK(test::message_of(errors[std::size_t(r)]).find("shift 'mirror bucket 4' has one buffer as its send and its recv") != std::string::npos);
  }
  auto world = InProcessWorld::create(n, 30s);
  std::vector<std::vector<float>> in(n, std::vector<float>(10)), out(n, std::vector<float>(10));
  auto errors = test::run_ranks(n, [&](int r) {
    auto op = make(CollectiveKind::shift, in[std::size_t(r)].data(), out[std::size_t(r)].data(), 10);
    op.distance = r == 2 ? 2 : 1;
    world->communicator(r)->run(op, 30s);
  });
  for (int r = 0; r < n; ++r) {
    REQUIRE(test::is<MismatchError>(errors[std::size_t(r)]));
    const std::string msg = test::message_of(errors[std::size_t(r)]);
    CHECK(msg.find("shift of 10 fp32 by 1 rank(s)") != std::string::npos);
    CHECK(msg.find("rank 2 issued shift of 10 fp32 by 2 rank(s)") != std::string::npos);
  }
}

TEST_CASE("bf16 and fp16 allreduce accumulate in fp32 and round once") {
  using namespace shardflow::kernels;
  const int n = 4;
  const std::size_t count = 1001;
  for (DType t : {DType::bf16, DType::f16}) {
    CAPTURE(std::string(dtype_name(t)));
    auto to16 = [&](float f) { return t == DType::bf16 ? f32_to_bf16(f) : f32_to_f16(f); };
    auto from16 = [&](std::uint16_t h) { return t == DType::bf16 ? bf16_to_f32(h) : f16_to_f32(h); };
    auto world = InProcessWorld::create(n, 60s);
    std::vector<std::vector<std::uint16_t>> bufs(n, std::vector<std::uint16_t>(count));
    test::require_all_ok(test::run_ranks(n, [&](int r) {
      for (std::size_t i = 0; i < count; ++i) bufs[std::size_t(r)][i] = to16(0.01f * float(i) + 0.5f * float(r));
      auto op = make(CollectiveKind::allreduce, bufs[std::size_t(r)].data(), bufs[std::size_t(r)].data(), count, 0.25f);
      op.dtype = t;
      world->communicator(r)->run(op, 60s);
    }));
    for (std::size_t i = 0; i < count; ++i) {
      float acc = 0;
      for (int k = 0; k < n; ++k) acc += from16(to16(0.01f * float(i) + 0.5f * float(k)));
      const std::uint16_t want = to16(acc * 0.25f);
      for (int r = 0; r < n; ++r) REQUIRE(bufs[std::size_t(r)][i] == want);
    }
  }
}

TEST_CASE("ops run in submission order on each rank's comm stream and complete asynchronously") {
  const int n = 3;
  auto world = InProcessWorld::create(n, 60s);
  std::vector<std::vector<int>> completions(n);
  std::vector<std::vector<float>> bufs(n, std::vector<float>(64 * 8));
  test::require_all_ok(test::run_ranks(n, [&](int r) {
    auto comm = world->communicator(r);
    std::atomic<int> left{8};
    std::mutex mu;
    std::condition_variable cv;
    for (int k = 0; k < 8; ++k) {
      float* b = bufs[std::size_t(r)].data() + 64 * k;
      std::fill(b, b + 64, float(k + r));
      comm->submit(make(CollectiveKind::allreduce, b, b, 64), [&, k](std::exception_ptr e) {
        REQUIRE(!e);
        std::lock_guard lock(mu);
        completions[std::size_t(r)].push_back(k);
        if (--left == 0) cv.notify_all();
      });
    }
    std::unique_lock lock(mu);
    REQUIRE(cv.wait_for(lock, 30s, [&] { return left == 0; }));
  }));
  for (int r = 0; r < n; ++r) {
    CHECK(completions[std::size_t(r)] == std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7});
    for (int k = 0; k < 8; ++k) CHECK(bufs[std::size_t(r)][64 * std::size_t(k)] == float(3 * k + 3));
  }
}

TEST_CASE("a rank that never arrives: the others fail with a TimeoutError naming it, no hang") {
  const int n = 3;
  auto world = InProcessWorld::create(n, 300ms);
  std::vector<float> a(16), b(16);
  std::vector<std::exception_ptr> errors(2);
  const auto t0 = std::chrono::steady_clock::now();
  auto got = test::run_ranks(2, [&](int r) {
    auto& buf = r == 0 ? a : b;
    world->communicator(r)->run(make(CollectiveKind::allreduce, buf.data(), buf.data(), 16), 300ms);
  });
  const auto took = std::chrono::steady_clock::now() - t0;
  CHECK(took < 5s);
  for (int r = 0; r < 2; ++r) {
    REQUIRE(got[std::size_t(r)]);
    const std::string msg = test::message_of(got[std::size_t(r)]);
    CAPTURE(msg);
    // One rank times out and names rank 2; the other fails at once with that reason.
    CHECK(msg.find("rank(s) 2") != std::string::npos);
  }
  CHECK((test::is<TimeoutError>(got[0]) || test::is<TimeoutError>(got[1])));
}

TEST_CASE("ranks that issue different collectives fail with a MismatchError on every rank") {
  const int n = 3;
  auto world = InProcessWorld::create(n, 30s);
  std::vector<std::vector<float>> bufs(n, std::vector<float>(100));
  auto errors = test::run_ranks(n, [&](int r) {
    const std::size_t count = r == 2 ? 50 : 100;  // rank 2 thinks the bucket is smaller
    world->communicator(r)->run(make(CollectiveKind::allreduce, bufs[std::size_t(r)].data(), bufs[std::size_t(r)].data(), count), 30s);
  });
  for (int r = 0; r < n; ++r) {
    REQUIRE(test::is<MismatchError>(errors[std::size_t(r)]));
    const std::string msg = test::message_of(errors[std::size_t(r)]);
    CHECK(msg.find("rank 2 issued allreduce of 50") != std::string::npos);
  }
}

TEST_CASE("abort: a rank giving up fails its peers' pending collectives promptly with its reason") {
  const int n = 2;
  auto world = InProcessWorld::create(n, 60s);
  std::vector<float> a(8);
  const auto t0 = std::chrono::steady_clock::now();
  auto errors = test::run_ranks(n, [&](int r) {
    if (r == 1) {
      std::this_thread::sleep_for(100ms);
      world->communicator(1)->abort("loss became NaN");
      return;
    }
    world->communicator(0)->run(make(CollectiveKind::allreduce, a.data(), a.data(), 8), 60s);
  });
  CHECK(std::chrono::steady_clock::now() - t0 < 10s);
  REQUIRE(test::is<CommError>(errors[0]));
  CHECK(test::message_of(errors[0]).find("loss became NaN") != std::string::npos);
}

TEST_CASE("world creation rejects nonsense") {
  CHECK_THROWS_AS(InProcessWorld::create(0), UsageError);
  auto w = InProcessWorld::create(2);
  CHECK_THROWS_AS(w->communicator(2), UsageError);
  CHECK_THROWS_AS(w->communicator(-1), UsageError);
}
