// Recovering in place (Note [Recovering in place], runtime/rank/recovery.cpp): Runtime::recover()
// on ranks that are threads of this process, so that a round of recovery can be placed at any
// point of an iteration. The launcher's side (a rank's process killed or stopped, only it started
// again) is in test_launch.
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <optional>
#include <span>
#include <utility>
#include <thread>
#include <tuple>

#include <caf/all.hpp>

#include "shardflow/actor.hpp"
#include "shardflow/shardflow.hpp"
#include "shardflow/launch.hpp"
#include "shardflow/store.hpp"
#include "support/helpers.hpp"

using namespace shardflow;

namespace {

constexpr int kSteps = 8;
constexpr std::size_t kA = 300, kB = 37;  // two parameters, several buckets with the small caps below

Config config(const std::string& snapshots, int stage, bool prefetch = false, int every = 1) {
  Config cfg;
  cfg.zero.stage = ZeroStage(stage);
  cfg.zero.forward_prefetch = prefetch;
  cfg.zero.overlap = stage ? Overlap::interleaved : Overlap::none;
  cfg.buckets.first_cap_bytes = cfg.buckets.cap_bytes = 512;
  cfg.snapshot.dir = snapshots;
  cfg.snapshot.every = every;
  cfg.timeouts.collective = std::chrono::seconds(20);
  return cfg;
}

// A rank's gradients at a step: they depend on the parameters, the rank and the step only, so a
// run that goes back to a snapshot and on computes what an uninterrupted one computes.
void gradients(std::span<const float> w, std::vector<float>& g, int rank, int step) {
  for (std::size_t i = 0; i < w.size(); ++i) g[i] = 0.1f * w[i] + 0.01f * float((i * 7 + std::size_t(rank) * 3 + std::size_t(step)) % 11) - 0.05f;
}

// One whole iteration: both gradients written and reported, then wait().
template <class M>
void step_both(Runtime& rt, M& m, Param pa, Param pb, std::vector<float>& ga, std::vector<float>& gb, int rank, int step) {
  gradients(m.a, ga, rank, step);
  gradients(m.b, gb, rank, step);
  std::copy(ga.begin(), ga.end(), rt.grad_f32(pa));
  rt.grad_ready(pa);
  std::copy(gb.begin(), gb.end(), rt.grad_f32(pb));
  rt.grad_ready(pb);
  rt.wait();
}

// Both parameters in one buffer, llm.c-style: registered one by one or as one flat buffer.
struct Model {
  std::vector<float> w = std::vector<float>(kA + kB);
  std::span<float> a{w.data(), kA}, b{w.data() + kA, kB};
  Model() {
    for (std::size_t i = 0; i < kA; ++i) a[i] = 0.01f * float(i % 13) - 0.06f;
    for (std::size_t i = 0; i < kB; ++i) b[i] = 0.02f * float(i % 5);
  }
  Model(const Model&) = delete;
};

// The two parameters one by one and AdamW: the set-up every rank makes (and recover() replays).
std::pair<Param, Param> set_up(Runtime& rt, Model& m) {
  const Param pa = rt.register_param({"a", {std::int64_t(kA)}, DType::f32, Device::cpu(), m.a.data()});
  const Param pb = rt.register_param({"b", {std::int64_t(kB)}, DType::f32, Device::cpu(), m.b.data()});
  OptimizerConfig adamw;
  adamw.kind = OptimizerConfig::Kind::adamw;
  adamw.lr = 0.01f;
  rt.configure_optimizer(adamw);
  return {pa, pb};
}

// One rank's training; with `recover_at` the ranks abandon step `recover_at` after reporting
// parameter a only (its bucket's reduction may be under way) and recover onto `next`.
void train_rank(int rank, const std::shared_ptr<Communicator>& comm, const std::string& snapshots, int stage, bool flat, Model& m,
                std::optional<int> recover_at, std::shared_ptr<Communicator> next, std::uint64_t& resumed, bool prefetch = false,
                int every = 1, std::vector<std::string>* recovered_log = nullptr) {
  Runtime rt(comm, config(snapshots, stage, prefetch, every));
  Param pa, pb;
  if (flat) {
    FlatBuffers f;
    f.params = m.w.data();
    f.numel = m.w.size();
    f.table = {{"a", {std::int64_t(kA)}, 0}, {"b", {std::int64_t(kB)}, kA}};
    const auto ps = rt.register_flat(f);
    pa = ps[0], pb = ps[1];
  } else {
    pa = rt.register_param({"a", {std::int64_t(kA)}, DType::f32, Device::cpu(), m.a.data()});
    pb = rt.register_param({"b", {std::int64_t(kB)}, DType::f32, Device::cpu(), m.b.data()});
  }
  OptimizerConfig adamw;
  adamw.kind = OptimizerConfig::Kind::adamw;
  adamw.lr = 0.01f;
  rt.configure_optimizer(adamw);
  std::vector<float> ga(kA), gb(kB);
  std::shared_ptr<Communicator> round = next;
  for (int step = int(rt.resumed_step()); step < kSteps; ++step) {
    try {
      rt.zero_grad();
      if (prefetch) rt.wait_param(pa), rt.wait_param(pb);  // "forward" reads both
      gradients(m.a, ga, rank, step);
      gradients(m.b, gb, rank, step);
      std::copy(ga.begin(), ga.end(), rt.grad_f32(pa));
      rt.grad_ready(pa);
      if (recover_at && step == *recover_at) {
        recover_at.reset();
        throw CommError("rank " + std::to_string(rank) + ": the test loses a peer in step " + std::to_string(step));
      }
      std::copy(gb.begin(), gb.end(), rt.grad_f32(pb));
      rt.grad_ready(pb);
      rt.wait();
    } catch (const Error&) {
      // What a trainer does on a lost peer; a rank may also see another's abort first, anywhere in
      // the step: it recovers alike.
      if (!round) throw;
      resumed = rt.recover(std::exchange(round, nullptr));
      if (recovered_log) *recovered_log = rt.collective_log();
      step = int(resumed) - 1;  // the handles are still good: the loop goes on from the snapshot
    }
  }
  rt.wait_all_params();
}

// The memory a launcher offers the ranks' snapshots (snapshot_env::kMemory), here a directory the
// test makes; its "regroup" file is the launcher's word that it takes a node in (Note [A node
// joins live]).
struct Env {
  std::string memory;
  explicit Env(std::string m) : memory(std::move(m)) {
    std::filesystem::create_directories(memory);
    ::setenv("SHARDFLOW_SNAPSHOT_MEMORY", memory.c_str(), 1);
  }
  ~Env() {
    ::unsetenv("SHARDFLOW_SNAPSHOT_MEMORY");
    std::filesystem::remove_all(memory);
  }
  std::string regroup() const { return (std::filesystem::path(memory) / "regroup").string(); }
};

std::string scratch(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / ("shardflow_recovery_" + std::to_string(::getpid()) + "_" + name);
  std::filesystem::remove_all(dir);
  return dir.string();
}

}  // namespace

