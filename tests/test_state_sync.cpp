// Rank 0's state everywhere (Note [Rank 0's state everywhere]): parameters and buffers broadcast
// from rank 0 when registration ends, and the buffers once each synchronised iteration, as
// PyTorch's DDP does at construction and with broadcast_buffers.
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <vector>

#include "support/helpers.hpp"

using namespace shardflow;
using namespace std::chrono_literals;

namespace {

constexpr int kParams = 3;
constexpr std::int64_t kNumel = 50;
constexpr std::size_t kBuffer = 8;  // floats of "bn.running_mean"

// What each rank held at the end of registration and at the end of training, and its buffer after
// each iteration next to the value its own forward computed before the broadcast.
struct Ranks {
  std::vector<std::vector<float>> after_finalize, params, buffer_after_finalize;
  std::vector<std::vector<std::string>> start_up;  // each rank's collectives up to its first iteration
  std::vector<std::uint64_t> resumed;              // each rank's resumed_step(), with Config::snapshot.dir
  std::vector<std::vector<std::vector<float>>> buffer_each_iteration, own_buffer_each_iteration;
};

// `world` ranks as threads whose models were initialised apart (each rank its own values). Each
// iteration "forward" updates the buffer from the rank's own batch (a running mean), backward
// writes a gradient that depends on the parameters (so ranks that drifted apart stay apart),
// then the step: the runtime's SGD at `stage` >= 1, the trainer's own after wait() at stage 0.
Ranks train_apart(int world, Config cfg, int iterations, bool runtime_optimizer) {
  auto w = InProcessWorld::create(world, 30s);
  cfg.buckets.first_cap_bytes = cfg.buckets.cap_bytes = kNumel * 4;  // one bucket per parameter
  Ranks out;
  out.after_finalize.resize(std::size_t(world));
  out.params.resize(std::size_t(world));
  out.buffer_after_finalize.resize(std::size_t(world));
  out.buffer_each_iteration.resize(std::size_t(world));
  out.own_buffer_each_iteration.resize(std::size_t(world));
  out.start_up.resize(std::size_t(world));
  out.resumed.resize(std::size_t(world));
  test::require_all_ok(test::run_ranks(world, [&](int r) {
    const auto R = std::size_t(r);
    std::vector<float> flat(kParams * kNumel), buffer(kBuffer);
    for (std::size_t i = 0; i < flat.size(); ++i) flat[i] = 0.01f * float((i * 7 + R * 13) % 29) + 0.1f * float(r);
    for (std::size_t i = 0; i < kBuffer; ++i) buffer[i] = float(r + 1) * 10.0f + float(i);
    Runtime rt(w->communicator(r), cfg);
    const auto h = test::register_flat(rt, flat.data(), kParams, kNumel);
    rt.register_buffer({"bn.running_mean", buffer.data(), kBuffer * sizeof(float), Device::cpu()});
    if (runtime_optimizer) {
      OptimizerConfig oc;
      oc.kind = OptimizerConfig::Kind::sgd;
      oc.lr = 0.1f;
      rt.configure_optimizer(oc);
    }
    rt.finalize();
    if (!cfg.snapshot.dir.empty()) out.resumed[R] = rt.resumed_step();
    out.start_up[R] = rt.collective_log();
    out.after_finalize[R] = flat;
    out.buffer_after_finalize[R] = buffer;
    for (int it = 0; it < iterations; ++it) {
      for (const auto& p : h) rt.wait_param(p);  // forward prefetch: the update is in
      for (std::size_t i = 0; i < kBuffer; ++i) buffer[i] = 0.9f * buffer[i] + 0.1f * float((r + 1) * (it + 2) + int(i));
      out.own_buffer_each_iteration[R].push_back(buffer);
      rt.zero_grad();
      for (int k = kParams; k-- > 0;) {
        float* g = rt.grad_f32(h[std::size_t(k)]);
        for (std::int64_t e = 0; e < kNumel; ++e) g[e] = flat[std::size_t(k * kNumel + e)] - 0.05f * float(e % 5);
        rt.grad_ready(h[std::size_t(k)]);
      }
      rt.wait();
      out.buffer_each_iteration[R].push_back(buffer);
      if (!runtime_optimizer)
        for (int k = 0; k < kParams; ++k) {
          const float* g = rt.grad_f32(h[std::size_t(k)]);
          for (std::int64_t e = 0; e < kNumel; ++e) flat[std::size_t(k * kNumel + e)] -= 0.1f * g[e];
        }
    }
    rt.wait_all_params();
    out.params[R] = flat;
  }));
  return out;
}

Config at_stage(int stage, bool prefetch = false) {
  Config cfg;
  cfg.zero.stage = ZeroStage(stage);
  cfg.zero.overlap = Overlap::interleaved;
  cfg.zero.forward_prefetch = prefetch;
  return cfg;
}

}  // namespace

TEST_CASE("world 3, every rank initialised apart: after registration every parameter and buffer is rank 0's, and training keeps one model (stages 0, 1, 2)") {
  for (int stage : {0, 1, 2}) {
    CAPTURE(stage);
    const auto run = train_apart(3, stage == 0 ? Config{} : at_stage(stage), 4, stage > 0);
    for (std::size_t r = 1; r < 3; ++r) {
      CAPTURE(r);
      CHECK(run.after_finalize[r] == run.after_finalize[0]);
      CHECK(run.buffer_after_finalize[r] == run.buffer_after_finalize[0]);
      CHECK(run.params[r] == run.params[0]);
    }
    CHECK(run.buffer_after_finalize[0][0] == 10.0f);  // rank 0's own value, not another rank's
  }
}

