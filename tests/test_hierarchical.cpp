// Two-level collectives (shardflow/hierarchical.hpp, Note [Two-level collectives]): hosts of
// several ranks, shared memory inside a host and the network between hosts, played here by
// in-process worlds: one per host and one per local index.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <numeric>
#include <random>
#include <exception>
#include <thread>
#include <vector>

#include "examples/mlp/train.hpp"
#include "support/forwarding_comm.hpp"
#include "support/jitter_comm.hpp"
#include "runtime/plans/run_plan.hpp"
#include "runtime/comm/scratch_pool.hpp"
#include "shardflow/hierarchical.hpp"
#include "tests/support/collective_op.hpp"

using namespace shardflow;
using namespace std::chrono_literals;

namespace {

// Hands every op to the network's stand-in, adding up what the buckets' collectives put on it:
// each rank's ring share (wire_bytes), so that the sum over the ranks is what leaves the hosts.
class CountingComm final : public test::ForwardingComm {
 public:
  CountingComm(std::shared_ptr<Communicator> inner, std::atomic<std::size_t>& bytes) : ForwardingComm(std::move(inner)), bytes_(bytes) {}
  void submit(CollectiveOp op, CollectiveDone done) override {
    if (op.tag.rfind("bucket ", 0) == 0 || op.tag.rfind("sync bucket ", 0) == 0 || op.tag.rfind("mirror bucket ", 0) == 0)
      bytes_ += wire_bytes(op, world_size());
    inner_->submit(std::move(op), std::move(done));
  }

 private:
  std::atomic<std::size_t>& bytes_;
};

// hosts x local ranks as threads; f(comm, rank) on each. `lanes`: a second world per host for the
// stages after the network, so that collectives overlap (Note [Lanes]); without, one at a time.
// `crossed`: counts the buckets' bytes between hosts (CountingComm).
template <class F>
void on_hosts(int hosts, int local, F f, bool lanes = true, std::atomic<std::size_t>* crossed = nullptr,
              std::chrono::milliseconds timeout = 20s) {
  std::vector<std::shared_ptr<InProcessWorld>> inside, after, between;
  for (int h = 0; h < hosts; ++h) inside.push_back(InProcessWorld::create(local, timeout));
  for (int h = 0; h < hosts; ++h) after.push_back(InProcessWorld::create(local, timeout));
  for (int l = 0; l < local; ++l) between.push_back(InProcessWorld::create(hosts, timeout));
  std::vector<std::thread> threads;
  for (int h = 0; h < hosts; ++h)
    for (int l = 0; l < local; ++l)
      threads.emplace_back([&, h, l] {
        std::shared_ptr<Communicator> network = between[std::size_t(l)]->communicator(h);
        if (crossed) network = std::make_shared<CountingComm>(network, *crossed);
        auto comm = make_hierarchical(inside[std::size_t(h)]->communicator(l), network, lanes ? after[std::size_t(h)]->communicator(l) : nullptr);
        f(*comm, h * local + l);
      });
  for (auto& t : threads) t.join();
}

using test::make;

// The small MLP both MLP scenarios train at world 4, AdamW, 4 KiB buckets.
mlp::TrainOptions small_mlp(int stage, Overlap overlap, int steps) {
  mlp::TrainOptions opt;
  opt.sizes = {24, 40, 40, 6};
  opt.steps = steps;
  opt.global_batch = 12;
  opt.world_size = 4;
  opt.optimizer.kind = OptimizerConfig::Kind::adamw;
  opt.runtime.zero.stage = ZeroStage(stage);
  opt.runtime.zero.overlap = overlap;
  opt.runtime.buckets.first_cap_bytes = opt.runtime.buckets.cap_bytes = 4096;
  opt.runtime.timeouts.collective = 20s;
  return opt;
}

}  // namespace