TEST_CASE("world 3, ZeRO 0/1/2, parameters one by one or one flat buffer, forward prefetch or not: every rank abandons its 8th step half reported and recovers onto a new round -> the snapshot "
          "after 6 steps is reloaded (the half step discarded everywhere), the handles still work, and the run ends bit for bit where an "
          "uninterrupted one ends") {
  constexpr int N = 3;
  // (stage, flat, forward prefetch, snapshot every, the step resumed at). Prefetch's syncs are
  // still landing when each snapshot's control words go out (Note [Control words after prefetched
  // syncs]); every 2 steps a snapshot completes at the end of the first step by which every rank's
  // files are written — one step later with prefetch, whose word rides the comm stream behind the
  // syncs (Note [The written word behind the syncs]): snapshot 6 completes at the end of step 7
  // without it if its files are written by then (else 4 is the newest: 0 below takes either), and
  // at the end of step 8 (never reached) with it.
  for (const auto& [stage, flat, prefetch, every, resumed_at] :
       {std::tuple{0, false, false, 1, 6}, std::tuple{1, false, false, 1, 6}, std::tuple{2, false, false, 1, 6}, std::tuple{1, true, false, 1, 6},
        std::tuple{2, true, false, 1, 6}, std::tuple{1, false, true, 1, 6}, std::tuple{1, false, false, 2, 0}, std::tuple{1, false, true, 2, 4},
        std::tuple{2, true, true, 2, 4}}) {
    CAPTURE(stage);
    CAPTURE(flat);
    CAPTURE(prefetch);
    CAPTURE(every);
    std::vector<Model> want(N), got(N);
    {
      auto world = InProcessWorld::create(N);
      const auto snaps = scratch("ref" + std::to_string(stage));
      std::vector<std::thread> ts;
      std::vector<std::uint64_t> unused(N);
      for (int r = 0; r < N; ++r)
        ts.emplace_back([&, r] { train_rank(r, world->communicator(r), snaps, stage, flat, want[r], std::nullopt, nullptr, unused[r], prefetch, every); });
      for (auto& t : ts) t.join();
      std::filesystem::remove_all(snaps);
    }
    auto first = InProcessWorld::create(N), second = InProcessWorld::create(N);
    const auto snaps = scratch("rec" + std::to_string(stage));
    std::vector<std::thread> ts;
    std::vector<std::uint64_t> resumed(N, 0);
    std::vector<std::exception_ptr> errors(N);
    std::vector<std::vector<std::string>> recovered_log(N);
    for (int r = 0; r < N; ++r)
      ts.emplace_back([&, r] {
        try {
          train_rank(r, first->communicator(r), snaps, stage, flat, got[r], 7, second->communicator(r), resumed[r], prefetch, every,
                     &recovered_log[r]);
        } catch (...) {
          errors[r] = std::current_exception();
        }
      });
    for (auto& t : ts) t.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
    for (int r = 0; r < N; ++r) {
      CAPTURE(r);
      // Every step: the snapshot after 7 steps completes at the end of the 8th, which never ended,
      // so the one after 6 is the newest complete one.
      if (resumed_at) CHECK(resumed[r] == std::uint64_t(resumed_at));
      else CHECK((resumed[r] == 4 || resumed[r] == 6));
      CHECK(resumed[r] == resumed[0]);
      CHECK(got[r].w == want[r].w);
      // Note [No state moved before a load]: the snapshot's buckets (rebuilt in the order the
      // gradients came: a, then b) replace the replayed set-up's (b, then a) without moving the
      // fresh state between ranks first; the load writes all of it.
      const auto& log = recovered_log[std::size_t(r)];
      CHECK(std::none_of(log.begin(), log.end(), [](const std::string& c) { return c.find("migrate optimizer state") != std::string::npos; }));
      CHECK(std::any_of(log.begin(), log.end(), [](const std::string& c) { return c.find("snapshot") != std::string::npos; }));
    }
    std::filesystem::remove_all(snaps);
  }
}

