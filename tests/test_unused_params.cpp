// Unused parameters as PyTorch treats them (Note [Unused parameters]): a parameter no rank used is
// left alone (no weight decay, no momentum, its own step count paused), one that some ranks used
// is reduced as zeros on the others and stepped as usual.
#include <doctest/doctest.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <set>
#include <unistd.h>
#include <vector>

#include "support/helpers.hpp"
#include "support/per_param_optimizer.hpp"
#include "runtime/checkpoint/safetensors_stream.hpp"

using namespace shardflow;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

constexpr int kWorld = 2;
const std::vector<std::int64_t> kSizes = {40, 10, 10};  // w, head1, head2
const std::vector<std::string> kNames = {"w", "head1", "head2"};

// Who reports a gradient for parameter p in iteration it on rank r.
using Uses = std::function<bool(int r, int it, std::size_t p)>;

float grad_at(int r, int it, std::size_t p, std::int64_t e) { return 0.01f * float((r * 5 + it * 3 + int(p) * 7 + int(e)) % 11) - 0.04f; }
float init_at(std::size_t p, std::int64_t e) { return 0.1f * float(p + 1) + 0.003f * float(e); }

OptimizerConfig adamw() { return test::adamw(0.05f, 0.1f); }

// The reference, by hand: each parameter some rank used is stepped on the average over all ranks
// (zeros where a rank did not use it) with its own step count; the others are not touched.
std::vector<std::vector<float>> reference(int iterations, const Uses& uses, const OptimizerConfig& oc) {
  std::vector<std::vector<float>> init(kSizes.size());
  for (std::size_t p = 0; p < kSizes.size(); ++p)
    for (std::int64_t e = 0; e < kSizes[p]; ++e) init[p].push_back(init_at(p, e));
  test::PerParamOptimizer ref(oc, init);
  for (int it = 0; it < iterations; ++it)
    for (std::size_t p = 0; p < kSizes.size(); ++p) {
      bool any = false;
      std::vector<float> g(std::size_t(kSizes[p]), 0.0f);
      for (std::int64_t e = 0; e < kSizes[p]; ++e) {
        float sum = 0.0f;
        for (int r = 0; r < kWorld; ++r) sum += uses(r, it, p) ? grad_at(r, it, p, e) : 0.0f;
        g[std::size_t(e)] = sum * (1.0f / float(kWorld));
      }
      for (int r = 0; r < kWorld; ++r) any |= uses(r, it, p);
      if (any) ref.step(p, g);
    }
  return ref.params();
}

struct Trained {
  std::vector<std::vector<std::vector<float>>> params;       // per rank, per parameter
  std::vector<std::vector<std::set<std::string>>> unused;  // per rank, per iteration
};

// kWorld ranks as threads, the runtime's optimizer at `stage` (partition `partition`), find_unused
// on; `iterations` iterations after `before(rt)` (a load, say) and then `after(rt)` (a save).
Trained train(int stage, Partition partition, int iterations, const Uses& uses, const OptimizerConfig& oc, int first_iteration = 0,
              const std::function<void(Runtime&)>& before = {}, const std::function<void(Runtime&)>& after = {}, int world = kWorld) {
  auto w = InProcessWorld::create(world, 30s);
  Config cfg;
  cfg.buckets.find_unused_parameters = true;
  cfg.buckets.first_cap_bytes = cfg.buckets.cap_bytes = 40;  // one bucket per parameter
  cfg.zero.stage = ZeroStage(stage);
  cfg.zero.partition = partition;
  cfg.zero.overlap = Overlap::interleaved;
  Trained out;
  out.params.resize(std::size_t(world));
  out.unused.resize(std::size_t(world));
  test::require_all_ok(test::run_ranks(world, [&](int r) {
    std::vector<std::vector<float>> data(kSizes.size());
    Runtime rt(w->communicator(r), cfg);
    std::vector<Param> h;
    for (std::size_t p = 0; p < kSizes.size(); ++p) {
      for (std::int64_t e = 0; e < kSizes[p]; ++e) data[p].push_back(init_at(p, e));
      h.push_back(rt.register_param({kNames[p], {kSizes[p]}, DType::f32, Device::cpu(), data[p].data()}));
    }
    rt.configure_optimizer(oc);
    if (before) before(rt);
    for (int it = first_iteration; it < first_iteration + iterations; ++it) {
      rt.zero_grad();
      for (std::size_t p = kSizes.size(); p-- > 0;) {
        // At world 1 (a resumed run) the one rank stands for every rank of the original world.
        bool any = false;
        for (int q = 0; q < kWorld; ++q) any |= uses(q, it, p);
        if (world == 1 ? !any : !uses(r, it, p)) continue;
        float* g = rt.grad_f32(h[p]);
        for (std::int64_t e = 0; e < kSizes[p]; ++e) {
          if (world == 1) {
            float sum = 0.0f;
            for (int q = 0; q < kWorld; ++q) sum += uses(q, it, p) ? grad_at(q, it, p, e) : 0.0f;
            g[e] = sum * (1.0f / float(kWorld));
          } else {
            g[e] = grad_at(r, it, p, e);
          }
        }
        rt.grad_ready(h[p]);
      }
      rt.wait();
      std::set<std::string> none;
      for (const auto& p : rt.unused_parameters()) none.insert(kNames[p.index]);
      out.unused[std::size_t(r)].push_back(none);
    }
    rt.wait_all_params();
    if (after) after(rt);
    out.params[std::size_t(r)] = data;
  }));
  return out;
}

