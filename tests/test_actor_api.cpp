// Driving ranks from actors (shardflow/actor.hpp): the actor trainer ends where the blocking trainer
// ends, nothing blocks a scheduler thread, and a rank's failure reaches the trainer's actors as an
// error message.
#include <caf/all.hpp>
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <set>
#include <thread>

#include "examples/actor_trainer/train.hpp"
#include "shardflow/actor.hpp"
#include "tests/support/launch_helpers.hpp"
#include "tests/support/saved_params.hpp"
#include "tests/support/subprocess.hpp"

using namespace shardflow;
using namespace std::chrono_literals;

namespace {

mlp::TrainOptions small_job(int world, int stage, Overlap overlap, bool prefetch) {
  mlp::TrainOptions opt;
  opt.sizes = {24, 40, 40, 6};
  opt.steps = 6;
  opt.global_batch = 12;
  opt.world_size = world;
  opt.optimizer.kind = OptimizerConfig::Kind::adamw;
  opt.optimizer.lr = 0.01f;
  opt.seed = 7;
  opt.loss_every = 2;  // a collective of the trainer's own between iterations, and one over every step's loss at the end
  opt.runtime.zero.stage = ZeroStage(stage);
  opt.runtime.zero.overlap = overlap;
  opt.runtime.zero.forward_prefetch = prefetch;
  // Several buckets, rebuilt after the first iteration from the order the layer actors report in.
  opt.runtime.buckets.first_cap_bytes = 4096;
  opt.runtime.buckets.cap_bytes = 4096;
  opt.runtime.timeouts.collective = 20s;
  return opt;
}

void check_same(const mlp::TrainResult& got, const mlp::TrainResult& want) {
  REQUIRE(got.params.size() == want.params.size());
  for (const auto& [name, t] : want.params) {
    CAPTURE(name);
    REQUIRE(got.params.count(name));
    CHECK(got.params.at(name).data == t.data);  // bit for bit
  }
  CHECK(got.losses == want.losses);
  CHECK(got.grad_norms == want.grad_norms);  // with clipping: each step's own norm, on rank 0
  REQUIRE(got.buckets.size() == want.buckets.size());
  for (std::size_t b = 0; b < want.buckets.size(); ++b) CHECK(got.buckets[b].params == want.buckets[b].params);
}

// Two ranks of two parameters as threads of this process, each a Runtime whose rank actor the
// scenario drives from a scoped actor.
struct TwoRanks {
  std::shared_ptr<InProcessWorld> world;
  std::vector<std::vector<float>> w, g;
  std::vector<std::unique_ptr<Runtime>> rt;
  std::vector<Param> p;  // rank r's parameter "w"
  explicit TwoRanks(std::chrono::milliseconds timeout, int stage = 0) {
    world = InProcessWorld::create(2, timeout);
    Config cfg;
    cfg.timeouts.collective = timeout;
    cfg.zero.stage = ZeroStage(stage);
    w.assign(2, std::vector<float>(64, 1.0f));
    for (int r = 0; r < 2; ++r) {
      rt.push_back(std::make_unique<Runtime>(world->communicator(r), cfg));
      p.push_back(rt[std::size_t(r)]->register_param({"w", {64}, DType::f32, Device::cpu(), w[std::size_t(r)].data()}));
    }
  }
  // The setup's collectives, on each rank actor's own thread, both ranks at once.
  void setup(bool optimizer) {
    caf::scoped_actor self{actor_system_of(*rt[0])};
    for (int r = 0; r < 2; ++r)
      self->send(rank_actor_of(*rt[std::size_t(r)]), rank_api::call_atom::value, rank_api::RankCall{[optimizer](Runtime& x) {
                   x.finalize();
                   if (optimizer) x.configure_optimizer(OptimizerConfig{});
                 }});
    for (int r = 0; r < 2; ++r) self->receive([](rank_api::call_atom) {}, [](caf::error& e) { FAIL(what(e)); });
  }
  // Each rank's trainer: a scoped actor on a thread of its own, subscribed to `events`.
  template <class F>
  void each_rank(std::uint8_t events, F trainer) {
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r)
      threads.emplace_back([&, r] {
        auto& x = *rt[std::size_t(r)];
        caf::scoped_actor self{actor_system_of(x)};
        const auto rank = rank_actor_of(x);
        self->send(rank, rank_api::subscribe_atom::value, caf::actor(self), events);
        trainer(self, rank, r);
      });
    for (auto& t : threads) t.join();
  }
};

}  // namespace