// Note [Snapshots of a timeline left behind]
TEST_CASE("a snapshot of a timeline left behind: the hosts' memory holds step 6's file without its index (a rank lost while "
          "the snapshot was written or copied) -> the ranks start from what is complete and the host's first rank removes step 6 "
          "(its copies to the other host stop with it) while a snapshot with its index stays") {
  namespace fs = std::filesystem;
  constexpr int N = 2;
  const Env env(scratch("left_behind"));
  const auto snaps = scratch("left_behind_disk");
  const fs::path memory(env.memory);
  fs::create_directories(memory / "step-6");
  std::ofstream(memory / "step-6" / "ckpt-0a1b2c3d-rank0-of-2.safetensors") << "written before the loss";
  // Indexed, but not whole here (its file is elsewhere): not loaded, and not removed either.
  fs::create_directories(memory / "step-9");
  std::ofstream(memory / "step-9" / "index.json") << R"({"files": ["ckpt-ffffffff-rank0-of-2.safetensors"]})";
  auto world = InProcessWorld::create(N);
  std::vector<std::uint64_t> resumed(N, 99);
  std::vector<Model> m(N);
  test::require_all_ok(test::run_ranks(N, [&](int r) {
    Runtime rt(world->communicator(r), config(snaps, 1));
    set_up(rt, m[std::size_t(r)]);
    resumed[std::size_t(r)] = rt.resumed_step();
  }));
  CHECK(resumed == std::vector<std::uint64_t>(N, 0));
  CHECK_FALSE(fs::exists(memory / "step-6"));
  CHECK(fs::exists(memory / "step-9" / "index.json"));
  fs::remove_all(snaps);
}

TEST_CASE("recovering in place misused: a null communicator, no snapshots, a set-up changed after training started, "
          "rejoining outside `shardflow run --recovery in-place`, a bad SHARDFLOW_RECOVERY — each named") {
  float w[4] = {1, 2, 3, 4}, v[2] = {5, 6};
  auto world = InProcessWorld::create(1);
  {
    Runtime rt(world->communicator(0), Config{});
    rt.register_param({"w", {4}, DType::f32, Device::cpu(), w});
    CHECK_THROWS_WITH_AS(rt.recover(nullptr), doctest::Contains("communicator is null"), UsageError);
    CHECK_THROWS_WITH_AS(rt.recover(InProcessWorld::create(1)->communicator(0)), doctest::Contains("snapshot.dir is not set"), UsageError);
  }
  {
    const auto snaps = scratch("misused");
    Runtime rt(world->communicator(0), config(snaps, 1));
    const Param pw = rt.register_param({"w", {4}, DType::f32, Device::cpu(), w});
    const Param pv = rt.register_param({"v", {2}, DType::f32, Device::cpu(), v});
    rt.configure_optimizer(OptimizerConfig{});
    rt.resumed_step();
    rt.grad_ready(pw);
    rt.grad_ready(pv);
    rt.wait();
    rt.set_requires_grad(pw, false);
    rt.refresh_trainable();
    CHECK_THROWS_WITH_AS(rt.recover(InProcessWorld::create(1)->communicator(0)), doctest::Contains("refresh_trainable() after iteration 1"),
                         UsageError);
  }
  std::filesystem::remove_all(scratch("misused"));  // once its Runtime, and the save it had in flight, are gone
  LaunchEnv env;
  env.source = "torchrun";
  CHECK_THROWS_WITH_AS(rejoin_process_group(env), doctest::Contains("--recovery in-place"), UsageError);
  auto detect = [](const char* recovery, const char* round) {
    return LaunchEnv::detect([=](const char* k) -> const char* {
      const std::string key = k;
      if (key == "RANK") return "0";
      if (key == "WORLD_SIZE") return "1";
      if (key == "SHARDFLOW_RECOVERY") return recovery;
      if (key == "SHARDFLOW_RECOVERY_ROUND") return round;
      return nullptr;
    });
  };
  CHECK_THROWS_WITH_AS(detect("sideways", nullptr), doctest::Contains("SHARDFLOW_RECOVERY is 'sideways'"), UsageError);
  CHECK_THROWS_WITH_AS(detect(nullptr, "2"), doctest::Contains("SHARDFLOW_RECOVERY_ROUND is set without"), UsageError);
  const auto ok = detect("in-place", "2");
  CHECK(ok.recover_in_place);
  CHECK(ok.recovery_round == 2);
}

