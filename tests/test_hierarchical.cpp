// Two-level collectives (shardflow/hierarchical.hpp, Note [Two-level collectives]): hosts of
// several ranks, shared memory inside a host and the network between hosts, played here by
// in-process worlds: one per host and one per local index.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <thread>
#include <vector>

#include "examples/mlp/train.hpp"
#include "shardflow/hierarchical.hpp"
#include "tests/collective_op.hpp"

using namespace shardflow;
using namespace std::chrono_literals;

namespace {

// hosts x local ranks as threads; f(comm, rank) on each.
template <class F>
void on_hosts(int hosts, int local, F f) {
  std::vector<std::shared_ptr<InProcessWorld>> inside, between;
  for (int h = 0; h < hosts; ++h) inside.push_back(InProcessWorld::create(local, 20s));
  for (int l = 0; l < local; ++l) between.push_back(InProcessWorld::create(hosts, 20s));
  std::vector<std::thread> threads;
  for (int h = 0; h < hosts; ++h)
    for (int l = 0; l < local; ++l)
      threads.emplace_back([&, h, l] {
        auto comm = make_hierarchical(inside[std::size_t(h)]->communicator(l), between[std::size_t(l)]->communicator(h));
        f(*comm, h * local + l);
      });
  for (auto& t : threads) t.join();
}

using test::make;

}  // namespace

TEST_CASE("2x2, 3x2 and 2x3 hosts x ranks: every collective gives what the flat world gives (exact sums of small integers)") {
  for (auto [hosts, local] : {std::pair{2, 2}, std::pair{3, 2}, std::pair{2, 3}}) {
    CAPTURE(hosts);
    CAPTURE(local);
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
    });
    for (int r = 0; r < W; ++r) CHECK(bad[std::size_t(r)] == 0);
  }
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
    mlp::TrainOptions opt;
    opt.sizes = {24, 40, 40, 6};
    opt.steps = 6;
    opt.global_batch = 12;
    opt.world_size = 4;
    opt.optimizer.kind = OptimizerConfig::Kind::adamw;
    opt.optimizer.lr = 0.01f;
    opt.runtime.zero.stage = ZeroStage(stage);
    opt.runtime.zero.overlap = m.overlap;
    opt.runtime.zero.forward_prefetch = m.prefetch;
    opt.runtime.buckets.first_cap_bytes = opt.runtime.buckets.cap_bytes = 4096;
    opt.runtime.timeouts.collective = 20s;
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