TEST_CASE("2x2, 3x2 and 2x3 hosts x ranks, with the gathers on their own lane or not: every collective gives what the flat world gives (exact sums of small integers), a shift moves by whole hosts or inside each host") {
  for (auto [hosts, local] : {std::pair{2, 2}, std::pair{3, 2}, std::pair{2, 3}})
  for (bool lanes : {true, false}) {
    CAPTURE(hosts);
    CAPTURE(local);
    CAPTURE(lanes);
    const int W = hosts * local;
    std::vector<int> bad(std::size_t(W), 0);
    on_hosts(hosts, local, [&](Communicator& comm, int r) {
      int& b = bad[std::size_t(r)];
      b += comm.rank() != r || comm.world_size() != W;
      // all-reduce of 7 elements (not a multiple of the ranks per host), summed
      std::vector<float> x(7);
      for (int i = 0; i < 7; ++i) x[std::size_t(i)] = float(r * 10 + i);
      comm.run(make(CollectiveKind::allreduce, x.data(), x.data(), 7), 20s);
      for (int i = 0; i < 7; ++i) b += x[std::size_t(i)] != float(10 * W * (W - 1) / 2 + W * i);
      // reduce-scatter: rank q gets the sum of every rank's block q
      const int c = 3;
      std::vector<float> blocks(std::size_t(W * c)), mine(c);
      for (int q = 0; q < W; ++q)
        for (int i = 0; i < c; ++i) blocks[std::size_t(q * c + i)] = float(r * 100 + q * 10 + i);
      comm.run(make(CollectiveKind::reduce_scatter, blocks.data(), mine.data(), c), 20s);
      for (int i = 0; i < c; ++i) b += mine[std::size_t(i)] != float(100 * W * (W - 1) / 2 + W * (r * 10 + i));
      // all-gather: rank order
      std::vector<float> one(c), all(std::size_t(W * c));
      for (int i = 0; i < c; ++i) one[std::size_t(i)] = float(r * 10 + i);
      comm.run(make(CollectiveKind::allgather, one.data(), all.data(), c), 20s);
      for (int q = 0; q < W; ++q)
        for (int i = 0; i < c; ++i) b += all[std::size_t(q * c + i)] != float(q * 10 + i);
      // broadcast from the last rank (another host's, not local index 0)
      std::vector<float> from(5, float(r)), to(5, -1.0f);
      comm.run(make(CollectiveKind::broadcast, from.data(), to.data(), 5, 1.0f, W - 1), 20s);
      for (float v : to) b += v != float(W - 1);
      comm.run(make(CollectiveKind::barrier, nullptr, nullptr, 0), 20s);
      // shift by one host (Note [Shift]): rank r's block from the same local index a host back,
      // and by two hosts the other way; a shift by less than a host is refused by name
      for (const int hops : {1, -2}) {
        std::vector<float> in(4, float(r)), out(4, -1.0f);
        auto op = make(CollectiveKind::shift, in.data(), out.data(), 4);
        op.distance = hops * local;
        comm.run(op, 20s);
        for (float v : out) b += v != float(((r - hops * local) % W + W) % W);
      }
      // inside the hosts (CollectiveOp::in_host): from local index l - d of the same host, by 1
      // and by L + 1 (the same shift: the distance is taken mod the ranks a host)
      b += comm.in_host_ranks() != local;
      for (const int d : {1, local + 1, -1}) {
        std::vector<float> in(4, float(r)), out(4, -1.0f);
        auto op = make(CollectiveKind::shift, in.data(), out.data(), 4);
        op.distance = d;
        op.in_host = true;
        comm.run(op, 20s);
        for (float v : out) b += v != float(r / local * local + ((r % local - d) % local + local) % local);
      }
      std::vector<float> in(4), out(4);
      auto op = make(CollectiveKind::shift, in.data(), out.data(), 4);
      op.distance = 1;
      try {
        comm.run(op, 20s);
        ++b;
      } catch (const UsageError& e) {
        b += std::string(e.what()).find("a shift moves by whole hosts, a multiple of " + std::to_string(local)) == std::string::npos;
      }
    }, lanes);
    for (int r = 0; r < W; ++r) CHECK(bad[std::size_t(r)] == 0);
  }
}