TEST_CASE("rejoin_process_group reads the launcher's word: restart instead, a rank counted lost, a malformed word -> a "
          "CommError saying which — in-place -> the round's group with the rank and world the word gives") {
  StoreServerOptions so;
  so.host = "127.0.0.1";
  so.port = 0;
  so.token = "recovery-test";
  TcpStoreServer server(so);
  LaunchEnv env;
  env.source = "shardflow run";
  env.rank = 0;
  env.world_size = 2;  // the round before's world; the word below leaves one rank
  env.local_world_size = 2;
  env.store_hosted = true;
  env.store_port = server.port();
  env.token = so.token;
  env.recover_in_place = true;
  StoreRendezvous where;
  where.store_port = server.port();
  where.token = so.token;
  const auto store = connect_store(where);
  const ProcessGroupOptions group{"auto", std::chrono::seconds(5)};
  auto word_is = [&](const std::string& word) { store->set("g0/recovery/1", word); };
  word_is("restart: rank 1 failed again while round 1 was open");
  CHECK_THROWS_WITH_AS(rejoin_process_group(env, group), doctest::Contains("does not recover in place this time: restart: rank 1"),
                       CommError);
  word_is("in-place: rank 0 (pid 1) was stopped\nworld 1\nranks -1 0");
  CHECK_THROWS_WITH_AS(rejoin_process_group(env, group), doctest::Contains("rank 0 was counted lost in round 1"), CommError);
  word_is("in-place: garbled");
  CHECK_THROWS_WITH_AS(rejoin_process_group(env, group), doctest::Contains("malformed"), CommError);
  word_is("in-place: rank 0 (pid 1) was killed\nworld 1\nranks -1 0");
  env.rank = 1;
  const auto comm = rejoin_process_group(env, group);
  CHECK(comm->rank() == 0);
  CHECK(comm->world_size() == 1);
  CHECK(store->add("g0/r1/joined", 0) == 1);  // what the launcher counts to end the round
}

// The actor API's side (shardflow/actor.hpp): a subscriber hears the failure, then `recovered`
// with the rank's new actor, the step, rank and world, and a second failure after it is heard
// again (a rank announces its failure once per round, not once per life).
TEST_CASE("the actor API hears a recovery: world 2, lost twice -> each time failed then recovered, carrying the new rank actor, the step resumed and "
          "the round's rank and world") {
  constexpr int N = 2;
  std::vector<Model> models(N);
  auto rounds = std::vector<std::shared_ptr<InProcessWorld>>{InProcessWorld::create(N), InProcessWorld::create(N), InProcessWorld::create(N)};
  const auto snaps = scratch("actor_events");
  struct Heard {
    int failed = 0, recovered = 0;
    std::vector<std::uint64_t> steps;
    std::vector<std::pair<int, int>> where;
    bool actor_matches = true;
  };
  std::vector<Heard> heard(N);
  test::require_all_ok(test::run_ranks(N, [&](int r) {
    Runtime rt(rounds[0]->communicator(r), config(snaps, 1));
    auto& m = models[std::size_t(r)];
    const Param pa = rt.register_param({"a", {std::int64_t(kA)}, DType::f32, Device::cpu(), m.a.data()});
    const Param pb = rt.register_param({"b", {std::int64_t(kB)}, DType::f32, Device::cpu(), m.b.data()});
    rt.configure_optimizer(OptimizerConfig{});
    caf::scoped_actor self{actor_system_of(rt)};
    self->send(rank_actor_of(rt), rank_api::subscribe_atom::value, caf::actor(self), std::uint8_t(rank_api::failed | rank_api::recovered));
    std::vector<float> ga(kA), gb(kB);
    std::size_t round = 0;
    for (int step = int(rt.resumed_step()); step < kSteps; ++step) {
      try {
        rt.zero_grad();
        if ((round == 0 && step == 4) || (round == 1 && step == 6)) {
          CollectiveOp both;  // both ranks between the same iterations, then the round ends under them
          both.kind = CollectiveKind::barrier;
          both.tag = "the test's barrier";
          rt.collective(both).get();
          rounds[round]->communicator(r)->abort("the test ends round " + std::to_string(round));
        }
        step_both(rt, m, pa, pb, ga, gb, r, step);
      } catch (const Error&) {
        REQUIRE(round + 1 < rounds.size());
        step = int(rt.recover(rounds[++round]->communicator(r))) - 1;
        const auto now = rank_actor_of(rt);
        auto& h = heard[std::size_t(r)];
        self->receive([&](rank_api::failed_atom, caf::error&) { ++h.failed; }, caf::after(std::chrono::seconds(10)) >> [] {});
        self->receive(
            [&](rank_api::recovered_atom, rank_api::actor a, std::uint64_t s, std::int32_t rk, std::int32_t w) {
              ++h.recovered;
              h.steps.push_back(s);
              h.where.emplace_back(rk, w);
              h.actor_matches = h.actor_matches && a == now;
            },
            caf::after(std::chrono::seconds(10)) >> [] {});
      }
    }
    rt.wait_all_params();
  }));
  for (int r = 0; r < N; ++r) {
    CAPTURE(r);
    const auto& h = heard[std::size_t(r)];
    CHECK(h.failed == 2);
    CHECK(h.recovered == 2);
    CHECK(h.actor_matches);
    CHECK(h.where == std::vector<std::pair<int, int>>{{r, N}, {r, N}});
    // A snapshot every step completes at the end of the next: lost in the 5th step -> the one after
    // 3 steps, then in the 7th -> the one after 5.
    CHECK(h.steps == std::vector<std::uint64_t>{3, 5});
  }
  std::filesystem::remove_all(snaps);
}

