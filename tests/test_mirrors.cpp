// Mirrored shards (Note [Mirrored shards]): each rank keeps a twin of another rank's optimizer
// shard, fed by a shift of the reduced slices, one step behind it and equal to it bit for bit.
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <thread>
#include <utility>
#include <mutex>
#include <string>
#include <vector>

#include "support/helpers.hpp"
#include "shardflow/comm_hook.hpp"
#include "shardflow/gloo.hpp"
#include "shardflow/hierarchical.hpp"
#include "shardflow/store.hpp"
#include "runtime/checkpoint/piece_exchange.hpp"
#include "runtime/zero/mirror_shard.hpp"
#include "runtime/zero/shard.hpp"

using namespace shardflow;
using namespace std::chrono_literals;

namespace {

constexpr int kParams = 4;
constexpr std::int64_t kNumel = 300;

// One rank's shard at the end of one step: its state and values (the slots of Shard::export_state,
// the values last) and its twin's, in parameter coordinates.
struct Seen {
  std::vector<std::vector<float>> own, twin;
  int source = -1;
};

std::vector<std::vector<float>> own_slots(const Shard& s) {
  const std::size_t total = s.total_elements();
  std::vector<std::vector<float>> out;
  for (std::size_t k = 0; k < s.state_slots(); ++k) {
    out.emplace_back(total);
    s.export_state(k, 0, out.back());
  }
  if (s.migrate_slots() > s.state_slots()) {  // fp32 masters
    out.emplace_back(total);
    s.export_state(s.state_slots(), 0, out.back());
  } else {  // the parameters, stepped in place: this rank's pieces of them
    out.emplace_back(total, 0.0f);
    std::vector<std::size_t> base;
    std::size_t at = 0;
    for (const auto& p : s.params()) base.push_back(at), at += std::size_t(numel(p.shape));
    for (const auto& bk : s.shard_plan().buckets)
      for (const auto& piece : bk.pieces[std::size_t(s.shard_plan().rank)])
        for (std::size_t i = 0; i < piece.len; ++i)
          out.back()[base[piece.param] + piece.param_off + i] = static_cast<const float*>(s.params()[piece.param].data)[piece.param_off + i];
  }
  return out;
}

struct Run {
  std::map<std::pair<int, std::int64_t>, Seen> seen;  // (rank, steps after the step)
  std::vector<std::vector<float>> params;
  std::vector<std::vector<std::string>> log;
};

// `world` ranks as threads, AdamW with weight decay and clipping that bites, `iterations` steps.
Run train(int world, Config cfg, int iterations, int mirror_distance) {
  Run run;
  std::mutex mu;
  const auto snaps = std::filesystem::temp_directory_path() / ("shardflow_twins_steady_" + std::to_string(::getpid()));
  cfg.snapshot.dir = snaps.string();  // what recovery falls back to; none is taken in these few steps
  cfg.snapshot.every = 1000;
  cfg.zero.redundancy = mirror_distance ? 2 : 1;
  cfg.zero.twin_distance = mirror_distance;
  set_mirror_observer_for_tests([&](const Shard& s) {
    Seen seen;
    seen.own = own_slots(s);
    const auto* m = s.mirror();
    seen.source = m->source();
    for (std::size_t k = 0; k <= m->state_slots(); ++k) {
      seen.twin.emplace_back(s.total_elements());
      m->export_state(k, 0, seen.twin.back().data(), seen.twin.back().size());
    }
    std::lock_guard lock(mu);
    run.seen[{s.shard_plan().rank, s.steps()}] = std::move(seen);
  });
  auto w = InProcessWorld::create(world, 30s);
  cfg.buckets.first_cap_bytes = cfg.buckets.cap_bytes = 2 * kNumel * 4;  // two parameters a bucket
  cfg.zero.clip_grad_norm = 0.5f;
  run.params.resize(std::size_t(world));
  run.log.resize(std::size_t(world));
  const auto errors = test::run_ranks(world, [&](int r) {
    std::vector<float> flat(kParams * kNumel);
    for (std::size_t i = 0; i < flat.size(); ++i) flat[i] = 0.01f * float((i * 7) % 29) - 0.1f;
    Runtime rt(w->communicator(r), cfg);
    const auto h = test::register_flat(rt, flat.data(), kParams, kNumel);
    OptimizerConfig oc;
    oc.kind = OptimizerConfig::Kind::adamw;
    oc.lr = 0.01f;
    oc.weight_decay = 0.1f;
    rt.configure_optimizer(oc);
    rt.finalize();
    rt.resumed_step();
    for (int it = 0; it < iterations; ++it) {
      for (const auto& p : h) rt.wait_param(p);
      rt.zero_grad();
      for (int k = kParams; k-- > 0;) {
        float* g = rt.grad_f32(h[std::size_t(k)]);
        for (std::int64_t e = 0; e < kNumel; ++e)
          g[e] = flat[std::size_t(k * kNumel + e)] * float(r + 1) - 0.03f * float((e + it) % 7);
        rt.grad_ready(h[std::size_t(k)]);
      }
      rt.wait();
    }
    rt.wait_all_params();
    run.params[std::size_t(r)] = flat;
    run.log[std::size_t(r)] = rt.collective_log();
  });
  set_mirror_observer_for_tests({});
  std::filesystem::remove_all(snaps);
  test::require_all_ok(errors);
  return run;
}

// Note [Syncs from the twin]: the twins give the syncs where two ranks sit on two hosts; threads
// in one process say so through LOCAL_WORLD_SIZE, as a launcher on each host would (one rank each).
struct TwoHostsOfOneRank {
  TwoHostsOfOneRank() { ::setenv("LOCAL_WORLD_SIZE", "1", 1); }
  ~TwoHostsOfOneRank() { ::unsetenv("LOCAL_WORLD_SIZE"); }
};

Config zero(int stage, DType wire, bool prefetch = false) {
  Config cfg;
  cfg.zero.stage = ZeroStage(stage);
  cfg.zero.overlap = Overlap::interleaved;
  cfg.zero.forward_prefetch = prefetch;
  cfg.precision.comm_dtype = wire;
  return cfg;
}

}  // namespace

