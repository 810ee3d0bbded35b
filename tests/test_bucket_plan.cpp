// Bucket plans: caps and the small first bucket, dtype and device separation, collective order,
// and the one-time rebuild from the gradient order rank 0 observed.
#include <doctest/doctest.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "support/helpers.hpp"
#include "runtime/plans/bucket_plan.hpp"

using namespace shardflow;
using namespace std::chrono_literals;

namespace {

std::vector<ParamSpec> specs(const std::vector<std::int64_t>& numels, DType t = DType::f32) {
  std::vector<ParamSpec> out;
  for (std::size_t i = 0; i < numels.size(); ++i) out.push_back({"p" + std::to_string(i), {numels[i]}, t});
  return out;
}

std::vector<std::vector<std::uint32_t>> members(const BucketPlan& plan) {
  std::vector<std::vector<std::uint32_t>> out;
  for (const auto& b : plan.buckets) {
    out.emplace_back();
    for (const auto& e : b.entries) out.back().push_back(e.param);
  }
  return out;
}

}  // namespace

TEST_CASE("reverse registration order — a bucket closes once it reaches its cap — the first cap is smaller") {
  // Ten parameters of 400 KiB; first cap 1 MiB (3 fill it), then 2 MiB (6 fill it).
  auto p = specs(std::vector<std::int64_t>(10, 400 * 256));
  auto plan = make_bucket_plan(p, reverse_registration_order(10), 1 << 20, 2 << 20);
  CHECK(members(plan) == std::vector<std::vector<std::uint32_t>>{{9, 8, 7}, {6, 5, 4, 3, 2, 1}, {0}});
  CHECK(plan.buckets[0].bytes() == 3 * 400 * 1024);
  // Offsets are contiguous in walk order, and where[] finds every parameter.
  CHECK(plan.buckets[1].entries[2].offset == 2 * 400 * 256);
  for (std::uint32_t i = 0; i < 10; ++i) {
    const auto loc = plan.where[i];
    CHECK(plan.buckets[loc.bucket].entries[loc.entry].param == i);
  }
}

TEST_CASE("a parameter exactly at the cap closes its bucket on its own — an oversized one closes the bucket it joins") {
  auto p = specs({10, 256 * 1024, 4 * 1024 * 1024, 5});
  auto plan = make_bucket_plan(p, reverse_registration_order(4), 1 << 20, 8 << 20);
  // Walk: p3 (20 B), p2 (16 MiB) -> first bucket passes 1 MiB and closes; p1 (1 MiB) and p0 in the next.
  CHECK(members(plan) == std::vector<std::vector<std::uint32_t>>{{3, 2}, {1, 0}});
  auto q = specs({256 * 1024, 7});
  auto plan2 = make_bucket_plan(q, {0, 1}, 1 << 20, 1 << 20);
  CHECK(members(plan2) == std::vector<std::vector<std::uint32_t>>{{0}, {1}});
}

TEST_CASE("parameters of different dtype or device never share a bucket") {
  std::vector<ParamSpec> p;
  for (int i = 0; i < 8; ++i)
    p.push_back({"p" + std::to_string(i), {1000}, i % 2 ? DType::bf16 : DType::f32,
                 i % 4 == 3 ? Device::cuda(1) : Device::cpu()});
  auto plan = make_bucket_plan(p, reverse_registration_order(8), 1 << 20, 1 << 20);
  std::size_t total = 0;
  for (const auto& b : plan.buckets) {
    for (const auto& e : b.entries) {
      CHECK(p[e.param].dtype == b.dtype);
      CHECK(p[e.param].device == b.device);
    }
    total += b.entries.size();
  }
  CHECK(total == 8);
  CHECK(plan.buckets.size() == 3);  // fp32 cpu, bf16 cpu, bf16 cuda:1
  // Numbered by the walk position of their first gradient: p7 (bf16, cuda:1) comes first.
  CHECK(plan.buckets[0].entries[0].param == 7);
  CHECK(plan.buckets[1].entries[0].param == 6);
  CHECK(plan.buckets[2].entries[0].param == 5);
}