// Note [Recovering from actors] (runtime/rank/rank_actor.cpp): a trainer made of actors heals in
// place without blocking a scheduler thread. Each rank's trainer is one event-based actor that
// drives its rank actor; when an iteration of round 0 fails it asks its rank actor to recover onto
// round 1 and goes on with the new rank actor from the step the answer names.
namespace {

using run_atom = caf::atom_constant<caf::atom("run")>;

struct ActorTrainer {
  Runtime* rt = nullptr;
  Model* m = nullptr;
  Param pa, pb;
  int rank = 0;
  std::vector<std::shared_ptr<InProcessWorld>>* rounds = nullptr;
  int lose_in = -1;  // the step in which round 0 ends under every rank
  std::optional<rank_api::NextRound> next;  // unset: the next round's communicator
  struct Heard {
    std::vector<std::uint64_t> resumed;
    std::vector<std::pair<int, int>> where;  // rank, world
    std::string error;
  };
  Heard* heard = nullptr;  // written by the actor, read once it answered run
};

struct ActorTrainerState {
  caf::response_promise done;
  rank_api::actor rank;
  int step = 0;
  std::size_t round = 0;  // an answer of an earlier round is stale
  bool recovering = false;
  std::vector<float> ga = std::vector<float>(kA), gb = std::vector<float>(kB);
};

void actor_step(caf::stateful_actor<ActorTrainerState>* self, const ActorTrainer* t);

void actor_failed(caf::stateful_actor<ActorTrainerState>* self, const ActorTrainer* t, std::size_t round, const caf::error& e) {
  auto& st = self->state;
  if (round != st.round || st.recovering) return;  // one recovery a round, whichever request failed first
  if (st.round + 1 >= t->rounds->size()) {  // no round left: the error is the run's
    t->heard->error = what(e);
    return st.done.deliver(run_atom::value);
  }
  st.recovering = true;
  auto next = t->next ? *t->next : rank_api::NextRound{[t, r = st.round + 1] { return (*t->rounds)[r]->communicator(t->rank); }};
  self->request(st.rank, caf::infinite, rank_api::recover_atom::value, std::move(next))
      .then(
          [=](rank_api::recovered_atom, std::uint64_t step, std::int32_t rank, std::int32_t world) {
            auto& st = self->state;
            st.recovering = false;
            ++st.round;
            st.rank = rank_actor_of(*t->rt);
            t->heard->resumed.push_back(step);
            t->heard->where.emplace_back(rank, world);
            st.step = int(step);
            actor_step(self, t);
          },
          [=](caf::error& e) {
            t->heard->error = what(e);
            self->state.done.deliver(run_atom::value);
          });
}

void actor_step(caf::stateful_actor<ActorTrainerState>* self, const ActorTrainer* t) {
  auto& st = self->state;
  if (st.step == kSteps) {
    self->request(st.rank, caf::infinite, rank_api::all_params_atom::value)
        .then([=](rank_api::all_params_atom) { self->state.done.deliver(run_atom::value); },
              [=](caf::error& e) { actor_failed(self, t, self->state.round, e); });
    return;
  }
  const auto round = st.round;
  auto on_error = [=](caf::error& e) { actor_failed(self, t, round, e); };
  self->send(st.rank, rank_api::zero_grad_atom::value);
  auto backward = [=] {
    self->request(self->state.rank, caf::infinite, rank_api::grad_atom::value, std::vector<Param>{t->pa, t->pb})
        .then(
            [=](const std::vector<GradSlot>& slots) {
              auto& st = self->state;
              if (round != st.round) return;
              gradients(t->m->a, st.ga, t->rank, st.step);
              gradients(t->m->b, st.gb, t->rank, st.step);
              std::copy(st.ga.begin(), st.ga.end(), static_cast<float*>(slots[0].data));
              std::copy(st.gb.begin(), st.gb.end(), static_cast<float*>(slots[1].data));
              self->send(st.rank, rank_api::grad_ready_atom::value, std::vector<Param>{t->pa, t->pb});
              self->request(st.rank, caf::infinite, rank_api::iteration_atom::value)
                  .then(
                      [=](rank_api::step_done_atom, std::uint64_t) {
                        if (round != self->state.round) return;
                        ++self->state.step;
                        actor_step(self, t);
                      },
                      on_error);
            },
            on_error);
  };
  if (round != 0 || st.step != t->lose_in) return backward();
  // Every rank between the same iterations, then round 0 ends under them (as a lost peer ends it).
  CollectiveOp both;
  both.kind = CollectiveKind::barrier;
  both.tag = "the test's barrier";
  self->request(st.rank, caf::infinite, rank_api::collective_atom::value, both)
      .then(
          [=](rank_api::collective_atom, const std::string&) {
            (*t->rounds)[0]->communicator(t->rank)->abort("the test ends round 0");
            backward();
          },
          on_error);
}

caf::behavior actor_trainer(caf::stateful_actor<ActorTrainerState>* self, const ActorTrainer* t, std::uint64_t first) {
  self->state.rank = rank_actor_of(*t->rt);
  self->state.step = int(first);
  return {[=](run_atom) {
    self->state.done = self->make_response_promise();
    actor_step(self, t);
    return self->state.done;
  }};
}

// One rank of the actor-driven run: set up on this thread (blocking calls before any actor runs),
// then trained by its actor.
void run_actor_rank(int r, ActorTrainer t, const std::string& snaps) {
  Runtime rt(t.rounds->front()->communicator(r), config(snaps, 1));
  t.pa = rt.register_param({"a", {std::int64_t(kA)}, DType::f32, Device::cpu(), t.m->a.data()});
  t.pb = rt.register_param({"b", {std::int64_t(kB)}, DType::f32, Device::cpu(), t.m->b.data()});
  OptimizerConfig adamw;
  adamw.kind = OptimizerConfig::Kind::adamw;
  adamw.lr = 0.01f;
  rt.configure_optimizer(adamw);
  t.rt = &rt;
  t.rank = r;
  const auto first = rt.resumed_step();
  auto& sys = actor_system_of(rt);
  auto trainer = sys.spawn(actor_trainer, &t, first);
  caf::scoped_actor self{sys};
  self->request(trainer, std::chrono::seconds(120), run_atom::value)
      .receive([](run_atom) {}, [&](caf::error& e) { t.heard->error = "the trainer actor: " + caf::to_string(e); });
  self->send_exit(trainer, caf::exit_reason::user_shutdown);
  self->wait_for(trainer);  // before the Runtime goes
}

// World N of actor trainers into `got`, round 0 lost in the 6th step, recovering onto round 1 with
// `next` (unset: round 1's communicator): what each rank's actor heard.
std::vector<ActorTrainer::Heard> run_actor_world(int N, std::vector<Model>& got, const std::string& tag,
                                                 const std::optional<rank_api::NextRound>& next = std::nullopt) {
  auto rounds = std::vector<std::shared_ptr<InProcessWorld>>{InProcessWorld::create(N), InProcessWorld::create(N)};
  const auto snaps = scratch(tag);
  std::vector<ActorTrainer::Heard> heard(static_cast<std::size_t>(N));
  test::require_all_ok(test::run_ranks(N, [&](int r) {
    ActorTrainer t;
    t.m = &got[std::size_t(r)];
    t.rounds = &rounds;
    t.lose_in = 5;
    t.heard = &heard[std::size_t(r)];
    t.next = next;
    run_actor_rank(r, t, snaps);
  }));
  std::filesystem::remove_all(snaps);
  return heard;
}

}  // namespace