TEST_CASE("actor trainer, worlds 1-3, every ZeRO stage and overlap mode (and forward prefetch) -> bit for bit the blocking trainer's parameters and losses") {
  struct Mode {
    int stage;
    Overlap overlap;
    bool prefetch;
  };
  std::vector<Mode> modes;
  for (int stage : {0, 1, 2})
    for (Overlap o : {Overlap::none, Overlap::after_backward, Overlap::interleaved}) modes.push_back({stage, o, false});
  modes.push_back({1, Overlap::interleaved, true});
  modes.push_back({2, Overlap::interleaved, true});
  for (int world : {1, 2, 3})
    for (const auto& m : modes) {
      CAPTURE(world);
      CAPTURE(m.stage);
      CAPTURE(overlap_name(m.overlap));
      CAPTURE(m.prefetch);
      const auto opt = small_job(world, m.stage, m.overlap, m.prefetch);
      const auto want = mlp::train(opt);
      const auto got = actor_trainer::train(opt);
      check_same(got, want);
      CHECK(got.step_ms.size() == std::size_t(opt.steps));
    }
}

TEST_CASE("actor trainer on a scheduler of one worker thread: world 3, ZeRO-2, interleaved, forward prefetch and clipping still finishes (no actor blocks), each step's norm recorded") {
  auto opt = small_job(3, 2, Overlap::interleaved, true);
  opt.runtime.zero.clip_grad_norm = 0.05f;  // Note [What the last step left, under prefetch]: the norm is read off the scheduler
  opt.runtime.actor_threads = 1;
  {
    // The process's actor system is made by the first Runtime alive: this one, with one worker.
    const auto world = InProcessWorld::create(1);
    Runtime probe(world->communicator(0), opt.runtime);
    REQUIRE(actor_system_of(probe).scheduler().num_workers() == 1);
  }
  const auto started = std::chrono::steady_clock::now();
  const auto got = actor_trainer::train(opt);
  CHECK(std::chrono::steady_clock::now() - started < 60s);
  opt.runtime.actor_threads = 0;
  const auto want = mlp::train(opt);
  check_same(got, want);
  REQUIRE(want.grad_norms.size() == std::size_t(opt.steps));
  CHECK(*std::max_element(want.grad_norms.begin(), want.grad_norms.end()) > opt.runtime.zero.clip_grad_norm);  // the clip engaged
  CHECK(std::set<float>(want.grad_norms.begin(), want.grad_norms.end()).size() == want.grad_norms.size());
}

TEST_CASE("a rank that reports a gradient twice fails: its trainer actor's iteration request is answered with the UsageError naming the parameter, its peer's with an error, not a hang") {
  TwoRanks ranks(20s);
  ranks.setup(false);
  std::vector<caf::error> answers(2);
  std::vector<char> failed_event(2, 0);  // a byte per rank thread: vector<bool> packs both into one word
  ranks.each_rank(rank_api::failed, [&](caf::scoped_actor& self, const rank_api::actor& rank, int r) {
      self->request(rank, 10s, rank_api::grad_atom::value, ranks.p[std::size_t(r)]).receive([](GradSlot) {}, [](caf::error&) {});
      self->send(rank, rank_api::grad_ready_atom::value, ranks.p[std::size_t(r)]);
      if (r == 1) self->send(rank, rank_api::grad_ready_atom::value, ranks.p[std::size_t(r)]);  // twice
      self->request(rank, 15s, rank_api::iteration_atom::value)
          .receive([](rank_api::step_done_atom, std::uint64_t) {}, [&](caf::error& e) { answers[std::size_t(r)] = e; });
      self->receive([&](rank_api::failed_atom, caf::error&) { failed_event[std::size_t(r)] = 1; },
                    caf::after(std::chrono::seconds(5)) >> [] {});
  });
  REQUIRE(answers[1]);
  CHECK(answers[1].category() == caf::atom("shardflow"));
  CHECK(static_cast<errc>(answers[1].code()) == errc::usage);
  CHECK(what(answers[1]).find("'w'") != std::string::npos);
  REQUIRE(answers[0]);  // the peer: aborted, at once rather than at the 20 s timeout
  CHECK(failed_event[1]);
  CHECK_THROWS_AS(ranks.rt[1]->wait(), UsageError);  // the blocking API rethrows the same failure
}