TEST_CASE("CollectiveOp::in_host on an all-reduce, over two levels and on one -> refused by name, nothing summed: only an all-gather or a "
          "shift takes it") {
  const auto refused = [](Communicator& comm) {
    std::vector<float> x(4, 1.0f);
    auto op = make(CollectiveKind::allreduce, x.data(), x.data(), 4);
    op.in_host = true;
    op.tag = "loss";
    try {
      comm.run(op, 5s);
      return false;
    } catch (const UsageError& e) {
      return std::string(e.what()).find("allreduce 'loss' sets in_host") != std::string::npos && x == std::vector<float>(4, 1.0f);
    }
  };
  std::vector<int> ok(4, 0);
  on_hosts(2, 2, [&](Communicator& comm, int r) { ok[std::size_t(r)] = refused(comm); });
  CHECK(ok == std::vector<int>(4, 1));
  auto world = InProcessWorld::create(2, 5s);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) threads.emplace_back([&, r] { ok[std::size_t(r)] = refused(*world->communicator(r)); });
  for (auto& t : threads) t.join();
  CHECK(ok[0] == 1);
  CHECK(ok[1] == 1);
}

TEST_CASE("a shift inside the hosts (CollectiveOp::in_host) on a backend of one level -> refused by name on every rank, nothing moved: it would "
          "move other blocks than asked") {
  auto world = InProcessWorld::create(4, 5s);
  std::vector<std::exception_ptr> errors(4);
  std::vector<std::thread> threads;
  std::vector<std::vector<float>> out(4, std::vector<float>(3, -1.0f));
  for (int r = 0; r < 4; ++r)
    threads.emplace_back([&, r] {
      auto comm = world->communicator(r);
      CHECK(comm->in_host_ranks() == 0);
      std::vector<float> in(3, float(r));
      auto op = make(CollectiveKind::shift, in.data(), out[std::size_t(r)].data(), 3);
      op.distance = 1;
      op.in_host = true;
      op.tag = "restore window 2";
      try {
        comm->run(op, 5s);
      } catch (...) {
        errors[std::size_t(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    REQUIRE(errors[std::size_t(r)]);
    CHECK_THROWS_WITH_AS(std::rethrow_exception(errors[std::size_t(r)]), doctest::Contains("shift 'restore window 2' sets in_host"), UsageError);
    CHECK(out[std::size_t(r)] == std::vector<float>(3, -1.0f));
  }
}

TEST_CASE("2 hosts x 2 ranks: 60 collectives of every kind submitted at once, each rank at its own pace, complete in order-independent agreement (Note [Lanes])") {
  const int W = 4, n = 60;
  std::vector<int> bad(W, 0);
  on_hosts(2, 2, [&](Communicator& comm, int r) {
    // Collective i: all-reduce, reduce-scatter, all-gather or barrier by i % 4, of 1 + i % 9 blocks.
    std::vector<std::vector<float>> send(n), recv(n);
    std::mutex mu;
    std::condition_variable cv;
    int done = 0, failed = 0;
    for (int i = 0; i < n; ++i) {
      const std::size_t c = std::size_t(1 + i % 9);
      const auto kind = std::array{CollectiveKind::allreduce, CollectiveKind::reduce_scatter, CollectiveKind::allgather,
                                   CollectiveKind::barrier}[std::size_t(i % 4)];
      auto& in = send[std::size_t(i)];
      auto& out = recv[std::size_t(i)];
      in.resize(kind == CollectiveKind::reduce_scatter ? c * W : c);
      for (std::size_t k = 0; k < in.size(); ++k) in[k] = float(r * 1000 + i * 10 + int(k % 10));
      out.assign(kind == CollectiveKind::allgather ? c * W : c, -1.0f);
      if (kind == CollectiveKind::allreduce) out = in;
      auto op = make(kind, kind == CollectiveKind::allreduce ? out.data() : in.data(), out.data(),
                     kind == CollectiveKind::barrier ? 0 : c);
      comm.submit(std::move(op), [&](std::exception_ptr e) {
        std::lock_guard lock(mu);
        failed += e != nullptr;
        ++done;
        cv.notify_all();
      });
      if ((i + r) % 5 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200 * (r + 1)));
    }
    std::unique_lock lock(mu);
    bad[std::size_t(r)] += !cv.wait_for(lock, 20s, [&] { return done == n; }) || failed;
    for (int i = 0; i < n; ++i) {
      const std::size_t c = std::size_t(1 + i % 9);
      const auto& out = recv[std::size_t(i)];
      for (std::size_t k = 0; k < out.size() && i % 4 != 3; ++k) {
        float want;
        if (i % 4 == 0) want = float(1000 * W * (W - 1) / 2 + W * (i * 10 + int(k % 10)));                          // every rank's element k
        else if (i % 4 == 1) want = float(1000 * W * (W - 1) / 2 + W * (i * 10 + int((std::size_t(r) * c + k) % 10)));  // block r
        else want = float(int(k / c) * 1000 + i * 10 + int(k % c % 10));                                             // rank k / c's
        bad[std::size_t(r)] += out[k] != want;
      }
    }
  });
  for (int r = 0; r < W; ++r) CHECK(bad[std::size_t(r)] == 0);
}

TEST_CASE("2 hosts x 2 ranks: the MLP at every ZeRO stage and overlap mode (and forward prefetch) ends where 1 host x 4 ranks ends, within 1e-5 (another summation order)") {
  struct Mode {
    int stage;
    Overlap overlap;
    bool prefetch;
  };
  for (const auto& m : {Mode{0, Overlap::none, false}, Mode{1, Overlap::none, false}, Mode{1, Overlap::after_backward, false},
                        Mode{1, Overlap::interleaved, false}, Mode{2, Overlap::interleaved, false}, Mode{2, Overlap::interleaved, true}}) {
    const int stage = m.stage;
    CAPTURE(stage);
    CAPTURE(overlap_name(m.overlap));
    CAPTURE(m.prefetch);
    auto opt = small_mlp(stage, m.overlap, 6);
    opt.optimizer.lr = 0.01f;
    opt.runtime.zero.forward_prefetch = m.prefetch;
    const auto flat = mlp::train(opt);
    mlp::TrainResult two_level;
    on_hosts(2, 2, [&](Communicator& comm, int r) {
      auto shared = std::shared_ptr<Communicator>(&comm, [](Communicator*) {});
      auto res = mlp::train_rank(opt, shared);
      if (r == 0) two_level = std::move(res);
    });
    REQUIRE(two_level.params.size() == flat.params.size());
    for (const auto& [name, t] : flat.params) {
      CAPTURE(name);
      const auto a = t.to_f32(name), b = two_level.params.at(name).to_f32(name);
      for (std::size_t i = 0; i < a.size(); ++i) CHECK(b[i] == doctest::Approx(a[i]).epsilon(1e-5));
    }
  }
}

TEST_CASE("shardflow plan's bytes between hosts are what the two levels put on the network: 2 hosts x 2 ranks, ZeRO-0, ZeRO-1 and ZeRO-2, 2/3 of the flat ring's") {
  for (int stage : {0, 1, 2}) {
    CAPTURE(stage);
    auto opt = small_mlp(stage, Overlap::interleaved, 3);
    opt.runtime.buckets.rebuild = false;  // the plan's buckets from the first step on
    std::atomic<std::size_t> crossed{0};
    on_hosts(2, 2, [&](Communicator& comm, int) {
      auto shared = std::shared_ptr<Communicator>(&comm, [](Communicator*) {});
      mlp::train_rank(opt, shared);
    }, true, &crossed);
    std::vector<ParamSpec> params;  // the MLP's, in registration order
    for (std::size_t i = 0; i + 1 < opt.sizes.size(); ++i) {
      params.push_back({"layers." + std::to_string(i) + ".weight", {opt.sizes[i + 1], opt.sizes[i]}});
      params.push_back({"layers." + std::to_string(i) + ".bias", {opt.sizes[i + 1]}});
    }
    auto settings = PlanSettings::from(opt.runtime, 4, 2, true);
    settings.hosts = 2;
    const auto plan = make_run_plan(params, settings);
    CHECK(plan.network.two_levels);
    CHECK(crossed.load() == std::size_t(opt.steps) * plan.network.per_step);
    CHECK(3 * plan.network.per_step == 2 * plan.network.flat_ring_per_step);
  }
}

TEST_CASE("2 hosts x 2 ranks, twins a host away (redundancy 2), stages 1 and 2, fp32 and bf16 on the wire, forward prefetch or not: the twin "
          "gives the other host's block and the sync gathers inside the host -> the parameters bit for bit those without twins, and "
          "between the hosts the bytes without twins, as the plan says") {
  const auto dir = std::filesystem::temp_directory_path() / ("shardflow_twins_two_levels_" + std::to_string(::getpid()));
  for (int stage : {1, 2})
    for (DType wire : {DType::f32, DType::bf16})
      for (bool prefetch : {false, true}) {
        const bool lanes = !(stage == 1 && prefetch);  // the gathers inside the host on their own lane, or on the reductions'
        CAPTURE(stage);
        const std::string wire_name = dtype_name(wire);
        CAPTURE(wire_name);
        CAPTURE(prefetch);
        CAPTURE(lanes);
        auto opt = small_mlp(stage, Overlap::interleaved, 5);
        opt.optimizer.lr = 0.01f;
        opt.runtime.buckets.rebuild = false;  // the plan's buckets from the first step on
        opt.runtime.zero.forward_prefetch = prefetch;
        opt.runtime.zero.clip_grad_norm = 0.05f;  // a coefficient that bites: the twin clips as its source does
        opt.runtime.precision.comm_dtype = wire;
        auto run = [&](int redundancy, std::atomic<std::size_t>& crossed) {
          auto o = opt;
          o.runtime.zero.redundancy = redundancy;
          o.runtime.zero.twin_distance = redundancy == 2 ? 2 : 0;  // a host away, as a launcher's LOCAL_WORLD_SIZE would make it
          o.runtime.snapshot.dir = dir.string();
          o.runtime.snapshot.every = 1000;
          mlp::TrainResult out;
          on_hosts(2, 2, [&](Communicator& comm, int r) {
            auto shared = std::shared_ptr<Communicator>(&comm, [](Communicator*) {});
            auto res = mlp::train_rank(o, shared);
            if (r == 0) out = std::move(res);
          }, lanes, &crossed);
          return out;
        };
        std::atomic<std::size_t> plain_bytes{0}, twin_bytes{0};
        const auto plain = run(1, plain_bytes);
        const auto twins = run(2, twin_bytes);
        REQUIRE(twins.params.size() == plain.params.size());
        for (const auto& [name, t] : plain.params) {
          CAPTURE(name);
          const auto a = t.to_f32(name), b = twins.params.at(name).to_f32(name);
          REQUIRE(a.size() == b.size());
          std::size_t differ = 0;
          for (std::size_t i = 0; i < a.size(); ++i) differ += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
          CHECK(differ == 0);
        }
        CHECK(twin_bytes.load() == plain_bytes.load());
        // The plan says the same: no bytes more between the hosts.
        std::vector<ParamSpec> params;
        for (std::size_t i = 0; i + 1 < opt.sizes.size(); ++i) {
          params.push_back({"layers." + std::to_string(i) + ".weight", {opt.sizes[i + 1], opt.sizes[i]}});
          params.push_back({"layers." + std::to_string(i) + ".bias", {opt.sizes[i + 1]}});
        }
        auto settings = PlanSettings::from(opt.runtime, 4, 2, true);
        settings.hosts = 2;
        settings.redundancy = 2;
        settings.twin_distance = 2;
        const auto with_twins = make_run_plan(params, settings);
        settings.redundancy = 1;
        settings.twin_distance = 0;
        const auto without = make_run_plan(params, settings);
        CHECK(with_twins.syncs_from_twin);
        CHECK(with_twins.network.per_step == without.network.per_step);
        CHECK(twin_bytes.load() == std::size_t(opt.steps) * with_twins.network.per_step);
      }
  std::filesystem::remove_all(dir);
}

TEST_CASE("2 hosts x 2 ranks, rank 3 never joins: the other ranks' all-reduce fails with a TimeoutError naming the level and the ranks in the world's numbering, the reduce-scatter behind it fails too, within the timeout, and the communicators close") {
  std::vector<std::string> errors(4);
  std::vector<double> seconds(4, 0.0);
  on_hosts(2, 2, [&](Communicator& comm, int r) {
    if (r == 3) return;
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<float> x(8, 1.0f), blocks(16, 1.0f), mine(4);
    std::mutex mu;
    std::condition_variable cv;
    int done = 0;
    std::string what;
    auto tell = [&](std::exception_ptr e) {
      std::lock_guard lock(mu);
      try {
        if (e) std::rethrow_exception(e);
      } catch (const TimeoutError& t) {
        what += "timeout: " + std::string(t.what()) + "\n";
      } catch (const CommError& c) {  // the world aborted by the first one's timeout
        what += "aborted: " + std::string(c.what()) + "\n";
      } catch (const std::exception& other) {
        what += "unexpected: " + std::string(other.what()) + "\n";
      }
      ++done;
      cv.notify_all();
    };
    comm.submit(make(CollectiveKind::allreduce, x.data(), x.data(), 8), tell);
    comm.submit(make(CollectiveKind::reduce_scatter, blocks.data(), mine.data(), 4), tell);
    std::unique_lock lock(mu);
    cv.wait_for(lock, 20s, [&] { return done == 2; });
    errors[std::size_t(r)] = what;
    seconds[std::size_t(r)] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }, true, nullptr, 1s);
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r);
    CAPTURE(errors[std::size_t(r)]);
    const std::string& e = errors[std::size_t(r)];
    // The all-reduce times out where it was stuck, naming the ranks in our numbering: rank 2
    // inside its host, waiting for rank 3; ranks 0 and 1 between hosts, waiting for rank 2 or 3
    // (stuck themselves). The reduce-scatter behind it fails as soon as it, or times out too.
    CHECK(e.rfind("timeout: rank " + std::to_string(r) + " (host " + std::to_string(r / 2) + ", local rank " + std::to_string(r % 2) + "), ", 0) == 0);
    if (r == 2)
      CHECK(e.find("inside its host (ranks 2, 3 there numbered 0 to 1): ") != std::string::npos);
    else
      CHECK(e.find("between hosts (ranks " + std::to_string(r) + ", " + std::to_string(r + 2) + " there numbered 0 to 1): ") != std::string::npos);
    CHECK(std::count(e.begin(), e.end(), '\n') == 2);
    CHECK(e.find("unexpected") == std::string::npos);
    CHECK(seconds[std::size_t(r)] < 8.0);  // two 1 s timeouts, one after the other at most, and slack
  }
}

namespace {

// World 4, 14 parameters in small buckets, SGD with momentum and forward prefetch, every sync alone
// (`partition`: flat all-gathers, or param's broadcasts); each
// rank reports its gradients in its own random order right after wait(), waiting for nothing but
// each bucket's own sync (no forward). `comm(r)`: rank r's communicator. Rank 0's parameters.
std::vector<float> prefetch_without_forward(int stage, Partition partition, unsigned seed, const std::function<std::shared_ptr<Communicator>(int)>& comm) {
  const int n = 4, P = 14, iters = 8;
  std::vector<int> sizes;
  for (int i = 0; i < P; ++i) sizes.push_back(200 + 10 * i + (i % 3) * 37);
  const int total = std::accumulate(sizes.begin(), sizes.end(), 0);
  std::vector<std::vector<float>> params(n, std::vector<float>(std::size_t(total)));
  test::require_all_ok(test::run_ranks(n, [&](int r) {
    auto& data = params[std::size_t(r)];
    for (int i = 0; i < total; ++i) data[std::size_t(i)] = 0.01f * float(i % 17);
    Config cfg;
    cfg.buckets.first_cap_bytes = 1024;
    cfg.buckets.cap_bytes = 3000;
    cfg.zero.stage = ZeroStage(stage);
    cfg.zero.overlap = Overlap::interleaved;
    cfg.zero.forward_prefetch = true;
    cfg.zero.partition = partition;
    cfg.zero.fuse_syncs_bytes = 0;  // one group would land every sync at once
    cfg.timeouts.collective = 10s;
    Runtime rt(comm(r), cfg);
    std::vector<Param> h;
    for (int i = 0, off = 0; i < P; off += sizes[std::size_t(i)], ++i)
      h.push_back(rt.register_param({"p" + std::to_string(i), {sizes[std::size_t(i)]}, DType::f32, Device::cpu(), data.data() + off}));
    OptimizerConfig oc;
    oc.kind = OptimizerConfig::Kind::sgd;
    oc.momentum = 0.9f;  // state that a lost step would show (AdamW would amplify the levels' rounding where a mean is ~0)
    oc.lr = 0.01f;
    rt.configure_optimizer(oc);
    std::mt19937 rng(seed * 7u + unsigned(r));
    for (int it = 0; it < iters; ++it) {
      rt.zero_grad();
      std::vector<int> order(P);
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      for (int i : order) {
        float* g = rt.grad_f32(h[std::size_t(i)]);
        for (int e = 0; e < sizes[std::size_t(i)]; ++e) g[e] = 0.01f * float((i * 7 + e * 3 + r * 5 + it) % 23) - 0.1f;
        rt.grad_ready(h[std::size_t(i)]);
      }
      rt.wait();
    }
    rt.wait_all_params();
  }));
  for (int r = 1; r < n; ++r) CHECK(std::memcmp(params[std::size_t(r)].data(), params[0].data(), params[0].size() * 4) == 0);
  return params[0];
}

}  // namespace

TEST_CASE("2 hosts x 2 ranks, forward prefetch, the gathers held back: a bucket's next reduction that lands before another bucket's "
          "sync counts in the next iteration, and training ends where 1 host x 4 ranks ends (Note [The next iteration's reductions])") {
  for (auto partition : {Partition::flat, Partition::param})  // all-gathers; all-reduces and broadcasts
    for (int stage : {1, 2})
      for (unsigned seed : {1u, 2u}) {
        CAPTURE(partition_name(partition));
        CAPTURE(stage);
        CAPTURE(seed);
        auto flat_world = InProcessWorld::create(4, 10s);
        const auto flat = prefetch_without_forward(stage, partition, seed, [&](int r) { return flat_world->communicator(r); });
        std::vector<std::shared_ptr<InProcessWorld>> inside, after, between;
        for (int h = 0; h < 2; ++h) inside.push_back(InProcessWorld::create(2, 10s));
        for (int h = 0; h < 2; ++h) after.push_back(InProcessWorld::create(2, 10s));
        for (int l = 0; l < 2; ++l) between.push_back(InProcessWorld::create(2, 10s));
        const auto two_levels = prefetch_without_forward(stage, partition, seed, [&](int r) {
          const int h = r / 2, l = r % 2;
          return make_hierarchical(inside[std::size_t(h)]->communicator(l), between[std::size_t(l)]->communicator(h),
                                   std::make_shared<test::JitterComm>(after[std::size_t(h)]->communicator(l), seed * 17 + unsigned(r), 2000));
        });
        CHECK(test::rel_error(two_levels, flat) <= 1e-5);
      }
}

TEST_CASE("the scratch between the levels is kept (Note [Scratch kept between collectives]): a block given back serves the next request it covers (the smallest that does), the pool keeps its largest blocks, and a block outlives its pool") {
  auto pool = std::make_unique<ScratchPool>(2);
  std::byte* big = nullptr;
  std::byte* mid = nullptr;
  {
    auto a = pool->take(std::size_t{3} << 20), b = pool->take(std::size_t{1} << 20), c = pool->take(1000);
    big = a.get();
    mid = b.get();
    CHECK(a.get() != b.get());
    a.get()[(std::size_t{3} << 20) - 1] = std::byte{7};
  }  // all three back; the smallest (1000 bytes) is dropped, two are kept
  auto again = pool->take(std::size_t{1} << 20);
  CHECK(again.get() == mid);  // the smallest block that covers it, not the largest
  auto next = pool->take(std::size_t{2} << 20);
  CHECK(next.get() == big);
  CHECK(next.get()[(std::size_t{3} << 20) - 1] == std::byte{7});  // reused as it was left: callers zero what they read
  auto fresh = pool->take(100);  // nothing free covers it now
  CHECK(fresh.get() != big);
  CHECK(fresh.get() != mid);
  pool.reset();
  next.get()[0] = std::byte{1};  // still mapped: it is freed when its last owner lets go
}