TEST_CASE("an actor trainer recovers in place through its rank actor: world 3 and world 1 (the process's only Runtime), round 0 lost in "
          "the 6th step -> each rank's actor asks recover_atom, is answered with the step, rank and world, goes on with the new rank "
          "actor, and the run ends bit for bit where an uninterrupted one ends — an empty or failing NextRound is the answer's error, named") {
  auto reference = [](int N) {
    std::vector<Model> want{std::size_t(N)};
    auto world = InProcessWorld::create(N);
    const auto snaps = scratch("actor_ref");
    std::vector<std::uint64_t> unused(static_cast<std::size_t>(N));
    test::require_all_ok(test::run_ranks(N, [&](int r) {
      train_rank(r, world->communicator(r), snaps, 1, false, want[std::size_t(r)], std::nullopt, nullptr, unused[std::size_t(r)]);
    }));
    std::filesystem::remove_all(snaps);
    return want;
  };
  // World 1: the actor system the trainer's actor runs on is held by this one Runtime only, and
  // must stay up through the recovery that swaps its parts.
  SUBCASE("healed") {
    for (const int N : {3, 1}) {
      CAPTURE(N);
      const auto want = reference(N);
      std::vector<Model> got{std::size_t(N)};
      const auto heard = run_actor_world(N, got, "actor_heals");
      for (int r = 0; r < N; ++r) {
        CAPTURE(r);
        const auto& h = heard[std::size_t(r)];
        CHECK(h.error == "");
        // A snapshot every step completes at the end of the next: lost in the 6th -> the one after 4.
        CHECK(h.resumed == std::vector<std::uint64_t>{4});
        CHECK(h.where == std::vector<std::pair<int, int>>{{r, N}});
        CHECK(got[std::size_t(r)].w == want[std::size_t(r)].w);
      }
    }
  }
  SUBCASE("an empty NextRound, one that makes no communicator, one that throws") {
    const std::vector<std::pair<rank_api::NextRound, std::string>> cases{
        {rank_api::NextRound{}, "the NextRound is empty"},
        {[] { return std::shared_ptr<Communicator>(); }, "recover: communicator is null"},
        {[]() -> std::shared_ptr<Communicator> { throw TimeoutError("the test's launcher never answers"); }, "the test's launcher never answers"}};
    constexpr int N = 3;
    std::vector<Model> got(N);
    for (const auto& [next, says] : cases) {
      CAPTURE(says);
      const auto heard = run_actor_world(N, got, "actor_bad_next", next);
      for (int r = 0; r < N; ++r) {
        CAPTURE(r);
        CHECK(heard[std::size_t(r)].error.find(says) != std::string::npos);
      }
    }
  }
}

