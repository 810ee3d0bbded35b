// `shardflow plan` and memory at the ZeRO formula: the plan a model gets on paper is the plan the
// runtime builds (buckets, owners, bytes), its memory figures are what the runtime allocates, and
// stage 2 never holds more than stage 1, nor stage 1 more than stage 0.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "support/helpers.hpp"
#include "runtime/plans/param_list.hpp"
#include "runtime/plans/run_plan.hpp"
#include "runtime/plans/sync_fusion.hpp"
#include "shardflow/shm.hpp"

using namespace shardflow;
using namespace std::chrono_literals;

namespace {

// nn.Linear layers, as the example MLP names them.
std::vector<ParamSpec> mlp(const std::vector<std::int64_t>& sizes) {
  std::vector<ParamSpec> ps;
  for (std::size_t i = 0; i + 1 < sizes.size(); ++i) {
    ps.push_back({"layers." + std::to_string(i) + ".weight", {sizes[i + 1], sizes[i]}});
    ps.push_back({"layers." + std::to_string(i) + ".bias", {sizes[i + 1]}});
  }
  return ps;
}

struct Model {
  const char* name;
  std::vector<ParamSpec> params;
  std::size_t first_cap, cap;
  std::size_t last_cap = BucketConfig{}.last_cap_bytes;
};

// 25 parameters of uneven sizes that each close their own bucket.
std::vector<ParamSpec> uneven(int n) {
  std::vector<ParamSpec> ps;
  for (int i = 0; i < n; ++i) ps.push_back({"p" + std::to_string(i), {std::int64_t(40 + 37 * (i % 7)), 3}});
  return ps;
}

// 2, 4 and 25 buckets at stages 0 and 1.
std::vector<Model> models() {
  // The last cap at each model's scale, as the first (Note [A small last bucket]).
  return {{"3-bucket", mlp({64, 96, 96, 10}), 16 << 10, 64 << 10, 16 << 10},
          {"5-bucket", mlp({32, 64, 64, 64, 64, 8}), 8 << 10, 16 << 10, 8 << 10},
          {"25-bucket", uneven(25), 64, 64, 64}};
}

struct Measured {
  std::vector<BucketInfo> buckets;
  std::vector<std::vector<OwnedPiece>> owned;  // per rank
  std::vector<MemoryReport> memory;            // per rank, after training
};

// World n as threads: every rank registers the model, configures Adam and trains 3 iterations,
// reporting gradients in reverse registration order (as backward does).
Measured run(const Model& m, int n, int stage, Partition partition, int redundancy = 1) {
  auto world = InProcessWorld::create(n, 60s);
  const auto snaps = std::filesystem::temp_directory_path() / ("sf_plan_twins_" + std::to_string(::getpid()));
  Measured out;
  out.owned.resize(std::size_t(n));
  out.memory.resize(std::size_t(n));
  test::require_all_ok(test::run_ranks(n, [&](int r) {
    Config cfg;
    cfg.buckets.first_cap_bytes = m.first_cap;
    cfg.buckets.cap_bytes = m.cap;
    cfg.buckets.last_cap_bytes = m.last_cap;
    cfg.zero.stage = ZeroStage(stage);
    cfg.zero.partition = partition;
    cfg.zero.overlap = Overlap::interleaved;
    cfg.zero.redundancy = redundancy;  // Note [Mirrored shards]: twins need a snapshot directory to fall back to
    if (redundancy == 2) cfg.snapshot.dir = snaps.string(), cfg.snapshot.every = 1000;
    Runtime rt(world->communicator(r), cfg);
    std::vector<std::vector<float>> storage;
    std::vector<Param> h;
    for (const auto& p : m.params) {
      storage.emplace_back(std::size_t(numel(p.shape)), 0.25f);
      auto spec = p;
      spec.data = storage.back().data();
      h.push_back(rt.register_param(spec));
    }
    OptimizerConfig adam;
    adam.kind = OptimizerConfig::Kind::adam;
    adam.lr = 1e-3f;
    rt.configure_optimizer(adam);
    if (redundancy == 2) rt.resumed_step();
    for (int it = 0; it < 3; ++it) {
      rt.zero_grad();
      for (std::size_t i = h.size(); i-- > 0;) {
        std::fill_n(rt.grad_f32(h[i]), numel(m.params[i].shape), float(r + 1) * 0.01f);
        rt.grad_ready(h[i]);
      }
      rt.wait();
    }
    rt.wait_all_params();
    out.owned[std::size_t(r)] = rt.owned();
    out.memory[std::size_t(r)] = rt.memory_report();
    if (r == 0) out.buckets = rt.buckets();
  }));
  std::filesystem::remove_all(snaps);
  return out;
}

RunPlan plan_of(const Model& m, int n, int stage, Partition partition, int redundancy = 1) {
  PlanSettings s;
  s.redundancy = redundancy;
  s.world = n;
  s.stage = ZeroStage(stage);
  s.partition = partition;
  s.first_cap_bytes = m.first_cap;
  s.cap_bytes = m.cap;
  s.last_cap_bytes = m.last_cap;
  s.state_slots = 2;  // Adam
  return make_run_plan(m.params, s);
}

std::vector<OwnedPiece> owned_in_plan(const RunPlan& p, int r) {
  std::vector<OwnedPiece> out;
  for (const auto& bs : p.shards[std::size_t(r)].buckets)
    for (const auto& piece : bs.pieces[std::size_t(r)])
      out.push_back({p.params[piece.param].name, piece.param_off, piece.param_off + piece.len});
  return out;
}

std::size_t total(const MemoryReport& m) { return m.params + m.grads + m.optimizer_state + m.comm_buffers; }

// `shardflow plan ARGS`: its exit status, and what it printed (both streams) in `out`.
int run_cli(const std::string& args, std::string& out) {
  const std::string cmd = std::string(SHARDFLOW_LAUNCHER_PATH) + " plan " + args + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  REQUIRE(p);
  char buf[4096];
  out.clear();
  while (std::size_t got = std::fread(buf, 1, sizeof buf, p)) out.append(buf, got);
  return WEXITSTATUS(::pclose(p));
}

}  // namespace