// head2 sits out iterations 0-2 everywhere; head1 is used by rank 1 only in iterations 1 and 3.
const Uses kUses = [](int r, int it, std::size_t p) {
  if (p == 2) return it >= 3;
  if (p == 1) return r == 1 && (it == 1 || it == 3);
  return true;
};

}  // namespace

TEST_CASE("a parameter no rank used is not stepped (AdamW with weight decay leaves it bit for bit), and comes back with its own step count — one some ranks used is averaged with zeros: stages 0-2, every partition") {
  const auto want = reference(5, kUses, adamw());
  for (int stage : {0, 1, 2})
    for (auto partition : {Partition::param, Partition::bucket, Partition::flat}) {
      if (stage == 0 && partition != Partition::flat) continue;  // nothing is partitioned (refused)
      CAPTURE(stage);
      CAPTURE(partition_name(partition));
      const auto got = train(stage, partition, 5, kUses, adamw());
      for (int r = 0; r < kWorld; ++r)
        for (std::size_t p = 0; p < kSizes.size(); ++p) {
          CAPTURE(r);
          CAPTURE(kNames[p]);
          CHECK(got.params[std::size_t(r)][p] == want[p]);
        }
      CHECK(got.unused[0][0] == std::set<std::string>{"head1", "head2"});
      CHECK(got.unused[1][1] == std::set<std::string>{"head2"});
      CHECK(got.unused[0][3].empty());
    }
  // The case the check guards: head2 got no update at all while nobody used it.
  const auto three = reference(3, kUses, adamw());
  for (std::int64_t e = 0; e < kSizes[2]; ++e) CHECK(three[2][std::size_t(e)] == init_at(2, e));
}

TEST_CASE("SGD with momentum: a parameter nobody used keeps its momentum buffer still, as torch.optim does with a grad of None") {
  OptimizerConfig sgd;
  sgd.kind = OptimizerConfig::Kind::sgd;
  sgd.lr = 0.1f;
  sgd.momentum = 0.9f;
  sgd.weight_decay = 0.01f;
  const auto want = reference(5, kUses, sgd);
  const auto got = train(1, Partition::flat, 5, kUses, sgd);
  for (std::size_t p = 0; p < kSizes.size(); ++p) CHECK(got.params[0][p] == want[p]);
}

TEST_CASE("each parameter's own step count survives a checkpoint: saved at world 2 after 3 iterations, resumed at world 1, as if never interrupted") {
  const auto dir = fs::temp_directory_path() / ("sf_unused_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const auto file = (dir / "c.safetensors").string();
  train(2, Partition::flat, 3, kUses, adamw(), 0, {}, [&](Runtime& rt) { rt.save_checkpoint(file); });
  const auto meta = read_safetensors_index(file).metadata;
  CHECK(meta.at("shardflow.skipped_steps") == R"({"head1":2,"head2":3})");
  const auto resumed = train(0, Partition::flat, 2, kUses, adamw(), 3, [&](Runtime& rt) { rt.load_checkpoint(file); }, {}, 1);
  const auto want = reference(5, kUses, adamw());
  for (std::size_t p = 0; p < kSizes.size(); ++p) {
    CAPTURE(kNames[p]);
    CHECK(resumed.params[0][p] == want[p]);
  }
  fs::remove_all(dir);
}

TEST_CASE("unused_parameters() without find_unused_parameters is an error that says what to set") {
  auto w = InProcessWorld::create(1, 5s);
  Runtime rt(w->communicator(0));
  float x[4] = {};
  rt.register_param({"x", {4}, DType::f32, Device::cpu(), x});
  CHECK_THROWS_WITH_AS(rt.unused_parameters(), doctest::Contains("find_unused_parameters = true"), UsageError);
}