// Note [The trainer's state in a snapshot] (runtime/checkpoint/snapshots.cpp): each snapshot waits
// for the trainer's state until the next iteration's start; a node that joins live (Note [A node
// joins live]) is taken in once that snapshot completes. The launcher's word is the regroup file
// in the snapshot memory, made here by the test.
TEST_CASE("the trainer's state in a snapshot: world 2, handed over at each iteration's start -> the index keeps it, and recover() gives it "
          "back with the step — a node that joins live at that snapshot waits for the state (the ranks leave the next iteration at its "
          "start, once they handed it over), without trainer state they leave at the snapshot's own iteration — and a wrong step is "
          "refused by name") {
  constexpr int N = 2;
  std::vector<Model> want(N);
  {
    auto world = InProcessWorld::create(N);
    const auto snaps = scratch("state_ref");
    std::vector<std::uint64_t> unused(N);
    test::require_all_ok(test::run_ranks(N, [&](int r) {
      train_rank(r, world->communicator(r), snaps, 1, false, want[std::size_t(r)], std::nullopt, nullptr, unused[std::size_t(r)]);
    }));
    std::filesystem::remove_all(snaps);
  }
  for (const bool carried : {true, false}) {
    CAPTURE(carried);
    const Env env(scratch(carried ? "state_memory" : "no_state_memory"));
    const auto snaps = scratch(carried ? "state_disk" : "no_state_disk");
    const std::string regroup = env.regroup();
    auto rounds = std::vector<std::shared_ptr<InProcessWorld>>{InProcessWorld::create(N), InProcessWorld::create(N)};
    std::vector<Model> got(N);
    std::vector<int> left_in(N, -1);
    std::vector<std::uint64_t> resumed(N, 0);
    std::vector<std::optional<std::string>> state(N);
    std::vector<std::string> refused(N);
    test::require_all_ok(test::run_ranks(N, [&](int r) {
      auto cfg = config(snaps, 1);
      cfg.snapshot.trainer_state = carried;
      Runtime rt(rounds[0]->communicator(r), cfg);
      auto& m = got[std::size_t(r)];
      const auto [pa, pb] = set_up(rt, m);
      std::vector<float> ga(kA), gb(kB);
      std::size_t round = 0;
      for (int step = int(rt.resumed_step()); step < kSteps; ++step) {
        try {
          if (const auto w = rt.trainer_state_wanted()) {
            if (step == 2) {
              try {
                rt.set_trainer_state(w + 1, "wrong");
              } catch (const UsageError& e) {
                refused[std::size_t(r)] = e.what();
              }
            }
            rt.set_trainer_state(w, "after step " + std::to_string(w));
          }
          if (r == 0 && round == 0 && step == 3) std::ofstream(regroup).put('1');  // the launcher asks at snapshot 4
          rt.zero_grad();
          step_both(rt, m, pa, pb, ga, gb, r, step);
        } catch (const CommError&) {
          REQUIRE(round == 0);
          left_in[std::size_t(r)] = step;
          if (r == 0) std::filesystem::remove(regroup);  // the launcher's round is under way
          resumed[std::size_t(r)] = rt.recover(rounds[++round]->communicator(r));
          state[std::size_t(r)] = rt.trainer_state();
          step = int(resumed[std::size_t(r)]) - 1;
        }
      }
      rt.wait_all_params();
    }));
    for (int r = 0; r < N; ++r) {
      CAPTURE(r);
      // Snapshot 4 is staged at the end of the 4th iteration (index 3), where rank 0 finds the word.
      CHECK(left_in[std::size_t(r)] == (carried ? 4 : 3));
      CHECK(resumed[std::size_t(r)] == 4);
      if (carried) CHECK(state[std::size_t(r)] == std::optional<std::string>("after step 4"));
      else CHECK(!state[std::size_t(r)]);
      if (carried) CHECK(refused[std::size_t(r)].find("the snapshot waiting for it is step 2") != std::string::npos);
      CHECK(got[std::size_t(r)].w == want[std::size_t(r)].w);
    }
    std::filesystem::remove_all(snaps);
  }
}