TEST_CASE("the test models have 3, 5 and 25 buckets at stage 1") {
  std::vector<std::size_t> got;
  for (const auto& m : models()) got.push_back(plan_of(m, 2, 1, Partition::flat).buckets.buckets.size());
  CHECK(got == std::vector<std::size_t>{3, 5, 25});
}

TEST_CASE("plan = what the runtime builds: buckets, owners and memory, every model x world 2-4 x stage x partition") {
  for (const auto& m : models())
    for (int n : {2, 3, 4})
      for (int stage : {0, 1, 2})
        for (auto partition : {Partition::flat, Partition::param, Partition::bucket}) {
          if (stage == 0 && partition != Partition::flat) continue;  // nothing is partitioned (refused)
          INFO(std::string(m.name) << ", world " << n << ", stage " << stage << ", " << partition_name(partition));
          const RunPlan plan = plan_of(m, n, stage, partition);
          const Measured got = run(m, n, stage, partition);
          REQUIRE(got.buckets.size() == plan.buckets.buckets.size());
          for (std::size_t b = 0; b < got.buckets.size(); ++b) {
            CHECK(got.buckets[b].bytes == plan.buckets.buckets[b].bytes());
            std::vector<std::string> names;
            for (const auto& e : plan.buckets.buckets[b].entries) names.push_back(plan.params[e.param].name);
            CHECK(got.buckets[b].params == names);
          }
          for (int r = 0; r < n; ++r) {
            INFO("rank " << r);
            CHECK(got.owned[std::size_t(r)] == owned_in_plan(plan, r));
            const auto& want = plan.memory[std::size_t(r)];
            const auto& have = got.memory[std::size_t(r)];
            CHECK(have.params == want.params);
            CHECK(have.optimizer_state == want.optimizer_state);
            CHECK(have.comm_buffers == want.comm_buffers);
            if (plan.caps.pooled) {
              // Stage 2, pooled: the shard exactly, the buckets in flight at most the plan's bound.
              std::size_t shard = 0;
              for (std::size_t b = 0; b < plan.buckets.buckets.size(); ++b)
                shard += plan.shards[std::size_t(r)].buckets[b].packed[std::size_t(r)] * 4;
              CHECK(have.grads > shard);
              CHECK(have.grads <= want.grads);
            } else {
              CHECK(have.grads == want.grads);
            }
          }
        }
}