TEST_CASE("an order that is not a permutation is refused") {
  auto p = specs({1, 2, 3});
  CHECK_THROWS_AS(make_bucket_plan(p, {0, 1}, 1 << 20, 1 << 20), UsageError);
  CHECK_THROWS_AS(make_bucket_plan(p, {0, 1, 1}, 1 << 20, 1 << 20), UsageError);
  CHECK_THROWS_AS(make_bucket_plan(p, {0, 1, 7}, 1 << 20, 1 << 20), UsageError);
}

namespace {

// World 2, 12 parameters of 1 KiB, caps of 3 KiB: each rank reports its gradients in its own
// shuffled order. Returns the bucket membership before and after the first iteration, per rank.
struct RebuildRun {
  std::vector<std::vector<std::vector<std::string>>> before, after;  // [rank][bucket][param]
  std::vector<std::vector<float>> grads_after;                        // [rank] first param's grad
  std::vector<std::vector<std::uint32_t>> order;                      // [rank] report order
};

RebuildRun run_rebuild(bool rebuild) {
  const int n = 2, P = 12, numel = 256;
  RebuildRun out;
  out.before.resize(n);
  out.after.resize(n);
  out.grads_after.resize(n);
  out.order.resize(n);
  auto world = InProcessWorld::create(n, 30s);
  std::vector<std::vector<float>> data(n, std::vector<float>(P * numel, 0.0f));
  test::require_all_ok(test::run_ranks(n, [&](int r) {
    Config cfg;
    cfg.buckets.first_cap_bytes = 3 * 1024;
    cfg.buckets.cap_bytes = 3 * 1024;
    cfg.buckets.rebuild = rebuild;
    Runtime rt(world->communicator(r), cfg);
    std::vector<Param> h;
    for (int i = 0; i < P; ++i)
      h.push_back(rt.register_param({"w" + std::to_string(i), {numel}, DType::f32, Device::cpu(),
                                     data[std::size_t(r)].data() + i * numel}));
    auto names = [&] {
      std::vector<std::vector<std::string>> b;
      for (auto& info : rt.buckets()) b.push_back(info.params);
      return b;
    };
    out.before[std::size_t(r)] = names();
    std::vector<std::uint32_t> order(P);
    std::iota(order.begin(), order.end(), 0u);
    std::shuffle(order.begin(), order.end(), std::mt19937(1234 + r));
    out.order[std::size_t(r)] = order;
    for (auto i : order) {
      float* g = rt.grad_f32(h[i]);
      for (int k = 0; k < numel; ++k) g[k] = float(i * 10 + r);
      rt.grad_ready(h[i]);
    }
    rt.wait();
    out.after[std::size_t(r)] = names();
    const float* g0 = rt.grad_f32(h[0]);
    out.grads_after[std::size_t(r)].assign(g0, g0 + numel);
  }));
  return out;
}

}  // namespace

TEST_CASE("after the first iteration the buckets are rebuilt from rank 0's ready order, on every rank") {
  auto run = run_rebuild(true);
  // Before: reverse registration order, 3 per bucket.
  CHECK(run.before[0][0] == std::vector<std::string>{"w11", "w10", "w9"});
  // After: rank 0's shuffled order, on both ranks (rank 1 reported in another order).
  REQUIRE(run.order[0] != run.order[1]);
  std::vector<std::string> flat;
  for (auto& b : run.after[0])
    for (auto& name : b) flat.push_back(name);
  std::vector<std::string> want;
  for (auto i : run.order[0]) want.push_back("w" + std::to_string(i));
  CHECK(flat == want);
  CHECK(run.after[0] == run.after[1]);
  CHECK(run.after[0].size() == 4);
  // The reduced gradients moved with their parameter into the new buckets: the average over ranks.
  for (int r = 0; r < 2; ++r)
    for (float v : run.grads_after[std::size_t(r)]) REQUIRE(v == 0.5f);
}

TEST_CASE("rebuild off keeps the registration-order plan") {
  auto run = run_rebuild(false);
  CHECK(run.after[0] == run.before[0]);
  CHECK(run.after[1] == run.before[1]);
}