TEST_CASE("world 3, stages 1 and 2, fp32 and bf16 on the wire, forward prefetch or not: every rank's twin holds the shard of the rank before it as that rank had it one step earlier, bit for bit, and training ends where it ends without twins") {
  for (int stage : {1, 2})
    for (DType wire : {DType::f32, DType::bf16})
    for (bool prefetch : {false, true}) {
      CAPTURE(stage);
      CAPTURE(std::string(dtype_name(wire)));
      CAPTURE(prefetch);
      const int W = 3, steps = 5;
      const auto mirrored = train(W, zero(stage, wire, prefetch), steps, 1);
      const auto plain = train(W, zero(stage, wire, prefetch), steps, 0);
      for (int r = 0; r < W; ++r) {
        CAPTURE(r);
        CHECK(mirrored.params[std::size_t(r)] == plain.params[std::size_t(r)]);
        const auto shifts = std::count_if(mirrored.log[std::size_t(r)].begin(), mirrored.log[std::size_t(r)].end(),
                                          [](const std::string& c) { return c.find("mirror bucket") != std::string::npos; });
        CHECK(shifts == 2 * steps);  // one a bucket a step
        for (std::int64_t k = 2; k <= steps; ++k) {
          CAPTURE(k);
          const auto& twin = mirrored.seen.at({r, k});
          CHECK(twin.source == (r + W - 1) % W);
          const auto& source_before = mirrored.seen.at({twin.source, k - 1}).own;
          REQUIRE(twin.twin.size() == source_before.size());
          for (std::size_t slot = 0; slot < twin.twin.size(); ++slot) {
            CAPTURE(slot);
            CHECK(twin.twin[slot] == source_before[slot]);
          }
          CHECK(twin.twin != mirrored.seen.at({twin.source, k}).own);  // behind, not level
        }
      }
    }
}

TEST_CASE("world 2 on two hosts of one rank, stages 1 and 2, fp32 and bf16 on the wire, forward prefetch or not: the twin gives the syncs (the link carries only "
          "reductions and shifts), training ends bit for bit where it ends without twins, and the twin stays behind the source") {
  for (int stage : {1, 2})
    for (DType wire : {DType::f32, DType::bf16})
      for (bool prefetch : {false, true}) {
        CAPTURE(stage);
        CAPTURE(std::string(dtype_name(wire)));
        CAPTURE(prefetch);
        const int W = 2, steps = 5;
        const TwoHostsOfOneRank hosts;
        const auto mirrored = train(W, zero(stage, wire, prefetch), steps, 1);
        const auto plain = train(W, zero(stage, wire, prefetch), steps, 0);
        auto count = [](const std::vector<std::string>& log, const char* what) {
          return std::count_if(log.begin(), log.end(), [&](const std::string& c) { return c.find(what) != std::string::npos; });
        };
        for (int r = 0; r < W; ++r) {
          CAPTURE(r);
          CHECK(mirrored.params[std::size_t(r)] == plain.params[std::size_t(r)]);
          CHECK(count(plain.log[std::size_t(r)], "sync bucket") > 0);
          CHECK(count(plain.log[std::size_t(r)], "shift to the twin") == 0);
          // Each bucket's sync is its shift to the twin: nothing else moves the parameters.
          CHECK(count(mirrored.log[std::size_t(r)], "sync bucket") == 2 * steps);
          CHECK(count(mirrored.log[std::size_t(r)], "shift to the twin") == 2 * steps);
          CHECK(count(mirrored.log[std::size_t(r)], "mirror bucket") == 0);
          // At the end of step k a bucket's twin has taken step k - 1's slice if that bucket's
          // sync (the shift) landed before the last bucket stepped, else not yet: it stands
          // where the source stood one or two steps before, never level.
          for (std::int64_t k = 3; k <= steps; ++k) {
            CAPTURE(k);
            const auto& twin = mirrored.seen.at({r, k});
            const auto& one = mirrored.seen.at({twin.source, k - 1}).own;
            const auto& two = mirrored.seen.at({twin.source, k - 2}).own;
            REQUIRE(twin.twin.size() == one.size());
            std::size_t off = 0;
            for (std::size_t slot = 0; slot < twin.twin.size(); ++slot)
              for (std::size_t i = 0; i < twin.twin[slot].size(); ++i)
                off += twin.twin[slot][i] != one[slot][i] && twin.twin[slot][i] != two[slot][i];
            CHECK(off == 0);
          }
        }
      }
}

TEST_CASE("Config::zero.redundancy = 2 refuses by name what it cannot follow: all-reduced buckets, stage 0, no snapshot directory, "
          "a comm hook, a twin distance that comes back to the rank itself") {
  auto refusal = [](Config cfg, bool hook = false) {
    auto w = InProcessWorld::create(2, 10s);
    const auto errors = test::run_ranks(2, [&](int r) {
      std::vector<float> flat(kParams * kNumel, 0.5f);
      Runtime rt(w->communicator(r), cfg);
      test::register_flat(rt, flat.data(), kParams, kNumel);
      if (hook) rt.register_comm_hook(allreduce_hook());
      OptimizerConfig oc;
      oc.kind = OptimizerConfig::Kind::adamw;
      rt.configure_optimizer(oc);
      rt.finalize();
    });
    return test::message_of(errors[0]);
  };
  Config ok = zero(1, DType::f32);
  ok.zero.redundancy = 2;
  ok.snapshot.dir = (std::filesystem::temp_directory_path() / ("shardflow_twins_refusals_" + std::to_string(::getpid()))).string();
  ok.snapshot.every = 10;
  Config all_reduced = ok;
  all_reduced.zero.reduce_scatter = false;
  CHECK(refusal(all_reduced).find("zero.redundancy = 2 needs each bucket reduce-scattered into equal slices") != std::string::npos);
  Config ddp = ok;
  ddp.zero.stage = ZeroStage::ddp;
  CHECK(refusal(ddp).find("zero.redundancy = 2 keeps twins of ZeRO shards") != std::string::npos);
  Config no_dir = ok;
  no_dir.snapshot.dir.clear();
  no_dir.snapshot.every = 0;
  CHECK(refusal(no_dir).find("zero.redundancy = 2 heals a lost rank from memory") != std::string::npos);
  CHECK(refusal(ok, true).find("feeds each twin its source's reduce-scatter slice, which a hook's own all-reduces do not produce") != std::string::npos);
  Config back = ok;
  back.zero.twin_distance = 2;
  CHECK(refusal(back).find("zero.twin_distance = 2 at world 2 brings each rank's slices back to itself") != std::string::npos);
  Config none = zero(1, DType::f32);
  none.zero.twin_distance = 1;
  CHECK(refusal(none).find("zero.twin_distance = 1 places twins, but") != std::string::npos);
  std::filesystem::remove_all(ok.snapshot.dir);
}