TEST_CASE("twins (redundancy 2) in the plan = what the runtime keeps: every rank's optimizer state with its twin and the owner's copy, "
          "world 2-4 x stage 1-2, and `shardflow plan --redundancy 2` says what crosses the hosts: at world 2 the shift in place of the "
          "all-gather (ZeRO's own bytes), at world 4 on 2 hosts a slice a rank more over the flat ring, ZeRO's own over two levels") {
  const auto m = models().front();
  for (int n : {2, 3, 4})
    for (int stage : {1, 2}) {
      INFO("world " << n << ", stage " << stage);
      const RunPlan plan = plan_of(m, n, stage, Partition::flat, 2), alone = plan_of(m, n, stage, Partition::flat);
      const Measured got = run(m, n, stage, Partition::flat, 2);
      CHECK(plan.twin_distance == 1);
      CHECK(!plan.syncs_from_twin);  // one host: the all-gather stays (Note [Syncs from the twin])
      for (int r = 0; r < n; ++r) {
        INFO("rank " << r);
        CHECK(got.memory[std::size_t(r)].optimizer_state == plan.memory[std::size_t(r)].optimizer_state);
        CHECK(got.memory[std::size_t(r)].comm_buffers == plan.memory[std::size_t(r)].comm_buffers);
        CHECK(plan.memory[std::size_t(r)].optimizer_state > alone.memory[std::size_t(r)].optimizer_state);
      }
    }
  const auto dir = std::filesystem::temp_directory_path() / ("sf_plan_twins_cli_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "m.json") << R"([{"name": "w", "shape": [64, 32]}, {"name": "b", "shape": [64]}])";
  const std::string model = "--params " + (dir / "m.json").string();
  const std::size_t B = (64 * 32 + 64) * 4;
  std::string out;
  auto network = [&](const std::string& args) {
    REQUIRE(run_cli(model + args + " --json", out) == 0);
    return nlohmann::json::parse(out);
  };
  // World 2 on 2 hosts: reduce-scatter + shift, the bytes of reduce-scatter + all-gather.
  const auto two = network(" --world-size 2 --zero-stage 1 --hosts 2 --redundancy 2");
  CHECK(two["twins"]["syncs_from_twin"] == true);
  CHECK(two["twins"]["shift_bytes_per_rank_per_step"] == B / 2);
  CHECK(two["network"]["buckets"][0]["collectives"][1]["kind"] == "shift");
  CHECK(two["network"]["buckets"][0]["collectives"].size() == 2);
  CHECK(two["network"]["bytes_per_step"] == network(" --world-size 2 --zero-stage 1 --hosts 2")["network"]["bytes_per_step"]);
  REQUIRE(run_cli(model + " --world-size 2 --zero-stage 1 --hosts 2 --redundancy 2", out) == 0);
  CHECK(out.find("in place of the parameters' all-gather") != std::string::npos);
  // World 4 on 2 hosts, the twin a host away (the default distance): over the flat ring every
  // rank's slice crosses beside ZeRO's bytes; over two levels (the default) the twin gives the
  // all-gather's stage between the hosts, so the bytes there are ZeRO's own.
  const auto four = network(" --world-size 4 --zero-stage 1 --hosts 2 --redundancy 2 --backend gloo");
  CHECK(four["twins"]["distance"] == 2);
  CHECK(four["twins"]["syncs_from_twin"] == false);
  CHECK(four["network"]["bytes_per_step"] ==
        network(" --world-size 4 --zero-stage 1 --hosts 2 --backend gloo")["network"]["bytes_per_step"].get<std::size_t>() + B);
  const auto levels = network(" --world-size 4 --zero-stage 1 --hosts 2 --redundancy 2");
  CHECK(levels["twins"]["distance"] == 2);
  CHECK(levels["twins"]["syncs_from_twin"] == true);
  CHECK(levels["network"]["bytes_per_step"] == network(" --world-size 4 --zero-stage 1 --hosts 2")["network"]["bytes_per_step"]);
  REQUIRE(run_cli(model + " --world-size 4 --zero-stage 1 --hosts 2 --redundancy 2", out) == 0);
  CHECK(out.find("in place of the all-gather's stage between the hosts") != std::string::npos);
  // What the runtime refuses, refused by name.
  CHECK(run_cli(model + " --world-size 2 --zero-stage 0 --redundancy 2", out) == 2);
  CHECK(out.find("--redundancy 2 needs") != std::string::npos);
  CHECK(run_cli(model + " --world-size 2 --zero-stage 1 --redundancy 2 --twin-distance 2", out) == 2);
  CHECK(out.find("--twin-distance 2") != std::string::npos);
  CHECK(run_cli(model + " --world-size 2 --zero-stage 1 --redundancy 3", out) == 2);
  CHECK(out.find("--redundancy must be 1 or 2") != std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST_CASE("stage 2 <= stage 1 <= stage 0 in gradient and total memory, on every model x world 2-4 x partition") {
  for (const auto& m : models())
    for (int n : {2, 3, 4})
      for (auto partition : {Partition::flat, Partition::param, Partition::bucket}) {
        INFO(std::string(m.name) << ", world " << n << ", " << partition_name(partition));
        // The flat partition pads each bucket to world equal slices of whole cache lines (16
        // floats), which stage 0 does not: stage 1 may hold that much more.
        std::size_t padding = 0;
        const RunPlan stage1 = plan_of(m, n, 1, partition);
        for (const auto& bs : stage1.shards[0].buckets) padding += bs.padded * 4;
        for (const auto& p : m.params) padding -= std::size_t(numel(p.shape)) * 4;
        std::array<std::size_t, 3> grads{}, all{};
        for (int stage : {0, 1, 2}) {
          const Measured got = run(m, n, stage, stage == 0 ? Partition::flat : partition);  // stage 0 shards nothing
          for (const auto& mem : got.memory) {
            grads[std::size_t(stage)] = std::max(grads[std::size_t(stage)], mem.grads);
            all[std::size_t(stage)] = std::max(all[std::size_t(stage)], total(mem));
          }
        }
        CHECK(grads[2] <= grads[1]);
        CHECK(grads[1] <= grads[0] + padding);
        if (partition != Partition::flat) CHECK(padding == 0);
        CHECK(all[2] <= all[1]);
        // Small buckets' syncs fuse through a buffer of their own (Note [Fused syncs]): on these
        // small models it can cost what sharding Adam's state saves at world 2; nothing else may.
        std::size_t fusion = 0;
        for (const auto& shard : stage1.shards)
          fusion = std::max(fusion, fusion_buffer_bytes(shard, std::vector<DType>(shard.buckets.size(), DType::f32),
                                                        ZeroConfig{}.fuse_syncs_bytes));
        CHECK(all[1] < all[0] + fusion);
      }
}

TEST_CASE("stage 2's buckets in flight stay within what sharding the gradients saves") {
  // 12 x Linear(128, 128) at world 2: caps shrink so that the pool's buffers (the gradient buckets in
  // flight, one overrun, 2 staging) fit in half the gradients; the plan says so and the runtime
  // measures no more.
  const Model m{"12 x 128", mlp({128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128}), 1 << 20, 25 << 20};
  const RunPlan plan = plan_of(m, 2, 2, Partition::flat);
  REQUIRE(plan.caps.pooled);
  std::size_t grads = 0;
  for (const auto& p : m.params) grads += std::size_t(numel(p.shape)) * 4;
  CHECK(plan.caps.budget == grads / 2);
  CHECK(plan.caps.grads_in_flight >= kStage2GradsInFlight);
  for (const auto& bs : plan.shards[0].buckets) CHECK(bs.padded * 4 * pool_buffers(plan.caps.grads_in_flight) <= plan.caps.budget);
  const Measured got = run(m, 2, 2, Partition::flat);
  for (const auto& mem : got.memory) CHECK(mem.grads <= grads);
}

TEST_CASE("stage 2 keeps as many gradient buckets in flight as its budget holds, and no more") {
  // 16 layers of 64 Ki floats, one bucket each, world 2: the budget (half the gradients, 2 MiB)
  // holds 8 buckets of 0.25 MiB: 3 go to the overrun and staging buffers, 5 may be in flight.
  std::vector<ParamSpec> layers;
  for (int l = 0; l < 16; ++l) layers.push_back({"layers." + std::to_string(l) + ".weight", {65536}});
  const Model m{"16 x 64 Ki", layers, 65536 * 4, 65536 * 4};
  const RunPlan plan = plan_of(m, 2, 2, Partition::flat);
  REQUIRE(plan.caps.pooled);
  CHECK(plan.caps.grads_in_flight == 5);
  CHECK(plan.caps.staging_in_flight == kStagingInFlight);
  CHECK(pool_buffers(plan.caps.grads_in_flight) * 65536 * 4 <= plan.caps.budget);
  // The user's own limit stands.
  auto s = PlanSettings{};
  s.world = 2;
  s.stage = ZeroStage::gradients;
  s.first_cap_bytes = s.cap_bytes = 65536 * 4;
  s.max_buckets_in_flight = 3;
  s.state_slots = 2;
  std::vector<std::uint32_t> order(16);
  for (std::uint32_t i = 0; i < 16; ++i) order[i] = 15 - i;
  CHECK(bucket_caps(layers, order, s).grads_in_flight == 3);
  // A world of 4 saves three quarters: still no more buckets in flight than there are buckets.
  CHECK(plan_of(m, 4, 2, Partition::flat).caps.grads_in_flight <= 16);
}

TEST_CASE("stage 2's budget beyond the least pool goes a quarter to staging buffers and the rest to gradient buffers: 100 buckets of 10 KiB at world 2 get 13 syncs in flight and 36 gradient buckets, within the budget") {
  // Note [Staging in flight]: the budget (half of 1000 KiB of gradients) holds 50 buckets; the
  // least pool is 5 (2 gradient buffers, the overrun, 2 staging), so 45 are spare: 11 more staging.
  std::vector<ParamSpec> layers;
  for (int l = 0; l < 100; ++l) layers.push_back({"layers." + std::to_string(l) + ".weight", {2560}});
  const Model m{"100 x 10 KiB", layers, 10240, 10240, 10240};
  const RunPlan plan = plan_of(m, 2, 2, Partition::flat);
  REQUIRE(plan.caps.pooled);
  CHECK(plan.caps.budget == 100 * 10240 / 2);
  CHECK(plan.caps.staging_in_flight == 13);
  CHECK(plan.caps.grads_in_flight == 36);
  CHECK(pool_buffers(plan.caps.grads_in_flight, plan.caps.staging_in_flight) * 10240 <= plan.caps.budget);
  // What `shardflow plan` shows of it: the counts, and the refill a held-back backward waits for
  // (Note [Backpressure in refills]: a quarter of 36).
  CHECK(plan.describe().find("stage 2's pool: 36 gradient bucket(s) and 13 sync(s) in flight within 0.49 MiB, refilled 9 at a time") !=
        std::string::npos);
  const auto pool = nlohmann::json::parse(plan.to_json())["pool"];
  CHECK(pool["grads_in_flight"] == 36);
  CHECK(pool["staging_in_flight"] == 13);
  CHECK(pool["refill"] == 9);
  CHECK(pool["budget"] == 100 * 10240 / 2);
  // The plan's memory counts the staging buffers, and the runtime holds no more.
  const Measured got = run(m, 2, 2, Partition::flat);
  CHECK(got.memory[0].grads <= plan.memory[0].grads);
}

TEST_CASE("a parameter too large for stage 2's budget: whole buckets reduce-scattered in place, no more than stage 1") {
  const Model m{"one big layer", mlp({256, 512, 4}), 1 << 20, 25 << 20};
  const RunPlan plan = plan_of(m, 2, 2, Partition::flat);
  CHECK_FALSE(plan.caps.pooled);
  CHECK(plan.caps.warning.find("layers.0.weight") != std::string::npos);
  const Measured s2 = run(m, 2, 2, Partition::flat), s1 = run(m, 2, 1, Partition::flat);
  CHECK(s2.memory[0].grads == s1.memory[0].grads);
}

TEST_CASE("a bucket cap the user sets is used as given: 8 x Linear(1024, 1024) at 25 MiB without a small last bucket gets PyTorch's 2 buckets, left out the small-model default gets 5, and the plan names the rule behind each cap") {
  const Model set{"8 x Linear(1024, 1024), 25 MiB set", mlp({1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024}), 1 << 20, 25 << 20, 0};
  Model unset = set;
  unset.cap = 0;
  const RunPlan as_set = plan_of(set, 1, 0, Partition::flat), by_default = plan_of(unset, 1, 0, Partition::flat);
  CHECK(as_set.buckets.buckets.size() == 2);
  CHECK(as_set.caps.cap == std::size_t(25) << 20);
  CHECK(as_set.caps.cap_rule == "as set");
  CHECK(by_default.buckets.buckets.size() == 5);
  CHECK(by_default.caps.cap_rule.find("min_buckets 4") != std::string::npos);
  CHECK(by_default.describe().find("then 8.01 MiB, min_buckets 4: 32.03 MiB trainable / 4, below the default 25.00 MiB") != std::string::npos);
  // min_buckets set beside a set cap: both hold, as the user asked.
  PlanSettings s;
  s.world = 1;
  s.last_cap_bytes = 0;
  s.cap_bytes = std::size_t(25) << 20;
  s.min_buckets = 4;
  CHECK(make_run_plan(set.params, s).buckets.buckets.size() == 5);
  s.cap_bytes = 0;
  s.min_buckets = 0;  // the default cap, never shrunk: PyTorch's behaviour
  CHECK(make_run_plan(set.params, s).buckets.buckets.size() == 2);
  // The runtime builds what the plan says, in both cases.
  CHECK(run(set, 1, 0, Partition::flat).buckets.size() == 2);
  CHECK(run(unset, 1, 0, Partition::flat).buckets.size() == 5);
}

TEST_CASE("left to the default cap, ZeRO stages 1 and 2 over 2 ranks cut a small model into 16 buckets' worth where DDP and a world of 1 cut it into 4, the runtime builds what the plan says, and a min_buckets set is used as given") {
  std::vector<std::int64_t> widths(33, 512);  // 32 x Linear(512, 512): 32 MiB, a layer 1 MiB
  const Model m{"32 x Linear(512, 512), the default cap", mlp(widths), 1 << 20, 0, 0};
  const RunPlan ddp = plan_of(m, 2, 0, Partition::flat), zero1 = plan_of(m, 2, 1, Partition::flat), zero2 = plan_of(m, 2, 2, Partition::flat),
                alone = plan_of(m, 1, 1, Partition::flat);
  CHECK(ddp.caps.cap_rule.find("min_buckets 4:") != std::string::npos);
  CHECK(alone.caps.cap_rule.find("min_buckets 4:") != std::string::npos);
  CHECK(zero1.caps.cap_rule.find("min_buckets 16:") != std::string::npos);
  CHECK(zero2.caps.cap_rule.find("min_buckets 16:") != std::string::npos);
  CHECK(ddp.buckets.buckets.size() == alone.buckets.buckets.size());
  CHECK(ddp.buckets.buckets.size() <= 6);
  CHECK(zero1.buckets.buckets.size() >= 16);
  CHECK(zero2.buckets.buckets.size() >= 16);
  CHECK(run(m, 2, 1, Partition::flat).buckets.size() == zero1.buckets.buckets.size());
  PlanSettings s;
  s.world = 2;
  s.stage = ZeroStage::optimizer_state;
  s.last_cap_bytes = 0;
  s.min_buckets = 4;
  CHECK(make_run_plan(m.params, s).buckets.buckets.size() == ddp.buckets.buckets.size());
}

TEST_CASE("a small last bucket: the layers forward needs first get a bucket of their own, in the plan and in the runtime — 0 gives PyTorch's layout") {
  // 8 x Linear(1024, 1024) at 25 MiB, walked in reverse registration order (weight after bias):
  // from the walk's end, layers.0.weight (4 MiB) passes the 1 MiB last cap alone, so it leaves the
  // 25 MiB bucket before it (Note [A small last bucket]). After a rebuild the walk is the ready
  // order, where a Linear's bias comes after its weight and joins it.
  const Model m{"8 x Linear(1024, 1024), 25 MiB", mlp({1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024}), 1 << 20, 25 << 20};
  const RunPlan p = plan_of(m, 2, 1, Partition::flat);
  REQUIRE(p.buckets.buckets.size() == 3);
  const auto& last = p.buckets.buckets.back();
  std::vector<std::string> names;
  for (const auto& e : last.entries) names.push_back(p.params[e.param].name);
  CHECK(names == std::vector<std::string>{"layers.0.weight"});
  CHECK(p.caps.last == std::size_t(1) << 20);
  CHECK(p.caps.last_rule == "the default");
  CHECK(p.describe().find("last 1.00 MiB, the default") != std::string::npos);
  CHECK(run(m, 2, 1, Partition::flat).buckets.size() == 3);  // the runtime builds what the plan says
  // A cap under the last cap bounds it too; a last cap as large as the model: no bucket of its own.
  Model small = m;
  small.cap = 512 << 10;
  CHECK(plan_of(small, 1, 0, Partition::flat).caps.last == std::size_t(512) << 10);
  CHECK(plan_of(small, 1, 0, Partition::flat).caps.last_rule == "the cap below it");
  Model whole = m;
  whole.cap = whole.last_cap = std::size_t(64) << 20;
  CHECK(plan_of(whole, 1, 0, Partition::flat).buckets.buckets.size() == 2);
  Model off = m;
  off.last_cap = 0;
  CHECK(plan_of(off, 1, 0, Partition::flat).buckets.buckets.size() == 2);
  CHECK(plan_of(off, 1, 0, Partition::flat).caps.last_rule == "none");
}

TEST_CASE("bucket rules: each dtype's first bucket gets the first cap — buckets ordered by their first parameter walked") {
  // Registration: f32 a, bf16 b, f32 c, bf16 d, ... walked in reverse.
  std::vector<ParamSpec> ps;
  for (int i = 0; i < 8; ++i) ps.push_back({"p" + std::to_string(i), {256}, i % 2 ? DType::bf16 : DType::f32});
  PlanSettings s;
  s.world = 2;
  s.first_cap_bytes = 512;
  s.cap_bytes = 2048;
  const auto plan = make_run_plan(ps, s);
  // Walk: p7(bf16) p6(f32) p5(bf16) ...: the first bucket of each dtype closes at 512 bytes.
  REQUIRE(plan.buckets.buckets.size() >= 4);
  CHECK(plan.params[plan.buckets.buckets[0].entries[0].param].name == "p7");
  CHECK(plan.buckets.buckets[0].bytes() == 512);  // one bf16 parameter of 256 elements
  CHECK(plan.params[plan.buckets.buckets[1].entries[0].param].name == "p6");
  CHECK(plan.buckets.buckets[1].bytes() == 1024);  // one f32 parameter passes the first cap
  // Every later bucket starts later in the walk than the one before it.
  std::vector<std::size_t> first_walk;
  for (const auto& b : plan.buckets.buckets) first_walk.push_back(ps.size() - 1 - b.entries[0].param);
  CHECK(std::is_sorted(first_walk.begin(), first_walk.end()));
}

TEST_CASE("the param partition balances elements, not bytes: largest first, ties to the lowest rank") {
  // A bf16 parameter of 300 elements (600 bytes) and f32 ones of 200 and 100 elements.
  std::vector<ParamSpec> ps{{"a", {200}}, {"b", {300}, DType::bf16}, {"c", {100}}};
  PlanSettings s;
  s.world = 2;
  s.stage = ZeroStage::optimizer_state;
  s.partition = Partition::param;
  const auto plan = make_run_plan(ps, s);
  auto owner_of = [&](const std::string& name) {
    for (int r = 0; r < 2; ++r)
      for (const auto& o : owned_in_plan(plan, r))
        if (o.param == name) return r;
    return -1;
  };
  CHECK(owner_of("b") == 0);  // 300 elements: the largest, to rank 0
  CHECK(owner_of("a") == 1);  // 200: the least-loaded rank
  CHECK(owner_of("c") == 1);  // 100: rank 1 has 200 < 300
}

TEST_CASE("parameter lists: JSON in registration order, a safetensors header in its own order, bad input named") {
  const auto dir = std::filesystem::temp_directory_path() / ("sf_plan_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir / name, std::ios::binary) << text;
    return (dir / name).string();
  };
  const auto good = read_param_list(write("m.json", R"([{"name": "w", "shape": [4, 3], "dtype": "bfloat16"},
                                                        {"name": "b", "shape": [4]}])"));
  REQUIRE(good.size() == 2);
  CHECK(good[0].name == "w");
  CHECK(good[0].dtype == DType::bf16);
  CHECK(numel(good[0].shape) == 12);
  CHECK(good[1].dtype == DType::f32);

  // safetensors: header keys in the file's order (z before a), not sorted; the data is not read.
  const std::string header = R"({"z.weight": {"dtype": "F16", "shape": [2, 2], "data_offsets": [0, 8]},)"
                             R"( "__metadata__": {"format": "pt"}, "a.bias": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})";
  std::string st(8, '\0');
  for (int i = 0; i < 8; ++i) st[std::size_t(i)] = char((header.size() >> (8 * i)) & 0xff);
  const auto tensors = read_param_list(write("m.safetensors", st + header));
  REQUIRE(tensors.size() == 2);
  CHECK(tensors[0].name == "z.weight");
  CHECK(tensors[0].dtype == DType::f16);
  CHECK(tensors[1].name == "a.bias");

  auto refused = [&](const std::string& text, const std::string& says) {
    INFO(text);
    try {
      read_param_list(write("bad.json", text));
      FAIL("accepted");
    } catch (const UsageError& e) {
      CHECK(std::string(e.what()).find(says) != std::string::npos);
    }
  };
  refused("[{\"name\": \"w\", \"shape\": [4]", "not valid JSON");
  refused(R"([{"name": "w", "shape": [4], "dtype": "float8"}])", "unknown dtype 'float8'");
  refused(R"([{"name": "w", "shape": [-4]}])", "parameter 0");
  refused(R"([{"shape": [4]}])", "no \"name\"");
  refused(R"([{"name": "w", "shape": [4]}, {"name": "w", "shape": [4]}])", "appears twice");
  refused("[]", "no parameters");
  CHECK_THROWS_WITH_AS(read_param_list((dir / "missing.json").string()), doctest::Contains("cannot open"), UsageError);
  std::filesystem::remove_all(dir);
}

TEST_CASE("shardflow plan: the JSON form, the bytes between hosts (--hosts), and clear errors for a missing file, zero world, a negative cap or hosts that do not divide the world") {
  const auto dir = std::filesystem::temp_directory_path() / ("sf_plan_cli_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "m.json") << R"([{"name": "w", "shape": [64, 32]}, {"name": "b", "shape": [64]}])";
  std::string out;
  const std::string model = "--params " + (dir / "m.json").string();
  REQUIRE(run_cli(model + " --world-size 2 --zero-stage 2 --json", out) == 0);
  const auto j = nlohmann::json::parse(out);
  REQUIRE(j["buckets"].size() == 1);
  CHECK(j["buckets"][0]["params"] == nlohmann::json({"b", "w"}));
  CHECK(j["buckets"][0]["bytes"] == (64 * 32 + 64) * 4);
  REQUIRE(j["ranks"].size() == 2);
  CHECK(j["ranks"][1]["rank"] == 1);
  CHECK(j["ranks"][0]["params"][0] == "b");                // rank 0's slice starts with the whole bias
  CHECK(j["ranks"][0]["params"][1]["name"] == "w");        // then a range of the weight
  CHECK(j["ranks"][0]["bytes"]["params"] == (64 * 32 + 64) * 4);
  CHECK(run_cli(model + " --world-size 2", out) == 0);
  CHECK(out.find("memory per rank") != std::string::npos);

  CHECK(run_cli("--params " + (dir / "nope.json").string() + " --world-size 2", out) == 2);
  CHECK(out.find("nope.json") != std::string::npos);
  CHECK(run_cli(model + " --world-size 0", out) == 2);
  CHECK(out.find("--world-size") != std::string::npos);
  CHECK(run_cli(model + " --world-size 2 --bucket-cap-mb -1", out) != 0);
  CHECK(out.find("--bucket-cap-mb") != std::string::npos);
  CHECK(run_cli(model + " --world-size 2 --min-buckets -1", out) != 0);
  CHECK(out.find("--min-buckets") != std::string::npos);
  CHECK(run_cli(model + " --world-size 2 --optimizer lamb", out) == 2);
  CHECK(out.find("lamb") != std::string::npos);

  // Several hosts: what crosses the network, two levels (auto) against the flat ring.
  const std::size_t B = (64 * 32 + 64) * 4;
  REQUIRE(run_cli(model + " --world-size 4 --zero-stage 1 --hosts 2 --json", out) == 0);
  const auto n = nlohmann::json::parse(out)["network"];
  CHECK(n["two_levels"] == true);
  CHECK(n["buckets"][0]["collectives"][0]["kind"] == "reduce_scatter");
  CHECK(n["bytes_per_step"] == 2 * B);             // reduce-scatter and all-gather, (H-1) B each
  CHECK(n["flat_ring_bytes_per_step"] == 3 * B);   // 2 x H (W-1)/W B
  CHECK(n["scratch_per_collective_in_flight"] == B / 2);  // 1/L of the bucket between the levels
  CHECK(n["second_shm_segment_per_rank"] == ShmOptions{}.staging_bytes);
  REQUIRE(run_cli(model + " --world-size 4 --hosts 2 --backend gloo", out) == 0);
  CHECK(out.find("the flat Gloo ring") != std::string::npos);
  REQUIRE(run_cli(model + " --world-size 4 --hosts 2", out) == 0);
  CHECK(out.find("0.67x the flat ring's") != std::string::npos);
  CHECK(run_cli(model + " --world-size 4 --hosts 3", out) == 2);
  CHECK(out.find("--hosts 3 must divide --world-size 4") != std::string::npos);
  CHECK(run_cli(model + " --world-size 4 --hosts 2 --backend tcp", out) == 2);
  CHECK(out.find("'tcp'") != std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST_CASE("shardflow plan --timings: the shortest iteration any schedule could reach, in words and in JSON — a timing file that does not fit is named") {
  const auto dir = std::filesystem::temp_directory_path() / ("sf_plan_timings_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  // Two layers of 64 x 64: 16 KiB each, one bucket each at a 16 KiB cap.
  std::ofstream(dir / "m.json") << R"([{"name": "w0", "shape": [64, 64]}, {"name": "w1", "shape": [64, 64]}])";
  // 16 KiB at 0.016384 GB/s: 1 ms per whole bucket, 0.5 ms for half of it (world 2), no latency.
  std::ofstream(dir / "t.json") << R"({"link": {"gbytes_per_s": 0.016384, "latency_us": 0}, "step_ms_per_mib": 0,
                                       "params": {"w0": {"forward_ms": 1, "backward_ms": 1}, "w1": {"forward_ms": 1, "backward_ms": 1}}})";
  std::ofstream(dir / "bad.json") << R"({"link": {"gbytes_per_s": 1}, "params": {"w9": {"forward_ms": 1}}})";
  const std::string model = "--params " + (dir / "m.json").string() + " --world-size 2 --zero-stage 1 --bucket-cap-mb 0.015625 --first-bucket-cap-mb 0.015625";
  std::string out;
  REQUIRE(run_cli(model + " --timings " + (dir / "t.json").string() + " --json", out) == 0);
  const auto j = nlohmann::json::parse(out);
  REQUIRE(j["buckets"].size() == 2);
  // Backward: w1's gradient at 1 ms, w0's at 2 ms; reduce-scatter and all-gather 0.5 ms each.
  // Best: R(w1) [1, 1.5], S(w1) [1.5, 2], R(w0) [2, 2.5], S(w0) [2.5, 3]; forward w0 [3, 4], w1 [4, 5].
  CHECK(j["bound"]["compute_ms"].get<double>() == doctest::Approx(4.0));
  CHECK(j["bound"]["link_ms"].get<double>() == doctest::Approx(2.0));
  CHECK(j["bound"]["iteration_ms"].get<double>() == doctest::Approx(5.0));
  REQUIRE(run_cli(model + " --timings " + (dir / "t.json").string(), out) == 0);
  CHECK(out.find("iteration bound: 5.000 ms (set by the link and the dependencies)") != std::string::npos);
  CHECK(run_cli(model + " --timings " + (dir / "bad.json").string(), out) == 2);
  CHECK(out.find("parameter 'w9'") != std::string::npos);
  CHECK(run_cli(model + " --timings " + (dir / "none.json").string(), out) == 2);
  CHECK(out.find("none.json' cannot be read") != std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST_CASE("peak resident memory of a whole run agrees: stage 2 <= stage 1 <= stage 0, within 1.25x of the formula plus the data, and "
          "keeping the trainer's freed memory costs at most a fifth more") {
  // mlp_train with 8 x Linear(1024, 1024) and AdamW (Psi = 8.4 M: 134 MB of model state per rank at
  // stage 0), 3 steps: the first rebuilds the buckets, so its state migration is in the peak. Each
  // run is a process of its own, as the OS counts peak RSS per process. The formula is held
  // against runs that leave freed memory to malloc: kept for reuse (the default, Note [Keeping
  // the trainer's freed memory]), blocks the first step freed stay resident beside later ones
  // (measured 2026-12-04: +10 % at world 1, +14 % at world 2, stage 1), bounded below.
  if (test::kSanitized) {
    // A sanitizer's shadow memory and quarantine are in every resident byte count: nothing to compare.
    MESSAGE("skipped under a sanitizer: resident memory includes its shadow memory");
    return;
  }
  const double psi = 8.0 * (1024 * 1024 + 1024), data = 4096.0 * (1024 + 1024) * 4;
  auto peak_mb = [](int world, int stage, bool keep_freed = false) {
    std::string cmd = std::string("env SHARDFLOW_KEEP_FREED_MEMORY=") + (keep_freed ? "1 " : "0 ") + MLP_TRAIN_PATH + " --sizes 1024,1024,1024,1024,1024,1024,1024,1024,1024 --optimizer adamw --steps 3" +
                      " --world-size " + std::to_string(world) + " --zero-stage " + std::to_string(stage) + " 2>&1";
    FILE* p = ::popen(cmd.c_str(), "r");
    REQUIRE(p);
    std::string out;
    char buf[4096];
    while (std::size_t got = std::fread(buf, 1, sizeof buf, p)) out.append(buf, got);
    REQUIRE(WEXITSTATUS(::pclose(p)) == 0);
    const std::string key = "peak resident memory of this process: ";
    const auto at = out.find(key);
    REQUIRE(at != std::string::npos);
    return std::stod(out.substr(at + key.size()));
  };
  const double w1 = peak_mb(1, 0);
  std::array<double, 3> w2{};
  for (int stage : {0, 1, 2}) w2[std::size_t(stage)] = peak_mb(2, stage);
  INFO("peak RSS MB: world 1 " << w1 << "; world 2 stages 0/1/2: " << w2[0] << " / " << w2[1] << " / " << w2[2]);
  CHECK(w1 <= 1.25 * (16 * psi + data) / 1e6);
  CHECK(w2[0] <= 1.25 * (2 * 16 * psi + data) / 1e6);
  CHECK(w2[1] <= 1.25 * (2 * 12 * psi + data) / 1e6);
  // Stage 2 keeps whole buckets here (a 4 MiB weight is larger than its in-flight budget allows
  // per bucket, Note [Memory at the ZeRO formula]): the same as stage 1, never more.
  CHECK(w2[2] <= w2[1] * 1.02);
  CHECK(w2[1] < w2[0]);
  const double w1_kept = peak_mb(1, 0, true), w2_kept = peak_mb(2, 1, true);
  INFO("with freed memory kept: world 1 " << w1_kept << ", world 2 stage 1 " << w2_kept);
  CHECK(w1_kept <= 1.2 * w1);
  CHECK(w2_kept <= 1.2 * w2[1]);
}

TEST_CASE("stage 2 on a model with many buckets: the pool holds two default buckets, not all that sharding saves") {
  // 32 layers of 4096 x 1024 (16 MiB each), world 4: sharding saves 384 MiB of gradients. The pool
  // (buckets in flight, overrun, staging) gets the larger of two 25 MiB buckets and one 16 MiB
  // parameter per slot (80 MiB), so stage 2 holds its 128 MiB shard plus 80 MiB, where sizing the
  // pool by the savings let it fill them: stage 1's 512 MiB.
  std::vector<ParamSpec> layers;
  for (int l = 0; l < 32; ++l) layers.push_back({"layers." + std::to_string(l) + ".weight", {4096, 1024}});
  const Model m{"32 x 16 MiB", layers, 1 << 20, 25 << 20};
  const RunPlan s2 = plan_of(m, 4, 2, Partition::flat), s1 = plan_of(m, 4, 1, Partition::flat);
  REQUIRE(s2.caps.pooled);
  const std::size_t per_param = std::size_t(4096) * 1024 * 4, total = 32 * per_param;
  CHECK(s2.caps.budget <= pool_buffers(kStage2GradsInFlight) * (per_param + 4 * 64));
  CHECK(s2.caps.budget >= 2 * (std::size_t(25) << 20));
  for (const auto& mem : s2.memory) {
    CHECK(mem.grads <= total / 4 + s2.caps.budget);
    CHECK(mem.grads < s1.memory[0].grads / 2);
  }
}