TEST_CASE("with snapshots the broadcast waits for resumed_step(): a fresh start gets rank 0's parameters, buffer and fp32 masters there "
          "(ends bit for bit where a run without snapshots ends), and a resumed one takes the snapshot's parameters without broadcasting them") {
  const auto dir = (std::filesystem::temp_directory_path() / ("shardflow_state_sync_" + std::to_string(::getpid()))).string();
  std::filesystem::remove_all(dir);
  // bf16 on the wire: the owners step fp32 masters (Note [Master weights]), made at
  // configure_optimizer from each rank's own parameters, so they must be made again after the sync.
  Config plain = at_stage(1);
  plain.precision.comm_dtype = DType::bf16;
  Config snapshots = plain;
  snapshots.snapshot.dir = dir;
  snapshots.snapshot.every = 2;
  const auto want = train_apart(3, plain, 4, true);
  const auto fresh = train_apart(3, snapshots, 4, true);
  CHECK(fresh.resumed == std::vector<std::uint64_t>(3, 0));
  const auto broadcasts = [](const std::vector<std::string>& log) {
    return std::count_if(log.begin(), log.end(), [](const std::string& c) { return c.find("initial sync: parameter") != std::string::npos; });
  };
  for (std::size_t r = 0; r < 3; ++r) {
    CAPTURE(r);
    CHECK(fresh.after_finalize[r] == want.after_finalize[0]);
    CHECK(fresh.buffer_after_finalize[r] == want.buffer_after_finalize[0]);
    CHECK(fresh.params[r] == want.params[r]);
    CHECK(broadcasts(fresh.start_up[r]) == kParams);
  }
  // Again from the newest complete snapshot, the ranks' own values apart as before: the same
  // parameters on every rank (the snapshot's, not rank 0's start), and only the buffer broadcast.
  const auto resumed = train_apart(3, snapshots, 0, true);
  CHECK(resumed.resumed[0] >= 2);
  for (std::size_t r = 0; r < 3; ++r) {
    CAPTURE(r);
    CHECK(resumed.resumed[r] == resumed.resumed[0]);
    CHECK(resumed.after_finalize[r] == resumed.after_finalize[0]);
    CHECK(resumed.after_finalize[r] != want.after_finalize[0]);
    CHECK(resumed.buffer_after_finalize[r] == want.buffer_after_finalize[0]);
    CHECK(broadcasts(resumed.start_up[r]) == 0);
    CHECK(std::count_if(resumed.start_up[r].begin(), resumed.start_up[r].end(),
                        [](const std::string& c) { return c.find("initial sync: buffer") != std::string::npos; }) == 1);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("Config::sync.initial off: the ranks keep what they built, and at stage 0 they train apart (what the default prevents)") {
  Config cfg;
  cfg.sync.initial = false;
  const auto run = train_apart(2, cfg, 3, false);
  CHECK(run.after_finalize[1] != run.after_finalize[0]);
  CHECK(run.params[1] != run.params[0]);
}

TEST_CASE("buffers: after each wait() every rank holds rank 0's running statistics, not its own — with forward prefetch too") {
  for (bool prefetch : {false, true}) {
    CAPTURE(prefetch);
    const auto run = prefetch ? train_apart(3, at_stage(1, true), 4, true) : train_apart(3, Config{}, 4, false);
    for (std::size_t it = 0; it < 4; ++it)
      for (std::size_t r = 0; r < 3; ++r) {
        CAPTURE(it);
        CAPTURE(r);
        CHECK(run.buffer_each_iteration[r][it] == run.own_buffer_each_iteration[0][it]);
        if (r > 0) CHECK(run.own_buffer_each_iteration[r][it] != run.own_buffer_each_iteration[0][it]);
      }
  }
}

TEST_CASE("Config::sync.buffers off: each rank's buffer stays its own (they only agree once, at registration)") {
  Config cfg;
  cfg.sync.buffers = false;
  const auto run = train_apart(2, cfg, 3, false);
  CHECK(run.buffer_after_finalize[1] == run.buffer_after_finalize[0]);
  for (std::size_t it = 0; it < 3; ++it) CHECK(run.buffer_each_iteration[1][it] == run.own_buffer_each_iteration[1][it]);
  CHECK(run.buffer_each_iteration[1][2] != run.buffer_each_iteration[0][2]);
}

TEST_CASE("bad buffers: an odd size, a name a parameter has, one registered on one rank only: each an error naming the buffer") {
  auto w = InProcessWorld::create(1, 5s);
  Runtime rt(w->communicator(0));
  float p[4] = {}, b[4] = {};
  rt.register_param({"w", {4}, DType::f32, Device::cpu(), p});
  CHECK_THROWS_WITH_AS(rt.register_buffer({"mask", b, 7, Device::cpu()}), doctest::Contains("buffer 'mask' is 7 bytes"), UsageError);
  CHECK_THROWS_WITH_AS(rt.register_buffer({"w", b, 16, Device::cpu()}), doctest::Contains("buffer 'w' is registered twice, or a parameter has its name"),
                       UsageError);
  rt.register_buffer({"bn.running_var", b, 16, Device::cpu()});
  CHECK_THROWS_WITH_AS(rt.register_param({"bn.running_var", {4}, DType::f32, Device::cpu(), p}), doctest::Contains("has the name of a registered buffer"),
                       UsageError);

  auto w2 = InProcessWorld::create(2, 10s);
  const auto errors = test::run_ranks(2, [&](int r) {
    float q[4] = {}, c[4] = {};
    Runtime rt2(w2->communicator(r));
    rt2.register_param({"w", {4}, DType::f32, Device::cpu(), q});
    if (r == 1) rt2.register_buffer({"bn.running_mean", c, 16, Device::cpu()});
    rt2.finalize();
  });
  for (const auto& e : errors) CHECK(test::message_of(e).find("buffer bn.running_mean") != std::string::npos);
}