// ---- Going on from the twins (Note [Going on from the twins]) -------------------------------

namespace {

constexpr int kSteps = 10;
constexpr std::size_t kA = 300, kB = 37;  // several buckets with the caps below

// trainer_state: the trainer hands its own state over at each iteration's start (Note [The
// trainer's state with the twins]).
Config recovering(const std::string& snapshots, int stage, bool trainer_state = false) {
  Config cfg;
  cfg.zero.stage = ZeroStage(stage);
  cfg.zero.overlap = Overlap::interleaved;
  cfg.buckets.first_cap_bytes = cfg.buckets.cap_bytes = 512;
  cfg.snapshot.dir = snapshots;
  cfg.snapshot.every = 2;
  cfg.timeouts.collective = std::chrono::seconds(20);
  cfg.zero.redundancy = 2;
  cfg.zero.twin_distance = 1;
  cfg.zero.clip_grad_norm = 0.05f;  // bites: a twin fed after the source's step gets its slices clipped (Note [Syncs from the twin])
  cfg.snapshot.trainer_state = trainer_state;
  return cfg;
}

// A rank's gradients depend on the parameters, the rank and the step only.
void gradients(const float* w, std::size_t n, float* g, int rank, int step) {
  for (std::size_t i = 0; i < n; ++i) g[i] = 0.1f * w[i] + 0.01f * float((i * 7 + std::size_t(rank) * 3 + std::size_t(step)) % 11) - 0.05f;
}

struct Model {
  std::vector<float> w = std::vector<float>(kA + kB);
  Model() {
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = 0.01f * float(i % 13) - 0.06f;
  }
};

struct Plan {
  int from = 0, to = kSteps;                   // steps to run (from: a checkpoint's, when `load`)
  std::string load, save_at_end;               // a checkpoint to start from / to write after `to`
  std::optional<int> lose_at;                  // this step is abandoned after parameter a is reported
  bool dies = false;                           // ... by this rank's end (its Runtime goes)
  std::shared_ptr<Communicator> next;          // the round to recover onto
  bool hands_state = true;                     // with Config::snapshot.trainer_state: hands it over
  bool scribbles = false;                      // before recover(), a's first 40 values changed where others own them, as syncs leave them
};

// What a scheduler's state would be after `step`: the trainer's state the tests hand over.
std::string schedule_after(std::uint64_t step) { return "schedule after step " + std::to_string(step); }

struct Outcome {
  std::uint64_t resumed = 0;
  std::optional<std::string> trainer_state;  // what resumed_step() or recover() gave back
  std::vector<float> after_recovery;
  std::vector<std::string> log;         // the new round's collectives
  std::vector<std::string> log_before;  // the round's abandoned
};

Outcome run_rank(int rank, std::shared_ptr<Communicator> comm, const Config& cfg, Model& m, Plan plan) {
  Outcome out;
  Runtime rt(std::move(comm), cfg);
  const Param pa = rt.register_param({"a", {std::int64_t(kA)}, DType::f32, Device::cpu(), m.w.data()});
  const Param pb = rt.register_param({"b", {std::int64_t(kB)}, DType::f32, Device::cpu(), m.w.data() + kA});
  OptimizerConfig adamw;
  adamw.kind = OptimizerConfig::Kind::adamw;
  adamw.lr = 0.01f;
  rt.configure_optimizer(adamw);
  int step = int(rt.resumed_step());
  if (step > 0) out.resumed = std::uint64_t(step), out.trainer_state = rt.trainer_state(), out.log = rt.collective_log();  // a replacement's restore
  if (!plan.load.empty()) rt.load_checkpoint(plan.load), step = plan.from;
  std::vector<bool> own(40, false);  // with plan.scribbles: which of a's first 40 values this rank's shard holds
  for (; step < plan.to; ++step) {
    try {
      if (plan.scribbles && plan.lose_at && step == *plan.lose_at)
        for (const auto& [key, t] : rt.shard_state_dict().tensors)
          if (key.rfind("optim.a.exp_avg@", 0) == 0)
            for (std::size_t i = std::stoul(key.substr(key.find('@') + 1)), e = i + t.numel(); i < std::min<std::size_t>(e, 40); ++i) own[i] = true;
      if (cfg.snapshot.trainer_state && plan.hands_state)
        if (const auto w = rt.trainer_state_wanted()) rt.set_trainer_state(w, schedule_after(w));
      rt.zero_grad();
      gradients(m.w.data(), kA, rt.grad_f32(pa), rank, step);
      rt.grad_ready(pa);
      if (plan.lose_at && step == *plan.lose_at) {
        plan.lose_at.reset();
        // Parameter a's bucket reduces and steps meanwhile on every rank: the step in flight is
        // half applied when the round is abandoned, and must be undone (Note [Going on from the twins]).
        std::this_thread::sleep_for(std::chrono::milliseconds(150));
        if (plan.dies) return out;  // the Runtime goes with the rank: the others' collectives fail
        throw CommError("rank " + std::to_string(rank) + ": the test loses a peer in step " + std::to_string(step));
      }
      gradients(m.w.data() + kA, kB, rt.grad_f32(pb), rank, step);
      rt.grad_ready(pb);
      rt.wait();
    } catch (const Error&) {
      if (!plan.next) throw;
      out.log_before = rt.collective_log();
      if (plan.scribbles)  // the pieces of a's first 40 values that other ranks own, as their syncs would have left them
        for (std::size_t i = 0; i < 40; ++i) m.w[i] += own[i] ? 0.0f : 1.0f;
      out.resumed = rt.recover(std::exchange(plan.next, nullptr));
      out.trainer_state = rt.trainer_state();
      out.after_recovery = m.w;
      out.log = rt.collective_log();
      step = int(out.resumed) - 1;
    }
  }
  rt.wait_all_params();
  if (!plan.save_at_end.empty()) rt.save_checkpoint(plan.save_at_end);
  return out;
}

std::string scratch(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / ("shardflow_twins_" + std::to_string(::getpid()) + "_" + name);
  std::filesystem::remove_all(dir);
  return dir.string();
}

// Note [Syncs from the twin, two levels]: 2 hosts x 2 ranks as threads over two levels of
// in-process worlds (inside each host, its stages after the network, each local index across the
// hosts), as test_hierarchical builds them.
// With `gloo`: each local index's lane between the hosts is a Gloo world over loopback, as in a
// job, which shifts unequal counts (Communicator::shifts_unequal).
struct TwoLevels {
  std::vector<std::shared_ptr<InProcessWorld>> inside, after, between;
  std::vector<std::vector<std::shared_ptr<Communicator>>> gloo_lanes;  // [l][h]
  explicit TwoLevels(TcpStoreServer* gloo = nullptr, const std::string& prefix = "") {
    for (int k = 0; k < 2; ++k) {
      inside.push_back(InProcessWorld::create(2, 20s));
      after.push_back(InProcessWorld::create(2, 20s));
      between.push_back(InProcessWorld::create(2, 20s));
      if (gloo) {
        GlooOptions o;
        o.key_prefix = prefix + "lane" + std::to_string(k) + "/";
        o.timeout = 20s;
        gloo_lanes.push_back(test::store_world(2, gloo->port(), o, make_gloo_communicator));
      }
    }
  }
  std::shared_ptr<Communicator> communicator(int r) const {
    const auto h = std::size_t(r / 2), l = std::size_t(r % 2);
    return make_hierarchical(inside[h]->communicator(int(l)), gloo_lanes.empty() ? between[l]->communicator(int(h)) : gloo_lanes[l][h],
                             after[h]->communicator(int(l)));
  }
};

// Runs `n` ranks as threads, rank r with plans[r]; rethrows the first failure.
std::vector<Outcome> run_world(int n, const std::function<std::shared_ptr<Communicator>(int)>& comm, const Config& cfg,
                               std::vector<Model>& models, const std::vector<Plan>& plans) {
  std::vector<Outcome> out(static_cast<std::size_t>(n));
  test::require_all_ok(test::run_ranks(n, [&](int r) { out[std::size_t(r)] = run_rank(r, comm(r), cfg, models[std::size_t(r)], plans[std::size_t(r)]); }));
  return out;
}

}  // namespace