TEST_CASE("a peer that never reports: the trainer actor's iteration request is answered with a TimeoutError naming the bucket within the collective timeout") {
  TwoRanks ranks(1500ms);
  ranks.setup(false);
  auto& rt = *ranks.rt[0];
  caf::scoped_actor self{actor_system_of(rt)};
  const auto rank = rank_actor_of(rt);
  self->request(rank, 10s, rank_api::grad_atom::value, ranks.p[0]).receive([](GradSlot) {}, [](caf::error&) {});
  self->send(rank, rank_api::grad_ready_atom::value, ranks.p[0]);
  const auto t0 = std::chrono::steady_clock::now();
  caf::error answer;
  self->request(rank, 30s, rank_api::iteration_atom::value)
      .receive([](rank_api::step_done_atom, std::uint64_t) {}, [&](caf::error& e) { answer = e; });
  REQUIRE(answer);
  CHECK(static_cast<errc>(answer.code()) == errc::timeout);
  CHECK(std::chrono::steady_clock::now() - t0 < 10s);
  CHECK_THROWS_AS(rethrow(answer), TimeoutError);
  INFO(what(answer));
  CHECK(what(answer).find("rank") != std::string::npos);
}

TEST_CASE("subscribers get step_done per iteration, params_ready per bucket and checkpoint_done — a RankCall may make blocking calls (they block the rank's own thread)") {
  TwoRanks ranks(20s, 1);
  ranks.setup(true);
  const int steps = 3;
  std::vector<int> step_events(2, 0), param_events(2, 0), checkpoint_events(2, 0);
  std::vector<std::string> call_error(2);
  const auto dir = test::scratch("actor_api", "ckpt");
  ranks.each_rank(rank_api::all_events, [&](caf::scoped_actor& self, const rank_api::actor& rank, int r) {
      for (int s = 0; s < steps; ++s) {
        self->send(rank, rank_api::zero_grad_atom::value);
        self->request(rank, 10s, rank_api::grad_atom::value, ranks.p[std::size_t(r)])
            .receive([&](GradSlot g) { static_cast<float*>(g.data)[0] = float(r + 1); }, [](caf::error& e) { FAIL(what(e)); });
        self->send(rank, rank_api::grad_ready_atom::value, ranks.p[std::size_t(r)]);
        self->request(rank, 10s, rank_api::iteration_atom::value)
            .receive([&](rank_api::step_done_atom, std::uint64_t it) { CHECK(it == std::uint64_t(s + 1)); },
                     [](caf::error& e) { FAIL(what(e)); });
      }
      self->request(rank, 10s, rank_api::save_atom::value, dir).receive([](rank_api::save_atom, const std::string&) {},
                                                                      [](caf::error& e) { FAIL(what(e)); });
      self->request(rank, 20s, rank_api::checkpoint_atom::value)
          .receive([&](rank_api::checkpoint_done_atom, const std::string& d, std::uint64_t step) {
                     CHECK(d == dir);
                     CHECK(step == std::uint64_t(steps));
                   },
                   [](caf::error& e) { FAIL(what(e)); });
      // Blocking calls inside a RankCall block the rank's own thread: a consolidated checkpoint
      // (it waits for every update first) and an accumulation pass's wait().
      const auto file = dir + "/consolidated_" + std::to_string(r) + ".safetensors";
      self->request(rank, 20s, rank_api::call_atom::value, rank_api::RankCall{[file](Runtime& x) {
                      x.wait_all_params();
                      x.save_checkpoint(file, 0);
                      x.set_require_sync(false);
                      x.wait();
                      x.set_require_sync(true);
                    }})
          .receive([](rank_api::call_atom) {}, [&](caf::error& e) { call_error[std::size_t(r)] = what(e); });
      // The events sent so far (they are not answers: they may trail the answers a little).
      for (;;) {
        bool got = false;
        self->receive(
            [&](rank_api::step_done_atom, std::uint64_t) { ++step_events[std::size_t(r)], got = true; },
            [&](rank_api::params_ready_atom, std::uint32_t, std::uint64_t) { ++param_events[std::size_t(r)], got = true; },
            [&](rank_api::checkpoint_done_atom, const std::string&, std::uint64_t) { ++checkpoint_events[std::size_t(r)], got = true; },
            caf::after(std::chrono::milliseconds(300)) >> [] {});
        if (!got) break;
      }
  });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(step_events[std::size_t(r)] == steps);
    CHECK(param_events[std::size_t(r)] == steps * int(ranks.rt[std::size_t(r)]->buckets().size()));
    CHECK(checkpoint_events[std::size_t(r)] == 1);
    CHECK(call_error[std::size_t(r)].empty());
  }
  CHECK(std::filesystem::exists(dir + "/index.json"));
  CHECK(std::filesystem::exists(dir + "/consolidated_0.safetensors"));  // rank 0 writes it
}