// Note [A join from memory] (runtime/checkpoint/twin_restore.cpp): at a join nobody is lost, so
// the ranks keep their shards, and the newcomer gets its part from their memory. The reference is
// what a restart would do: every rank a fresh Runtime at world 3 that loads the join's snapshot.
TEST_CASE("a node joins from memory: world 2 -> 3 at ZeRO 1 and 2, the launcher takes a third rank in at snapshot 4 -> the two keep their "
          "shards and a fresh Runtime gets its part of the moments and all the parameters from their memory, reading no snapshot, and the "
          "three end bit for bit where three fresh Runtimes that load the snapshot end — and with the trainer's state in the snapshots too, "
          "the ranks leaving at the next iteration's start once they handed it over, and every rank given that state back — and in windows "
          "of 16 elements, eight in flight") {
  constexpr int N = 2;
  enum Way { loads = 0, from_memory = 1, with_trainer_state = 2, small_windows = 3 };
  for (const int stage : {1, 2}) {
    CAPTURE(stage);
    std::vector<Model> got[4];
    std::vector<std::string> newcomer_log[4];
    for (const Way way : {loads, from_memory, with_trainer_state, small_windows}) {
      CAPTURE(int(way));
      const Env env(scratch("join_" + std::to_string(int(way))));
      // Note [Windows in flight]: a model this small crosses in one window unless they are smaller.
      const test::RestoreWindows windows(way == small_windows ? "16" : nullptr);
      const auto snaps = scratch("join_disk_" + std::to_string(int(way)));
      auto rounds = std::vector<std::shared_ptr<InProcessWorld>>{InProcessWorld::create(N), InProcessWorld::create(N + 1)};
      auto& models = got[way];
      models = std::vector<Model>(N + 1);
      std::vector<std::uint64_t> resumed(N + 1, 0);
      std::vector<int> left_in(N, -1);
      std::vector<std::optional<std::string>> state(N + 1);
      std::atomic<bool> asked{false};
      test::require_all_ok(test::run_ranks(N + 1, [&](int r) {
        auto cfg = config(snaps, stage);
        cfg.snapshot.trainer_state = way == with_trainer_state;
        if (r == N)  // the newcomer starts once the running ranks left their iteration for the round
          while (!asked) std::this_thread::sleep_for(std::chrono::milliseconds(5));
        std::optional<Runtime> rt;
        rt.emplace((r == N ? rounds[1] : rounds[0])->communicator(r), cfg);
        auto& m = models[std::size_t(r)];
        auto [pa, pb] = set_up(*rt, m);
        std::vector<float> ga(kA), gb(kB);
        bool joined = r == N;
        const std::uint64_t first = rt->resumed_step();
        if (r == N) resumed[std::size_t(r)] = first, state[std::size_t(r)] = rt->trainer_state();
        for (int step = int(first); step < kSteps; ++step) {
          try {
            if (const auto w = rt->trainer_state_wanted()) rt->set_trainer_state(w, "after step " + std::to_string(w));
            if (r == 0 && !joined && step == 3) std::ofstream(env.regroup()).put('1');  // the launcher asks at snapshot 4
            rt->zero_grad();
            step_both(*rt, m, pa, pb, ga, gb, r, step);
          } catch (const CommError&) {
            REQUIRE(!joined);
            joined = true;
            left_in[std::size_t(r)] = step;
            if (r == 0) std::filesystem::remove(env.regroup());
            asked = true;
            if (way == loads) {  // a restart's way: a fresh Runtime loads the newest snapshot
              rt.reset();
              rt.emplace(rounds[1]->communicator(r), cfg);
              std::tie(pa, pb) = set_up(*rt, m);
              resumed[std::size_t(r)] = rt->resumed_step();
            } else {
              resumed[std::size_t(r)] = rt->recover(rounds[1]->communicator(r));
            }
            state[std::size_t(r)] = rt->trainer_state();
            step = int(resumed[std::size_t(r)]) - 1;
          }
        }
        rt->wait_all_params();
        if (r == N) newcomer_log[way] = rt->collective_log();
      }));
      for (int r = 0; r <= N; ++r) {
        CAPTURE(r);
        CHECK(resumed[std::size_t(r)] == 4);
        // Snapshot 4 is staged at the end of the 4th iteration (index 3); with the trainer's state
        // the ranks leave the 5th at its start, when they hand over the state of step 4.
        if (r < N) CHECK(left_in[std::size_t(r)] == (way == with_trainer_state ? 4 : 3));
        if (way == with_trainer_state) CHECK(state[std::size_t(r)] == std::optional<std::string>("after step 4"));
        else CHECK(!state[std::size_t(r)]);
      }
      std::filesystem::remove_all(snaps);
    }
    const auto windows = [](const std::vector<std::string>& log) {
      return std::count_if(log.begin(), log.end(), [](const std::string& c) { return c.find("a join: restore state") != std::string::npos; });
    };
    CHECK(windows(newcomer_log[loads]) == 0);
    CHECK(windows(newcomer_log[from_memory]) > 0);
    CHECK(windows(newcomer_log[with_trainer_state]) > 0);
    // Each slot of kA + kB = 337 elements in 22 windows: many more than the eight in flight.
    CHECK(windows(newcomer_log[small_windows]) > 3 * 8);
    for (int r = 0; r <= N; ++r) {
      CAPTURE(r);
      CHECK(got[from_memory][std::size_t(r)].w == got[loads][std::size_t(r)].w);
      CHECK(got[with_trainer_state][std::size_t(r)].w == got[loads][std::size_t(r)].w);
      CHECK(got[small_windows][std::size_t(r)].w == got[loads][std::size_t(r)].w);
    }
    // A join at world 3 really happened: the newcomer trained (its parameters moved from the start's).
    CHECK(got[from_memory][std::size_t(N)].w != Model().w);
  }
}