TEST_CASE("the twin's host under every launcher: shardflow run and torchrun (LOCAL_WORLD_SIZE), srun (SLURM_TASKS_PER_NODE) and "
          "mpirun (OMPI_COMM_WORLD_LOCAL_SIZE) -> the ranks a host, so the default twin sits a host away") {
  auto per_host = [](int world, std::map<std::string, std::string> vars) {
    return ranks_per_host(world, [vars](const char* k) -> const char* {
      auto it = vars.find(k);
      return it == vars.end() ? nullptr : it->second.c_str();
    });
  };
  CHECK(per_host(4, {}) == 0);  // no launcher: not known
  CHECK(per_host(4, {{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"}}) == 2);
  CHECK(per_host(4, {{"RANK", "1"}, {"WORLD_SIZE", "4"}}) == 0);  // torchrun without it: not known, as before
  const std::map<std::string, std::string> srun{{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "1"},
                                                {"SLURM_NNODES", "2"}, {"SLURM_TASKS_PER_NODE", "2(x2)"}, {"MASTER_ADDR", "node01"}};
  CHECK(per_host(4, srun) == 2);
  CHECK(per_host(3, srun) == 0);  // after a shrink to 3 the hosts no longer divide the world evenly
  CHECK(per_host(2, {{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_NNODES", "2"}, {"SLURM_TASKS_PER_NODE", "1(x2)"}, {"MASTER_ADDR", "node01"}}) == 1);
  CHECK(per_host(4, {{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                     {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"MASTER_ADDR", "node01"}}) == 2);
  // The process's own environment decides the default distance: srun's 2 nodes x 2 tasks -> 2.
  struct Srun {
    std::optional<std::string> master = std::getenv("MASTER_ADDR") ? std::optional<std::string>(std::getenv("MASTER_ADDR")) : std::nullopt;
    Srun() {
      ::setenv("SLURM_PROCID", "1", 1);
      ::setenv("SLURM_NTASKS", "4", 1);
      ::setenv("SLURM_LOCALID", "1", 1);
      ::setenv("SLURM_NNODES", "2", 1);
      ::setenv("SLURM_TASKS_PER_NODE", "2(x2)", 1);
      ::setenv("MASTER_ADDR", "node01", 1);
    }
    ~Srun() {
      for (const char* k : {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NNODES", "SLURM_TASKS_PER_NODE", "MASTER_ADDR"}) ::unsetenv(k);
      if (master) ::setenv("MASTER_ADDR", master->c_str(), 1);
    }
  };
  Config cfg;
  CHECK(twin_distance(cfg, 4) == 1);
  {
    const Srun under_srun;
    CHECK(twin_distance(cfg, 4) == 2);
  }
}

namespace {

using Ranks = std::function<std::shared_ptr<Communicator>(int)>;  // a world's ranks' communicators

// Every one of `n` ranks abandons step 8 half reported and recovers onto a new round: the
// outcomes, and in `want` / `got` each rank's model at the end of an uninterrupted run / this one.
// `world()` makes a fresh world; `cfg(snapshots)` the ranks' Config.
std::vector<Outcome> all_recover(int n, const std::function<Ranks()>& world, const std::function<Config(const std::string&)>& cfg,
                                 std::vector<Model>& want, std::vector<Model>& got) {
  want.assign(std::size_t(n), Model{});
  got.assign(std::size_t(n), Model{});
  {
    const auto snaps = scratch("ref");
    run_world(n, world(), cfg(snaps), want, std::vector<Plan>(static_cast<std::size_t>(n)));
    std::filesystem::remove_all(snaps);
  }
  const Ranks first = world(), second = world();
  const auto snaps = scratch("rec");
  std::vector<Plan> plans(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) plans[std::size_t(r)].lose_at = 7, plans[std::size_t(r)].next = second(r);
  auto out = run_world(n, first, cfg(snaps), got, plans);
  std::filesystem::remove_all(snaps);
  return out;
}

bool logged(const std::vector<std::string>& log, const std::string& what) {
  return std::any_of(log.begin(), log.end(), [&](const std::string& c) { return c.find(what) != std::string::npos; });
}

// Every rank went on after step 7 from the twins, moving none of the moments, and ended where the
// uninterrupted run ended.
void went_on_from_twins(const std::vector<Outcome>& out, const std::vector<Model>& want, const std::vector<Model>& got) {
  for (std::size_t r = 0; r < out.size(); ++r) {
    CAPTURE(r);
    CHECK(out[r].resumed == 7);
    CHECK(got[r].w == want[r].w);
    // Every rank kept its shard and its twin (Note [Twins kept in place]): none of the moments moved.
    CHECK(logged(out[r].log, "allgather restore from memory: the spans each rank keeps of its twin"));
    CHECK_FALSE(logged(out[r].log, "twins: restore state 0"));
    CHECK_FALSE(logged(out[r].log, "twins: restore state 1"));
  }
}

}  // namespace

TEST_CASE("twins, world 3, stages 1 and 2: every rank abandons step 8 half reported and recovers onto a new round -> it goes on after step 7 "
          "(the half step discarded, no completed step rolled back, no snapshot read, where snapshots alone would give step 6), and ends bit for "
          "bit where an uninterrupted run ends") {
  for (int stage : {1, 2}) {
    CAPTURE(stage);
    std::vector<Model> want, got;
    const auto out = all_recover(
        3, [] { return Ranks([w = InProcessWorld::create(3)](int r) { return w->communicator(r); }); },
        [&](const std::string& snaps) { return recovering(snaps, stage); }, want, got);
    went_on_from_twins(out, want, got);
  }
}

TEST_CASE("twins a host away, 2 hosts x 2 ranks over two levels, stages 1 and 2: every rank abandons step 8 half reported, between its "
          "shifts to the twins and the gathers inside the hosts, and recovers onto a new round -> it goes on after step 7 from the twins, and "
          "ends bit for bit where an uninterrupted run ends") {
  for (int stage : {1, 2}) {
    CAPTURE(stage);
    std::vector<Model> want, got;
    const auto out = all_recover(
        4, [] { return Ranks([w = std::make_shared<TwoLevels>()](int r) { return w->communicator(r); }); },
        [&](const std::string& snaps) {
          auto c = recovering(snaps, stage);
          c.zero.twin_distance = 2;  // a host away: the twins give the other host's blocks
          return c;
        },
        want, got);
    went_on_from_twins(out, want, got);
    for (const auto& o : out) {  // the path under test: each sync the shift to the twin, then the gather inside the host
      CHECK(logged(o.log_before, "(the shift to the twin)"));
      CHECK(logged(o.log_before, "inside the host, after the twin's step"));
    }
  }
}

namespace {

// The reference for a world that loses its last rank in step 8: 7 steps at world `from`, a
// checkpoint, the rest at world from - 1 from it. Returns (the models after step 7, at the end).
std::pair<std::vector<Model>, std::vector<Model>> through_checkpoint(int from, int stage) {
  std::string tag = "ckpt";
  tag += std::to_string(from);
  const auto ckpt = scratch(tag) + ".safetensors";
  std::vector<Model> at7(static_cast<std::size_t>(from)), end(static_cast<std::size_t>(from - 1));
  for (const int w : {from, from - 1}) {
    auto world = InProcessWorld::create(w);
    std::vector<Plan> plans(static_cast<std::size_t>(w));
    for (auto& p : plans) {
      if (w == from)
        p.to = 7, p.save_at_end = ckpt;
      else
        p.from = 7, p.load = ckpt;
    }
    std::string ref = "ref";
    ref += std::to_string(w);
    const auto snaps = scratch(ref);
    run_world(w, [&](int r) { return world->communicator(r); }, recovering(snaps, stage), w == from ? at7 : end, plans);
    std::filesystem::remove_all(snaps);
  }
  std::filesystem::remove(ckpt);
  return {std::move(at7), std::move(end)};
}

}  // namespace

TEST_CASE("twins, world 3 -> 2, stages 1 and 2: rank 2 is lost in step 8 (its Runtime gone) -> ranks 0 and 1 go on at world 2 after step 7, "
          "rank 2's shard from its twin on rank 0: the parameters bit for bit those after step 7, and the run ends bit for bit where 7 steps "
          "at world 3, a checkpoint and the rest at world 2 end") {
  for (int stage : {1, 2}) {
    CAPTURE(stage);
    const auto [at7, want] = through_checkpoint(3, stage);
    auto first = InProcessWorld::create(3), second = InProcessWorld::create(2);
    const auto snaps = scratch("lost");
    std::vector<Plan> plans(3);
    for (auto& p : plans) p.lose_at = 7;
    plans[2].dies = true;
    plans[0].next = second->communicator(0);
    plans[1].next = second->communicator(1);
    std::vector<Model> got(3);
    const auto out = run_world(3, [&](int r) { return first->communicator(r); }, recovering(snaps, stage, true), got, plans);
    for (int r = 0; r < 2; ++r) {
      CAPTURE(r);
      CHECK(out[std::size_t(r)].resumed == 7);
      CHECK(out[std::size_t(r)].trainer_state == schedule_after(7));  // with the model, not the snapshot's (step 6)
      CHECK(out[std::size_t(r)].after_recovery == at7[0].w);
      CHECK(got[std::size_t(r)].w == want[std::size_t(r)].w);
    }
    std::filesystem::remove_all(snaps);
  }
}

TEST_CASE("twins, world 2 -> 1, stage 1: rank 1 is lost in step 8 -> rank 0 goes on alone after step 7 with rank 1's shard from the twin it "
          "kept (no twin kept from then on), the parameters bit for bit those after step 7, and the run ends bit for bit where 7 steps at "
          "world 2, a checkpoint and the rest at world 1 end") {
  const TwoHostsOfOneRank hosts;  // the twin gives the syncs before the loss (Note [Syncs from the twin])
  const auto [at7, want] = through_checkpoint(2, 1);
  auto first = InProcessWorld::create(2), alone = InProcessWorld::create(1);
  const auto snaps = scratch("alone");
  std::vector<Plan> plans(2);
  for (auto& p : plans) p.lose_at = 7;
  plans[1].dies = true;
  plans[0].next = alone->communicator(0);
  std::vector<Model> got(2);
  const auto out = run_world(2, [&](int r) { return first->communicator(r); }, recovering(snaps, 1, true), got, plans);
  CHECK(out[0].resumed == 7);
  CHECK(out[0].trainer_state == schedule_after(7));
  CHECK(out[0].after_recovery == at7[0].w);
  CHECK(got[0].w == want[0].w);
  std::filesystem::remove_all(snaps);
}

TEST_CASE("twins, world 3, stage 1: rank 2 is lost in step 8 and a fresh process takes its place in the next round -> it gets its shard "
          "and the parameters from the survivors' memory (rank 2's from its twin), nothing from disk, and all three end bit for bit where "
          "an uninterrupted run ends") {
  std::vector<Model> want(3), got(4);
  {
    auto world = InProcessWorld::create(3);
    const auto snaps = scratch("ref");
    run_world(3, [&](int r) { return world->communicator(r); }, recovering(snaps, 1), want, std::vector<Plan>(3));
    std::filesystem::remove_all(snaps);
  }
  auto first = InProcessWorld::create(3), second = InProcessWorld::create(3);
  const auto snaps = scratch("replaced");
  std::vector<Plan> plans(4);
  for (int r = 0; r < 3; ++r) plans[std::size_t(r)].lose_at = 7;
  plans[2].dies = true;
  plans[0].next = second->communicator(0);
  plans[1].next = second->communicator(1);
  // Thread 3 is the replacement: rank 2 of the second round, started once rank 2 is gone.
  std::vector<Outcome> out(4);
  test::require_all_ok(test::run_ranks(4, [&](int t) {
    if (t < 3) {
      out[std::size_t(t)] = run_rank(t, first->communicator(t), recovering(snaps, 1, true), got[std::size_t(t)], plans[std::size_t(t)]);
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    out[3] = run_rank(2, second->communicator(2), recovering(snaps, 1, true), got[3], Plan{});
  }));
  for (int r : {0, 1}) {
    CAPTURE(r);
    CHECK(out[std::size_t(r)].resumed == 7);
    CHECK(got[std::size_t(r)].w == want[std::size_t(r)].w);
  }
  CHECK(got[3].w == want[2].w);  // the replacement, as rank 2
  // The trainer's state too, from a survivor's memory: the replacement kept none.
  CHECK(out[3].resumed == 7);
  for (int t : {0, 1, 3}) {
    CAPTURE(t);
    CHECK(out[std::size_t(t)].trainer_state == schedule_after(7));
  }
  std::filesystem::remove_all(snaps);
}

TEST_CASE("twins a host away, 2 hosts x 2 ranks over two levels, stages 1 and 2, the lanes between the hosts in-process or Gloo: rank 1 "
          "is lost in step 8 and a fresh process takes its place -> the moments go by whole hosts from the twins, the replacement's values "
          "from its host-mate inside the host (Note [Pieces over two levels]), none of the moments summed, values that every survivor got "
          "wrong summed in their windows alone, over Gloo no padding between the hosts, and all four end bit for bit where an "
          "uninterrupted run ends") {
  const test::RestoreWindows windows("32");  // 11 windows a slot: the values of parameter b are never stale, so never summed
  TcpStoreServer store([] {
    StoreServerOptions o;
    o.token = "t";
    return o;
  }());
  for (const bool gloo : {false, true})
  for (int stage : {1, 2}) {
    CAPTURE(gloo);
    CAPTURE(stage);
    int round = 0;
    const auto lanes = [&] {
      return std::make_shared<TwoLevels>(gloo ? &store : nullptr, "s" + std::to_string(stage) + "r" + std::to_string(round++) + "/");
    };
    auto cfg = [&](const std::string& snaps) {
      auto c = recovering(snaps, stage);
      c.zero.twin_distance = 2;
      return c;
    };
    std::vector<Model> want(4), got(5);
    {
      const auto snaps = scratch("ref");
      run_world(4, [w = lanes()](int r) { return w->communicator(r); }, cfg(snaps), want, std::vector<Plan>(4));
      std::filesystem::remove_all(snaps);
    }
    const auto first = lanes(), second = lanes();
    const auto snaps = scratch("replaced2x2");
    std::vector<Plan> plans(5);
    for (int r = 0; r < 4; ++r) {
      plans[std::size_t(r)].lose_at = 7, plans[std::size_t(r)].next = r == 1 ? nullptr : second->communicator(r);
      plans[std::size_t(r)].scribbles = r != 1;  // then a piece's holder alone has its values right
    }
    plans[1].dies = true;
    std::vector<Outcome> out(5);
    test::require_all_ok(test::run_ranks(5, [&](int t) {
      if (t < 4) {
        out[std::size_t(t)] = run_rank(t, first->communicator(t), cfg(snaps), got[std::size_t(t)], plans[std::size_t(t)]);
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(300));  // thread 4: rank 1 of the next round
      out[4] = run_rank(1, second->communicator(1), cfg(snaps), got[4], Plan{});
    }));
    for (int t : {0, 2, 3, 4}) {
      CAPTURE(t);
      CHECK(out[std::size_t(t)].resumed == 7);
      CHECK(got[std::size_t(t)].w == want[std::size_t(t == 4 ? 1 : t)].w);
    }
    // What a rank's shifts by whole hosts sent of the moments (slots 0 and 1; 2 is the values).
    const auto moments_sent = [](const std::vector<std::string>& log) {
      std::size_t sent = 0;
      const std::string shifted = "shift twins: restore state ";
      for (const std::string& line : log)
        if (line.rfind(shifted, 0) == 0 && line.find(" by 2 ") != std::string::npos && (line[shifted.size()] == '0' || line[shifted.size()] == '1')) {
          const auto end = line.rfind(' '), begin = line.rfind(' ', end - 1);
          sent += std::stoul(line.substr(begin + 1, end - begin - 1));
        }
      return sent;
    };
    // The replacement has nothing to give its lane's other rank: over Gloo it sends nothing; over
    // a lane that shifts equal counts only, as much padding as rank 3 sends it moments.
    const std::size_t from_3 = moments_sent(out[3].log);
    if (gloo)
      CHECK(moments_sent(out[4].log) == 0);
    else
      CHECK(moments_sent(out[4].log) == from_3);
    for (int t : {0, 2, 3}) {
      CAPTURE(t);
      const auto& log = out[std::size_t(t)].log;
      // The moments a host away, on lane 1 alone: rank 3 gives rank 1 its shard and its twin's.
      // Lane 0's ranks keep their twins (Note [Twins kept in place]) and pad nothing.
      if (t == 3)
        CHECK(moments_sent(log) > 0);
      else
        CHECK(moments_sent(log) == 0);
      CHECK(logged(log, "allgather restore from memory: the spans each rank keeps of its twin"));
      CHECK(logged(log, "shift twins: restore state 2 from element 320 by 1 inside the host "));  // b's values
      CHECK(logged(log, "allreduce twins: restore state 2 from element 0 "));  // the values every survivor got wrong
      CHECK_FALSE(logged(log, "allreduce twins: restore state 2 from element 320 "));
      CHECK_FALSE(logged(log, "allreduce twins: restore state 0"));
      CHECK_FALSE(logged(log, "allreduce twins: restore state 1"));
    }
    std::filesystem::remove_all(snaps);
  }
}

TEST_CASE("twins with the trainer's state (Config::snapshot.trainer_state), world 3, stage 1: every rank abandons step 8 -> recover() gives "
          "back the state the trainer handed over after step 7 with the model after step 7, and a trainer that never hands it over -> no "
          "survivor holds it, so every rank goes back to the newest complete snapshot (step 4 or 6: the one of step 6 waited for that "
          "state, and completes without it) rather than pair the model of one step with the schedule of another") {
  constexpr int N = 3;
  for (bool hands : {true, false}) {
    CAPTURE(hands);
    std::vector<Model> want(N), got(N);
    {
      auto world = InProcessWorld::create(N);
      const auto snaps = scratch("ref");
      run_world(N, [&](int r) { return world->communicator(r); }, recovering(snaps, 1), want, std::vector<Plan>(N));
      std::filesystem::remove_all(snaps);
    }
    auto first = InProcessWorld::create(N), second = InProcessWorld::create(N);
    const auto snaps = scratch("state");
    std::vector<Plan> plans(N);
    for (int r = 0; r < N; ++r) {
      plans[std::size_t(r)].lose_at = 7, plans[std::size_t(r)].next = second->communicator(r);
      plans[std::size_t(r)].hands_state = hands;
    }
    const auto out = run_world(N, [&](int r) { return first->communicator(r); }, recovering(snaps, 1, true), got, plans);
    for (int r = 0; r < N; ++r) {
      CAPTURE(r);
      if (hands)
        CHECK(out[std::size_t(r)].resumed == 7);
      else  // whichever snapshot completed before the loss, the same on every rank
        CHECK((out[std::size_t(r)].resumed == 4 || out[std::size_t(r)].resumed == 6));
      CHECK(out[std::size_t(r)].resumed == out[0].resumed);
      CHECK(out[std::size_t(r)].trainer_state == (hands ? std::optional<std::string>(schedule_after(7)) : std::nullopt));
      CHECK(got[std::size_t(r)].w == want[std::size_t(r)].w);
    }
    std::filesystem::remove_all(snaps);
  }
}

namespace {

// Note [Pieces to their new owners]: a random exchange over `total` elements of world 4, runs of
// 1-16 elements, each with one holder, needed by each rank with odds 1/2 where `may_need(holder,
// rank)`.
PieceExchange random_exchange(std::size_t total, const std::function<bool(int, int)>& may_need) {
  constexpr int W = 4;
  std::uint32_t seed = 7;
  const auto draw = [&] { return seed = seed * 1664525u + 1013904223u, seed >> 8; };
  PieceExchange x{0, W, std::vector<Spans>(W), std::vector<Spans>(W)};
  for (std::size_t e = 0; e < total; ++e) {
    const std::size_t len = std::min<std::size_t>(1 + draw() % 16, total - e);
    const auto h = std::size_t(draw() % W);
    x.holds[h] = unite(x.holds[h], Spans{{e, e + len}});
    for (int t = 0; t < W; ++t)
      if (draw() % 2 && may_need(int(h), t)) x.needs[std::size_t(t)] = unite(x.needs[std::size_t(t)], Spans{{e, e + len}});
    e += len - 1;
  }
  return x;
}

float piece_value(std::size_t e) { return 0.5f + float(e); }

// Runs `shape` over a fresh world from `world()`, window by window: each rank's window after the
// exchange in `got`, the elements each rank's shifts sent in `moved`; the ranks' errors.
std::vector<std::exception_ptr> run_exchange(const PieceExchange& shape, const std::function<Ranks()>& world, std::size_t total,
                                             std::size_t window, std::vector<std::vector<float>>& got, std::vector<std::size_t>& moved) {
  const int W = shape.world;
  const Ranks ranks = world();
  got.assign(std::size_t(W), std::vector<float>(total, -1.0f));
  moved.assign(std::size_t(W), 0);
  return test::run_ranks(W, [&](int r) {
    auto me = shape;
    me.rank = r;
    auto comm = ranks(r);
    for (std::size_t begin = 0; begin < total; begin += window) {
      std::vector<float> w(window, -1.0f);
      for (const auto& s : clip(me.holds[std::size_t(r)], begin, begin + window))
        for (std::size_t e = s.lo; e < s.hi; ++e) w[e - begin] = piece_value(e);
      exchange_window(me, begin, w, [&](const CollectiveOp& op) {
        CHECK(op.kind == CollectiveKind::shift);
        moved[std::size_t(r)] += op.count;
        comm->run(op, 10s);
      }, "test exchange");
      std::copy(w.begin(), w.end(), got[std::size_t(r)].begin() + std::ptrdiff_t(begin));
    }
  });
}

// The elements each rank needs that its window does not hold after the exchange (0: all arrived).
std::vector<std::size_t> wrong_pieces(const PieceExchange& x, const std::vector<std::vector<float>>& got) {
  std::vector<std::size_t> wrong(x.needs.size(), 0);
  for (std::size_t t = 0; t < x.needs.size(); ++t)
    for (const auto& s : x.needs[t])
      for (std::size_t e = s.lo; e < s.hi; ++e) wrong[t] += got[t][e] != piece_value(e);
  return wrong;
}

}  // namespace

// Note [Pieces to their new owners]: what a restore from the twins moves.
TEST_CASE("the restore's exchange, world 4, windows of 100 over 1000 elements: each rank holds a random quarter and needs a random "
          "half -> each gets every element it needs, from the shifts' padded packs only (none summed), and an element nobody "
          "holds stops every rank before any shift, naming the rank that needs it") {
  constexpr int W = 4;
  constexpr std::size_t total = 1000, window = 100;
  const auto x = random_exchange(total, [](int, int) { return true; });
  std::size_t held = 0;
  for (const auto& h : x.holds) held += length(h);
  REQUIRE(held == total);
  const auto flat = [] { return Ranks([w = InProcessWorld::create(W, 10s)](int r) { return w->communicator(r); }); };
  std::vector<std::vector<float>> got;
  std::vector<std::size_t> moved;
  test::require_all_ok(run_exchange(x, flat, total, window, got, moved));
  for (int r = 0; r < W; ++r) CHECK(moved[std::size_t(r)] == exchange_elements(x, total, window));
  CHECK(wrong_pieces(x, got) == std::vector<std::size_t>(W, 0));
  // What crossed: at most what an all-reduce of the windows would put on each link, 2 (W - 1) / W.
  CHECK(exchange_elements(x, total, window) < 2 * (W - 1) * total / W);
  // Rank 1's first run held by nobody, and needed by rank 2.
  auto missing = x;
  const Span gone = missing.holds[1].front();
  missing.holds[1].erase(missing.holds[1].begin());
  missing.needs[2] = unite(missing.needs[2], Spans{gone});
  const auto errors = run_exchange(missing, flat, total, window, got, moved);
  for (int r = 0; r < W; ++r) {
    CHECK(moved[std::size_t(r)] == 0);
    REQUIRE(errors[std::size_t(r)]);
    CHECK_THROWS_WITH_AS(std::rethrow_exception(errors[std::size_t(r)]), doctest::Contains("rank 2 needs"), Error);
  }
}

TEST_CASE("the restore's exchange over two levels, 2 hosts x 2 ranks (Note [Pieces over two levels]): each rank needs a random half of what "
          "ranks of its host or its local index hold -> each gets all of it by shifts inside the hosts and by whole hosts, and a piece needed "
          "on another host and local index makes its window alone unroutable, and the exchange refuses that window on every rank by name") {
  constexpr int W = 4;
  constexpr std::size_t total = 1000, window = 100;
  CHECK(subtract(Spans{{0, 10}, {20, 30}}, Spans{{5, 22}, {25, 26}}) == Spans{{0, 5}, {22, 25}, {26, 30}});
  CHECK(subtract(Spans{{0, 10}}, Spans{}) == Spans{{0, 10}});
  CHECK(subtract(Spans{{0, 10}, {12, 14}}, Spans{{0, 14}}).empty());
  const auto near = [](int h, int t) { return h / 2 == t / 2 || h % 2 == t % 2; };
  auto x = random_exchange(total, near);
  x.host_ranks = 2;
  for (int h = 0; h < W; ++h)
    for (int t = 0; t < W; ++t) CHECK(reaches(x, h, t) == near(h, t));
  for (std::size_t begin = 0; begin < total; begin += window) CHECK(routable(x, begin, window));
  const auto two_levels = [] { return Ranks([w = std::make_shared<TwoLevels>()](int r) { return w->communicator(r); }); };
  std::vector<std::vector<float>> got;
  std::vector<std::size_t> moved;
  test::require_all_ok(run_exchange(x, two_levels, total, window, got, moved));
  for (int r = 0; r < W; ++r) {  // each pack padded to the longest of its host's or its lane's, not the world's
    auto me = x;
    me.rank = r;
    CHECK(moved[std::size_t(r)] == exchange_elements(me, total, window));
  }
  CHECK(wrong_pieces(x, got) == std::vector<std::size_t>(W, 0));
  // Rank 3 (host 1, local index 1) needs an element of rank 0's (host 0, index 0) in [300, 400).
  auto far = x;
  REQUIRE(!clip(far.holds[0], 300, 400).empty());
  const Span piece = clip(far.holds[0], 300, 400).front();
  far.needs[3] = unite(far.needs[3], Spans{{piece.lo, piece.lo + 1}});
  for (std::size_t begin = 0; begin < total; begin += window) CHECK(routable(far, begin, window) == (begin != 300));
  // Summed instead, as the restore does: what it counts for that window is an all-reduce's.
  const std::size_t in_window = exchange_elements(x, 400, window) - exchange_elements(x, 300, window);
  CHECK(exchange_elements(far, total, window) == exchange_elements(x, total, window) - in_window + 2 * window * (W - 1) / W);
  const auto errors = run_exchange(far, two_levels, total, window, got, moved);
  for (int r = 0; r < W; ++r) {
    CAPTURE(r);
    REQUIRE(errors[std::size_t(r)]);
    CHECK_THROWS_WITH_AS(std::rethrow_exception(errors[std::size_t(r)]), doctest::Contains("[300, 400)"), Error);
    CHECK_THROWS_WITH_AS(std::rethrow_exception(errors[std::size_t(r)]), doctest::Contains("Note [Pieces over two levels]"), Error);
  }
}