TEST_CASE("shardflow run: actor_trainer as one process per rank over gloo, world 2, ZeRO-2 -> the parameters of mlp_train's ranks as threads") {
  const auto want = test::scratch("actor_api", "threads.safetensors");
  const auto got = test::scratch("actor_api", "gloo.safetensors");
  auto args = test::mlp_args(2);
  std::vector<std::string> trainer{MLP_TRAIN_PATH, "--world-size", "2", "--save", want};
  trainer.insert(trainer.end(), args.begin(), args.end());
  test::Child threads(trainer, test::no_launch_env());
  REQUIRE(test::exited_ok(threads.wait(120s)));
  std::vector<std::string> job{test::kLauncher, "run", "--nproc-per-node", "2", "--", ACTOR_TRAINER_PATH, "--backend", "gloo", "--save", got};
  job.insert(job.end(), args.begin(), args.end());
  test::Child run(job, test::no_launch_env());
  const auto st = run.wait(120s);
  INFO(run.output());
  REQUIRE(test::exited_ok(st));
  CHECK(run.says("actor_trainer: sizes 24,40,40,6, world 2 (gloo, rank actors)"));
  const auto a = load_safetensors(want), b = load_safetensors(got);
  REQUIRE(a.size() == b.size());
  for (const auto& [name, t] : a) {
    CAPTURE(name);
    const auto x = t.to_f32(name), y = b.at(name).to_f32(name);
    REQUIRE(x.size() == y.size());
    for (std::size_t i = 0; i < x.size(); ++i) CHECK(y[i] == doctest::Approx(x[i]).epsilon(1e-5));  // gloo's ring sums in another order
  }
}

// Note [The actor trainer heals in place] (examples/actor_trainer/rank_trainer.cpp): a trainer made
// of actors goes on in its processes after a lost peer, through rank_api::recover_atom, as
// mlp_train does through Runtime::recover().
TEST_CASE("shardflow run --recovery in-place and shrink, world 3: actor_trainer's rank 1 (or rank 0) killed in step 7 -> the survivors' "
          "rank trainers stop their layer actors, recover through their rank actors, and go on in their first processes: bit for bit "
          "with the uninterrupted job in place over shm, within float rounding of world 3 after shrinking to world 2 over gloo") {
  auto job = [](const std::string& recovery, const std::string& backend, const std::string& fault, const std::string& out, int stage,
                const std::vector<std::string>& extra) {
    const std::string snaps = out + ".snapshots";
    std::filesystem::remove_all(snaps);
    std::string cmd = fault.empty() ? "exec" : "if [ \"$SHARDFLOW_RECOVERY_ROUND\" = 0 ]; then export SHARDFLOW_TEST_FAULT=" + fault + "; fi; exec";
    auto args = test::mlp_args(stage);
    test::set_flag(args, "--steps", "8");
    args.insert(args.begin(), ACTOR_TRAINER_PATH);
    for (const auto& a : {std::string("--backend"), backend, std::string("--save"), out, std::string("--snapshot-dir"), snaps,
                          std::string("--snapshot-every"), std::string("1")})
      args.push_back(a);
    args.insert(args.end(), extra.begin(), extra.end());
    for (const auto& a : args) cmd += " '" + a + "'";
    return std::vector<std::string>{test::kLauncher, "run",          "--nproc-per-node", "3",           "--max-restarts",
                                    "1",             "--recovery",   recovery,           "--heartbeat-timeout", "2",
                                    "--",            "/bin/sh",      "-c",               cmd};
  };
  auto run_ok = [](const std::vector<std::string>& argv) {
    test::Child run(argv, test::no_launch_env());
    const auto st = run.wait(120s);
    INFO(run.output());
    REQUIRE(test::exited_ok(st));
    return run.output();
  };
  // Each survivor recovered in the process it started in: "rank R (pid P)" as the launcher
  // started it, then "rank R (pid P): recovered in place as rank R' of W, going on after step 5".
  auto healed_in_place = [](const std::string& log, int rank, int now, int world) {
    const std::string needle = "rank " + std::to_string(rank) + " (pid ";
    const auto started = log.find(needle);
    REQUIRE(started != std::string::npos);
    const auto from = started + needle.size();
    const std::string pid = log.substr(from, log.find(')', from) - from);
    CHECK(log.find(needle + pid + "): recovered in place as rank " + std::to_string(now) + " of " + std::to_string(world) +
                   ", going on after step 5") != std::string::npos);
  };
  SUBCASE("in place over shm: only rank 1's process starts again") {
    const auto ref = test::scratch("actor_api", "heal_ref.safetensors"), out = test::scratch("actor_api", "healed.safetensors");
    run_ok(job("in-place", "shm", "", ref, 1, {}));
    const auto log = run_ok(job("in-place", "shm", "collective:1:kill:13", out, 1, {}));
    INFO(log);
    CHECK(log.find("recovered in place: every rank joined round 1") != std::string::npos);
    CHECK(log.find("restarting every rank") == std::string::npos);
    for (int r : {0, 2}) healed_in_place(log, r, r, 3);
    test::check_params(out, ref);  // one backend, the same world: bit for bit
  }
  SUBCASE("shrinking over gloo, ZeRO-2 with forward prefetch: no process starts") {
    for (const int killed : {1, 0}) {
      CAPTURE(killed);
      const auto want = test::scratch("actor_api", "shrink_ref.safetensors");
      const auto out = test::scratch("actor_api", "shrunk" + std::to_string(killed) + ".safetensors");
      auto args = test::mlp_args(2);
      test::set_flag(args, "--steps", "8");
      std::vector<std::string> threads{MLP_TRAIN_PATH, "--world-size", "3", "--save", want, "--forward-prefetch"};
      threads.insert(threads.end(), args.begin(), args.end());
      test::Child ref(threads, test::no_launch_env());
      REQUIRE(test::exited_ok(ref.wait(120s)));
      const auto log = run_ok(job("shrink", "gloo", "collective:" + std::to_string(killed) + ":kill:13", out, 2, {"--forward-prefetch"}));
      INFO(log);
      CHECK(log.find("again in round") == std::string::npos);  // nothing started
      healed_in_place(log, killed == 0 ? 1 : 0, 0, 2);
      healed_in_place(log, 2, 1, 2);
      test::check_params(out, want, 1e-5);  // another world's sums
    }
  }
}
