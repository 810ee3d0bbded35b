// One process per rank: `shardflow run` starting mlp_train over shm and Gloo, the launch
// environments of torchrun / Slurm / Open MPI, and what happens when a rank dies or the ranks
// disagree about the model.
#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <signal.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>

#include "examples/mlp/train.hpp"
#include "kernels/cuda/device.hpp"
#include "support/helpers.hpp"
#include "shardflow/launch.hpp"
#include "shardflow/safetensors.hpp"
#include "support/launch_helpers.hpp"
#include "support/subprocess.hpp"

using namespace shardflow;
using namespace std::chrono_literals;
using test::Child;

namespace {

using test::kLauncher;
using test::kTrainer;
using test::mlp_args;
using test::no_launch_env;

std::string scratch(const std::string& name) { return test::scratch("test_launch", name); }

TensorMap in_process(int world, int zero_stage, int steps = 6) {
  mlp::TrainOptions o;
  o.sizes = {24, 40, 40, 6};
  o.steps = steps;
  o.global_batch = 12;
  o.world_size = world;
  o.optimizer.kind = OptimizerConfig::Kind::adamw;
  o.optimizer.lr = 0.01f;
  o.optimizer.weight_decay = 0.01f;
  o.runtime.zero.stage = ZeroStage(zero_stage);
  o.runtime.zero.overlap = zero_stage ? Overlap::interleaved : Overlap::none;
  o.runtime.buckets.first_cap_bytes = o.runtime.buckets.cap_bytes = std::size_t(0.004 * 1048576.0);
  return mlp::train(o).params;
}

// shm sums in rank order like the in-process backend: the same bits. Gloo's ring sums in another
// order: equal to float rounding.
void check_params(const std::string& path, const TensorMap& want, const std::string& backend) {
  const TensorMap got = load_safetensors(path);
  REQUIRE(got.size() == want.size());
  for (const auto& [name, t] : want) {
    CAPTURE(name);
    REQUIRE(got.count(name));
    if (backend == "shm")
      CHECK(got.at(name).to_f32("got") == t.to_f32("want"));
    else
      CHECK(test::rel_error(got.at(name).to_f32("got"), t.to_f32("want")) <= 1e-6);
  }
}

// Ctrl-C to the launcher once its ranks are running; its exit status.
auto interrupt_once_started(Child& job) {
  REQUIRE(job.read_until("started rank 0", 10s));
  std::this_thread::sleep_for(300ms);
  ::kill(job.pid(), SIGINT);
  return job.wait(20s);
}

std::vector<std::string> launch(int nproc, std::vector<std::string> prog) {
  std::vector<std::string> argv{kLauncher, "run", "--nproc-per-node", std::to_string(nproc), "--kill-grace", "2", "--"};
  argv.insert(argv.end(), prog.begin(), prog.end());
  return argv;
}

}  // namespace

// shm sums in rank order like the in-process backend: the same bits. Gloo's ring sums in another
// order at world 3: equal to float rounding.
TEST_CASE("shardflow run: mlp_train over shm and gloo, worlds 2 and 3, ZeRO 0/1/2 -> the in-process parameters") {
  for (int world : {2, 3})
    for (int stage : {0, 1, 2}) {
      const TensorMap want = in_process(world, stage);
      for (std::string backend : {"shm", "gloo"}) {
        CAPTURE(world);
        CAPTURE(stage);
        CAPTURE(backend);
        const std::string out = scratch(backend + "_w" + std::to_string(world) + "_z" + std::to_string(stage) + ".safetensors");
        auto args = mlp_args(stage);
        args.insert(args.begin(), kTrainer);
        for (auto a : {"--backend", backend.c_str(), "--save", out.c_str()}) args.push_back(a);
        Child job(launch(world, args), no_launch_env());
        const auto st = job.wait(120s);
        INFO(job.output());
        REQUIRE(test::exited_ok(st));
        CHECK(job.output().find("[rank 0] mlp_train: sizes 24,40,40,6, world " + std::to_string(world) + " (" + backend + ")") !=
              std::string::npos);
        check_params(out, want, backend);
      }
    }
}

TEST_CASE("shardflow run: kill -9 of one rank mid-training -> the launcher stops the rest and names the rank") {
  auto args = mlp_args(1);
  args.insert(args.begin(), kTrainer);
  test::set_flag(args, "--steps", "100000");
  args.erase(std::find(args.begin(), args.end(), "--quiet"));
  for (auto a : {"--log-every", "1"}) args.push_back(a);  // a progress line per step: the test waits for step 3
  for (auto a : {"--backend", "shm"}) args.push_back(a);
  Child job(launch(2, args), no_launch_env());
  REQUIRE(job.read_until("3/100000", 60s));
  const auto at = job.output().find("rank 1 (pid ");
  REQUIRE(at != std::string::npos);
  const pid_t victim = pid_t(std::atoi(job.output().c_str() + at + 12));
  REQUIRE(victim > 0);
  const double killed_at = job.seconds_since_start();
  ::kill(victim, SIGKILL);
  const auto st = job.wait(30s);
  INFO(job.output());
  REQUIRE(test::failed(st));
  CHECK(job.seconds() - killed_at < 10.0);
  CHECK(job.output().find("FAILED: rank 1 (local rank 1, pid " + std::to_string(victim) + ") was killed by signal 9") !=
        std::string::npos);
  CHECK(WEXITSTATUS(*st) == 128 + 9);
}

TEST_CASE("without a launcher: kill -9 of rank 1 -> rank 0 exits non-zero within the timeout, naming the peer (shm and gloo)") {
  for (std::string backend : {"shm", "gloo"}) {
    CAPTURE(backend);
    const std::string port = std::to_string(test::free_port());  // a fixed or pid-made port can be an ephemeral one in use
    auto args = mlp_args(0);
    args.insert(args.begin(), kTrainer);
    test::set_flag(args, "--steps", "100000");
    test::set_flag(args, "--timeout", "5");
    for (auto a : {"--backend", backend.c_str()}) args.push_back(a);
    auto env = [&](int rank) {
      return std::map<std::string, std::string>{{"RANK", std::to_string(rank)}, {"WORLD_SIZE", "2"},
                                                {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port},
                                                {"SHARDFLOW_STORE_TOKEN", "kill-test"}, {"SHARDFLOW_LAUNCHER", "1"}};
    };
    Child r0(args, env(0));
    Child r1(args, env(1));
    std::this_thread::sleep_for(1500ms);  // well into training
    ::kill(r1.pid(), SIGKILL);
    const double killed_at = r0.seconds_since_start();
    const auto st = r0.wait(30s);
    INFO(r0.output());
    REQUIRE(st.has_value());
    CHECK(test::failed(st));
    CHECK(r0.seconds() - killed_at < 5.0 + 3.0);  // Config::timeouts.collective + a few seconds
    CHECK(r0.output().find("mlp_train: error:") != std::string::npos);
    if (backend == "shm") CHECK(r0.output().find("rank 1 (pid " + std::to_string(r1.pid()) + ") died") != std::string::npos);
  }
}

TEST_CASE("shardflow run: --trace without {rank} -> each rank writes <stem>.rank<r>.json, over the sim link too — trace_merge.py joins them") {
  const std::string trace = scratch("trace.json");
  auto args = mlp_args(1);
  args.insert(args.begin(), kTrainer);
  for (auto a : {"--backend", "sim", "--sim-latency-us", "5", "--sim-gbytes-per-s", "2", "--trace", trace.c_str()}) args.push_back(a);
  Child job(launch(2, args), no_launch_env());
  const auto st = job.wait(60s);
  INFO(job.output());
  REQUIRE(test::exited_ok(st));
  CHECK(job.output().find("world 2 (sim(shm))") != std::string::npos);
  CHECK(!std::filesystem::exists(trace));
  for (int r : {0, 1}) {
    const std::string file = scratch("trace.rank" + std::to_string(r) + ".json");
    CAPTURE(file);
    std::ifstream in(file);
    REQUIRE(in.good());
    const auto j = nlohmann::json::parse(in);
    int reductions = 0;
    for (const auto& e : j.at("traceEvents")) {
      CHECK(e.at("pid").get<int>() == r);  // each file holds its own rank
      reductions += e.value("cat", "") == "reduce";
    }
    CHECK(reductions > 0);
  }
  // The merge tool, where a python3 exists (the project's set-up installs it).
  if (std::system("command -v python3 > /dev/null 2>&1") == 0) {
    const std::string merged = scratch("merged.json");
    const std::string cmd = "python3 " SHARDFLOW_SOURCE_DIR "/tools/trace_merge.py " + scratch("trace.rank0.json") + " " +
                            scratch("trace.rank1.json") + " -o " + merged + " > /dev/null";
    REQUIRE(std::system(cmd.c_str()) == 0);
    std::ifstream in(merged);
    const auto j = nlohmann::json::parse(in);
    std::set<int> ranks;
    for (const auto& e : j.at("traceEvents")) ranks.insert(e.at("pid").get<int>());
    CHECK(ranks == std::set<int>{0, 1});
  }
}

TEST_CASE("an unwritable --trace path stops mlp_train before training, naming the path") {
  Child job({kTrainer, "--sizes", "8,4", "--steps", "3", "--trace", "/nonexistent-dir/t.json"}, no_launch_env());
  const auto st = job.wait(30s);
  INFO(job.output());
  REQUIRE(test::failed(st));
  CHECK(job.output().find("/nonexistent-dir/t.json") != std::string::npos);
  CHECK(job.output().find("step 1/") == std::string::npos);
}

TEST_CASE("shardflow run: two ranks with different models -> a clear error naming the difference, no training") {
  // Rank 1 builds a wider hidden layer than rank 0.
  const std::string script = "if [ \"$RANK\" = 0 ]; then h=40; else h=48; fi; exec \"" + kTrainer +
                             "\" --sizes 24,$h,6 --steps 3 --global-batch 12 --backend gloo --timeout 20";
  Child job(launch(2, {"/bin/sh", "-c", script}), no_launch_env());
  const auto st = job.wait(60s);
  INFO(job.output());
  REQUIRE(test::failed(st));
  CHECK(job.output().find("layers.0.weight") != std::string::npos);
  CHECK(job.output().find("step 1/") == std::string::npos);
}

TEST_CASE("shardflow run: --device cuda where there is no GPU -> every rank stops with an error naming NCCL, no hang") {
  if (cuda::device_count() > 0) return;  // on a GPU machine this job would train (test_cuda_comm covers it)
  auto args = mlp_args(0);
  args.insert(args.begin(), {kTrainer, "--device", "cuda"});
  Child job(launch(2, args), no_launch_env());
  const auto st = job.wait(60s);
  INFO(job.output());
  REQUIRE(test::failed(st));
  CHECK(job.output().find("FAILED: rank") != std::string::npos);
  CHECK(job.output().find("nccl") != std::string::npos);  // "sees no CUDA device" or "built without NCCL"
  CHECK(job.seconds() < 30);
}

TEST_CASE("shardflow run: a failing rank's exit status and SIGINT are passed on") {
  SUBCASE("rank 1 exits 3 -> launcher exits 3, names rank 1") {
    Child job(launch(2, {"/bin/sh", "-c", "if [ \"$RANK\" = 1 ]; then exit 3; fi; exec sleep 30"}), no_launch_env());
    const auto st = job.wait(20s);
    INFO(job.output());
    REQUIRE(st.has_value());
    CHECK(WEXITSTATUS(*st) == 3);
    CHECK(job.output().find("FAILED: rank 1 (local rank 1") != std::string::npos);
    CHECK(job.seconds() < 10);
  }
  SUBCASE("SIGINT to the launcher reaches every rank; exit 130") {
    Child job(launch(2, {"/bin/sh", "-c", "trap 'echo rank $RANK got INT; exit 0' INT; while true; do sleep 0.05; done"}),
              no_launch_env());
    const auto st = interrupt_once_started(job);
    INFO(job.output());
    REQUIRE(st.has_value());
    CHECK(WEXITSTATUS(*st) == 130);
    CHECK(job.output().find("[rank 0] rank 0 got INT") != std::string::npos);
    CHECK(job.output().find("[rank 1] rank 1 got INT") != std::string::npos);
  }
  SUBCASE("rank environment: torchrun's variables and the prefix") {
    Child job(launch(3, {"/bin/sh", "-c", "echo $RANK/$WORLD_SIZE $LOCAL_RANK/$LOCAL_WORLD_SIZE $MASTER_ADDR"}), no_launch_env());
    REQUIRE(test::exited_ok(job.wait(20s)));
    for (int r = 0; r < 3; ++r)
      CHECK(job.output().find("[rank " + std::to_string(r) + "] " + std::to_string(r) + "/3 " + std::to_string(r) + "/3 127.0.0.1") !=
            std::string::npos);
  }
}

TEST_CASE("launch environment: torchrun, Slurm and Open MPI variables — malformed values named") {
  auto detect = [](std::map<std::string, std::string> vars) {
    return LaunchEnv::detect([vars](const char* k) -> const char* {
      auto it = vars.find(k);
      return it == vars.end() ? nullptr : it->second.c_str();
    });
  };
  SUBCASE("nothing set: one process, world 1") {
    const auto e = detect({});
    CHECK(!e.launched());
    CHECK(e.world_size == 1);
  }
  SUBCASE("torchrun: the store moves off the agent's MASTER_PORT") {
    const auto e = detect({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
                           {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29500"}, {"TORCHELASTIC_RUN_ID", "abc"}});
    CHECK(e.source == "torchrun");
    CHECK(e.rank == 3);
    CHECK(e.world_size == 8);
    CHECK(e.local_rank == 1);
    CHECK(!e.single_host());
    CHECK(e.master_addr == "10.0.0.1");
    CHECK(e.store_port == 29501);
    CHECK(e.token == "torchrun-abc");
  }
  SUBCASE("torchrun --standalone: an agent port in the ephemeral range puts the store below that range, the same for every rank of the run") {
    long first_ephemeral = 32768;
    std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> first_ephemeral;
    auto standalone = [&](const char* rank, const char* run_id) {
      return detect({{"RANK", rank}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(first_ephemeral + 100)},
                     {"TORCHELASTIC_RUN_ID", run_id}});
    };
    const auto r0 = standalone("0", "run-one"), r1 = standalone("1", "run-one"), other = standalone("0", "run-two");
    CHECK(r0.store_port >= 20000);
    CHECK(r0.store_port < first_ephemeral);
    CHECK(r1.store_port == r0.store_port);
    CHECK(other.store_port != r0.store_port);
  }
  SUBCASE("the worker group's generation: shardflow run's SHARDFLOW_RESTART_COUNT, else torchrun's; malformed named") {
    std::map<std::string, std::string> base{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}};
    CHECK(detect(base).restart_count == 0);
    auto torchrun = base;
    torchrun["TORCHELASTIC_RESTART_COUNT"] = "2";
    CHECK(detect(torchrun).restart_count == 2);
    auto ours = torchrun;
    ours["SHARDFLOW_RESTART_COUNT"] = "1";
    CHECK(detect(ours).restart_count == 1);
    ours["SHARDFLOW_RESTART_COUNT"] = "x";
    CHECK_THROWS_WITH_AS(detect(ours), doctest::Contains("SHARDFLOW_RESTART_COUNT='x' is not an integer"), UsageError);
  }
  SUBCASE("shardflow run: the launcher serves the store") {
    const auto e = detect({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"SHARDFLOW_LAUNCHER", "1"}, {"SHARDFLOW_STORE_HOSTED", "1"},
                           {"SHARDFLOW_STORE_TOKEN", "tok"}, {"MASTER_PORT", "4000"}});
    CHECK(e.source == "shardflow run");
    CHECK(e.store_hosted);
    CHECK(e.store_port == 4000);
    CHECK(e.token == "tok");
    CHECK(e.single_host());
  }
  SUBCASE("srun: SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, port from the job id") {
    const auto e = detect({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"}, {"SLURM_NNODES", "2"},
                           {"SLURM_TASKS_PER_NODE", "4(x2)"}, {"SLURM_JOB_ID", "123456"}, {"MASTER_ADDR", "node01"}});
    CHECK(e.source == "slurm");
    CHECK(e.rank == 5);
    CHECK(e.world_size == 8);
    CHECK(e.local_world_size == 4);
    CHECK(e.store_port == 20000 + 123456 % 20000);
    CHECK(e.token == "slurm-123456-0");
  }
  SUBCASE("mpirun: OMPI_COMM_WORLD_*") {
    const auto e = detect({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                           {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
    CHECK(e.source == "openmpi");
    CHECK(e.rank == 2);
    CHECK(e.single_host());
    CHECK(e.master_addr == "127.0.0.1");
  }
  SUBCASE("errors name the variable") {
    CHECK_THROWS_WITH_AS(detect({{"RANK", "x1"}, {"WORLD_SIZE", "2"}}), doctest::Contains("RANK='x1' is not an integer"), UsageError);
    CHECK_THROWS_WITH_AS(detect({{"RANK", "2"}, {"WORLD_SIZE", "2"}}), doctest::Contains("rank 2 is not below the world size 2"),
                         UsageError);
    CHECK_THROWS_WITH_AS(detect({{"RANK", "0"}}), doctest::Contains("WORLD_SIZE is not set"), UsageError);
    CHECK_THROWS_WITH_AS(detect({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_NNODES", "2"}, {"SLURM_TASKS_PER_NODE", "2(x2)"}}),
                         doctest::Contains("MASTER_ADDR is not set"), UsageError);
  }
}

TEST_CASE("killed in the middle of a sharded save (its shards written, its index not): the previous checkpoint loads, at another world size") {
  const auto dir = std::filesystem::temp_directory_path() / ("sf_kill_save_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  auto env = no_launch_env();
  env["SHARDFLOW_TEST_KILL_BEFORE_INDEX"] = "2";  // the save after step 4 dies; the one after step 2 stands
  Child job({kTrainer, "--sizes", "24,40,6", "--steps", "6", "--global-batch", "12", "--world-size", "2", "--zero-stage", "2",
             "--optimizer", "adamw", "--save-checkpoint", dir.string(), "--sharded-checkpoint", "--every", "2"},
            env);
  const auto st = job.wait(60s);
  INFO(job.output());
  REQUIRE(test::failed(st));
  REQUIRE(std::filesystem::exists(dir / "index.json"));
  const auto index = nlohmann::json::parse(std::ifstream(dir / "index.json"));
  CHECK(index.at("steps") == 2);
  // The dead save's files lie beside the ones the index names; they are not used.
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) files += e.path().extension() == ".safetensors";
  CHECK(files == 4);
  Child resumed({kTrainer, "--sizes", "24,40,6", "--steps", "2", "--global-batch", "12", "--world-size", "3", "--zero-stage", "1",
                 "--optimizer", "adamw", "--resume", dir.string()},
                [] {
                  auto e = no_launch_env();
                  e["SHARDFLOW_LOG_LEVEL"] = "info";  // the load's log line says how many steps it restored
                  return e;
                }());
  const auto rs = resumed.wait(60s);
  INFO(resumed.output());
  CHECK_FALSE(test::failed(rs));
  CHECK(resumed.output().find("2 optimizer step(s)") != std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST_CASE("shardflow run takes torchrun's underscore spellings, and names a torchrun flag it does not take with what to do instead") {
  auto run = [](const std::string& args) {
    std::string out;
    FILE* p = ::popen((test::kLauncher + " run " + args + " 2>&1").c_str(), "r");
    REQUIRE(p);
    char buf[512];
    while (std::fgets(buf, sizeof buf, p)) out += buf;
    const int status = ::pclose(p);
    return std::make_pair(WIFEXITED(status) ? WEXITSTATUS(status) : -1, out);
  };
  const auto [ok, out] = run("--nproc_per_node=2 --master_port " + std::to_string(test::free_port()) + " -- /bin/sh -c 'echo rank=$RANK of $WORLD_SIZE'");
  CHECK(ok == 0);
  CHECK(out.find("rank=0 of 2") != std::string::npos);
  CHECK(out.find("rank=1 of 2") != std::string::npos);
  const auto [bad, why] = run("--standalone --nproc_per_node 2 -- /bin/true");
  CHECK(bad == 2);
  CHECK(why.find("--standalone is torchrun's; one node is the default: drop it") != std::string::npos);
  const auto [unknown, what] = run("--nproc_per_node 2 --frobnicate 1 -- /bin/true");
  CHECK(unknown == 2);
  CHECK(what.find("unknown flag --frobnicate") != std::string::npos);
}

// Note [Restarting the worker group]
TEST_CASE("shardflow run --max-restarts: a rank that fails starts every rank again in a new generation — used up -> the failure, named") {
  auto with_restarts = [](int nproc, int restarts, std::vector<std::string> prog) {
    auto argv = launch(nproc, std::move(prog));
    argv.insert(argv.begin() + 2, {"--max-restarts", std::to_string(restarts)});
    return argv;
  };
  SUBCASE("rank 1 killed in generation 0 -> generation 1 runs every rank, the job exits 0") {
    Child job(with_restarts(2, 2, {"/bin/sh", "-c",
                                   "if [ \"$SHARDFLOW_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 1 ]; then kill -9 $$; fi; "
                                   "echo rank $RANK generation $SHARDFLOW_RESTART_COUNT/$TORCHELASTIC_MAX_RESTARTS torchrun $TORCHELASTIC_RESTART_COUNT"}),
              no_launch_env());
    const auto st = job.wait(30s);
    INFO(job.output());
    REQUIRE(test::exited_ok(st));
    CHECK(job.output().find("rank 1 (local rank 1, pid ") != std::string::npos);
    CHECK(job.output().find("was killed by signal 9") != std::string::npos);
    CHECK(job.output().find("restarting every rank (1 of 2 restarts)") != std::string::npos);
    CHECK(job.output().find("; restart 1 of 2") != std::string::npos);
    for (int r : {0, 1})
      CHECK(job.output().find("[rank " + std::to_string(r) + "] rank " + std::to_string(r) + " generation 1/2 torchrun 1") !=
            std::string::npos);
    CHECK(job.output().find("restart 2 of 2") == std::string::npos);
  }
  SUBCASE("rank 1 fails every time -> restarts used up: its exit status, the rank and the count named") {
    Child job(with_restarts(2, 2, {"/bin/sh", "-c", "if [ \"$RANK\" = 1 ]; then exit 3; fi; exec sleep 30"}), no_launch_env());
    const auto st = job.wait(60s);
    INFO(job.output());
    REQUIRE(st.has_value());
    CHECK(WEXITSTATUS(*st) == 3);
    CHECK(job.output().find("restarting every rank (2 of 2 restarts)") != std::string::npos);
    CHECK(job.output().find("FAILED: rank 1 (local rank 1") != std::string::npos);
    CHECK(job.output().find("restarts used up (2 of 2)") != std::string::npos);
  }
  SUBCASE("Ctrl-C ends the job instead of restarting it") {
    Child job(with_restarts(2, 3, {"/bin/sh", "-c", "trap 'exit 1' INT; while true; do sleep 0.05; done"}), no_launch_env());
    const auto st = interrupt_once_started(job);
    INFO(job.output());
    REQUIRE(st.has_value());
    CHECK(WEXITSTATUS(*st) == 130);
    CHECK(job.output().find("restarting") == std::string::npos);
  }
  SUBCASE("training over shm and gloo: rank 1 killed at its 3rd collective in generation 0 -> the rendezvous of generation 1 "
          "on the same store, and the parameters of an uninterrupted run") {
    // No snapshot yet: generation 1 trains from the start, so it must end where world 2 in process ends.
    const TensorMap want = in_process(2, 1);
    for (std::string backend : {"shm", "gloo"}) {
      CAPTURE(backend);
      const std::string out = scratch("restart_" + backend + ".safetensors");
      std::string cmd = "if [ \"$SHARDFLOW_RESTART_COUNT\" = 0 ]; then export SHARDFLOW_TEST_FAULT=collective:1:kill:3; fi; exec";
      auto args = mlp_args(1);
      args.insert(args.begin(), kTrainer);
      for (auto a : {"--backend", backend.c_str(), "--save", out.c_str()}) args.push_back(a);
      for (const auto& a : args) cmd += " '" + a + "'";
      Child job(with_restarts(2, 1, {"/bin/sh", "-c", cmd}), no_launch_env());
      const auto st = job.wait(120s);
      INFO(job.output());
      REQUIRE(test::exited_ok(st));
      CHECK(job.output().find("restarting every rank (1 of 1 restarts)") != std::string::npos);
      check_params(out, want, backend);
    }
  }
}

// Note [Snapshots], Note [Snapshots in memory]
TEST_CASE("shardflow run --max-restarts with a snapshot every step, every 3rd on disk: rank 1 killed in step 7 -> resumed "
          "from step 5 in the launcher's memory, or from step 3 on disk when the memory is lost — the parameters of an "
          "uninterrupted run (bit for bit over shm)") {
  const TensorMap want = in_process(2, 1, 8);
  struct Case {
    std::string backend;
    bool lose_memory;  // generation 1 starts with the launcher's memory emptied
    int resumed;
  };
  for (const auto& c : {Case{"shm", false, 5}, Case{"gloo", false, 5}, Case{"shm", true, 3}}) {
    CAPTURE(c.backend);
    CAPTURE(c.lose_memory);
    const std::string tag = c.backend + (c.lose_memory ? "_lost" : "");
    const std::string snaps = scratch("snapshots_" + tag), out = scratch("snapshots_" + tag + ".safetensors");
    std::filesystem::remove_all(snaps);
    // Two collectives a step (reduce-scatter, all-gather): the 13th is in step 7, when the
    // snapshot of step 6 (on disk) is still being completed; step 5's (in memory) is the newest
    // complete one, step 3's the newest on disk.
    std::string cmd = "if [ \"$SHARDFLOW_RESTART_COUNT\" = 0 ]; then export SHARDFLOW_TEST_FAULT=collective:1:kill:13; ";
    if (c.lose_memory) cmd += "else rm -rf \"$SHARDFLOW_SNAPSHOT_MEMORY\"/step-*; ";
    cmd += "fi; SHARDFLOW_LOG_LEVEL=info exec";  // the runtime's "resumed from" line
    auto args = mlp_args(1);
    args.insert(args.begin(), kTrainer);
    test::set_flag(args, "--steps", "8");
    for (auto a : {"--backend", c.backend.c_str(), "--save", out.c_str(), "--snapshot-dir", snaps.c_str(), "--snapshot-every", "1",
                   "--snapshot-disk-every", "3"})
      args.push_back(a);
    for (const auto& a : args) cmd += " '" + a + "'";
    auto argv = launch(2, {"/bin/sh", "-c", cmd});
    argv.insert(argv.begin() + 2, {"--max-restarts", "1"});
    Child job(argv, no_launch_env());
    const std::string memory = "/dev/shm/shardflow-snapshots-" + std::to_string(job.pid());
    const auto st = job.wait(120s);
    INFO(job.output());
    REQUIRE(test::exited_ok(st));
    CHECK(job.output().find("restarting every rank (1 of 1 restarts)") != std::string::npos);
    const std::string resumed = "resumed from the snapshot of step " + std::to_string(c.resumed) + (c.lose_memory ? " on disk" : " in memory");
    CHECK(job.output().find(resumed) != std::string::npos);
    CHECK(job.output().find("[rank 0] done: " + std::to_string(8 - c.resumed) + " steps") != std::string::npos);
    // Only every 3rd step's snapshot went to disk; the launcher's memory is gone with the job.
    CHECK(std::filesystem::exists(snaps + "/step-6/index.json"));
    CHECK(!std::filesystem::exists(snaps + "/step-5"));
    CHECK(!std::filesystem::exists(snaps + "/step-7"));
    CHECK(!std::filesystem::exists(memory));
    check_params(out, want, c.backend);
  }
}

TEST_CASE("world 3 over Gloo: rank 2 killed in step 7 -> resumed from step 5's snapshot, which lays the buckets out as the "
          "saved run had rebuilt them, so the job ends bit for bit where the same job ends uninterrupted") {
  // Gloo's ring adds a bucket's elements in an order that depends on where they lie; at world 3
  // that shows in the last bits. Rebuilding the buckets after the resumed run's first iteration
  // (instead of taking the snapshot's) measured a difference in every case of the failure matrix.
  auto job_for = [](const std::string& out, const std::string& snaps, bool fault) {
    std::string cmd = fault ? "if [ \"$SHARDFLOW_RESTART_COUNT\" = 0 ]; then export SHARDFLOW_TEST_FAULT=collective:2:kill:13; fi; exec"
                            : "exec";
    auto args = mlp_args(1);
    args.insert(args.begin(), kTrainer);
    test::set_flag(args, "--steps", "8");
    for (auto a : {"--backend", "gloo", "--save", out.c_str(), "--snapshot-dir", snaps.c_str(), "--snapshot-every", "1"}) args.push_back(a);
    for (const auto& a : args) cmd += " '" + a + "'";
    auto argv = launch(3, {"/bin/sh", "-c", cmd});
    argv.insert(argv.begin() + 2, {"--max-restarts", "1"});
    return argv;
  };
  const std::string ref = scratch("w3_ref.safetensors"), out = scratch("w3_healed.safetensors");
  const std::string ref_snaps = scratch("w3_ref_snaps"), snaps = scratch("w3_snaps");
  std::filesystem::remove_all(ref_snaps);
  std::filesystem::remove_all(snaps);
  {
    Child job(job_for(ref, ref_snaps, false), no_launch_env());
    const auto st = job.wait(120s);
    INFO(job.output());
    REQUIRE(test::exited_ok(st));
  }
  Child job(job_for(out, snaps, true), no_launch_env());
  const auto st = job.wait(120s);
  INFO(job.output());
  REQUIRE(test::exited_ok(st));
  CHECK(job.output().find("restarting every rank (1 of 1 restarts)") != std::string::npos);
  CHECK(job.output().find("[rank 0] done: 3 steps") != std::string::npos);  // 6 to 8, after step 5's snapshot
  check_params(out, load_safetensors(ref), "shm");  // "shm": bit for bit
}

namespace {
// Runs a launcher job that must succeed; its output.
std::string run_ok(const std::vector<std::string>& argv) {
  Child job(argv, no_launch_env());
  const auto st = job.wait(120s);
  INFO(job.output());
  REQUIRE(test::exited_ok(st));
  return job.output();
}
}  // namespace

// Note [Recovering in place]
TEST_CASE("shardflow run --recovery in-place, world 3: rank 1 killed (kill -9) or stopped (SIGSTOP) in step 7 -> only its "
          "process starts again — ranks 0 and 2 keep theirs, reload step 5's snapshot with it, and the job ends bit for bit "
          "where the same job ends uninterrupted (shm and gloo)") {
  auto job_for = [](const std::string& backend, const std::string& out, const std::string& snaps, const char* fault) {
    // The fault only in the first process of rank 1: its replacement starts in round 1.
    std::string cmd = fault ? "if [ \"$SHARDFLOW_RECOVERY_ROUND\" = 0 ]; then export SHARDFLOW_TEST_FAULT=collective:1:" +
                                  std::string(fault) + ":13; fi; exec"
                            : "exec";
    auto args = mlp_args(1);
    args.insert(args.begin(), kTrainer);
    test::set_flag(args, "--steps", "8");
    for (auto a : {"--backend", backend.c_str(), "--save", out.c_str(), "--snapshot-dir", snaps.c_str(), "--snapshot-every", "1"})
      args.push_back(a);
    for (const auto& a : args) cmd += " '" + a + "'";
    auto argv = launch(3, {"/bin/sh", "-c", cmd});
    argv.insert(argv.begin() + 2, {"--max-restarts", "1", "--recovery", "in-place", "--heartbeat-timeout", "2"});
    return argv;
  };
  for (const std::string backend : {"shm", "gloo"}) {
    CAPTURE(backend);
    const std::string ref = scratch("in_place_ref_" + backend + ".safetensors"), ref_snaps = scratch("in_place_ref_snaps_" + backend);
    std::filesystem::remove_all(ref_snaps);
    run_ok(job_for(backend, ref, ref_snaps, nullptr));
    for (const std::string fault : {"kill", "stop"}) {
      if (backend == "gloo" && fault == "stop") continue;  // the launcher's part is the backend's same
      CAPTURE(fault);
      const std::string out = scratch("in_place_" + backend + "_" + fault + ".safetensors");
      const std::string snaps = scratch("in_place_snaps_" + backend + "_" + fault);
      std::filesystem::remove_all(snaps);
      const std::string log = run_ok(job_for(backend, out, snaps, fault.c_str()));
      INFO(log);
      CHECK(log.find("recovering in place (round 1, 1 of 1 restarts)") != std::string::npos);
      CHECK(log.find("recovered in place: every rank joined round 1") != std::string::npos);
      CHECK(log.find("restarting every rank") == std::string::npos);
      if (fault == "stop") CHECK(log.find("has been stopped for longer than --heartbeat-timeout") != std::string::npos);
      // The survivors are the processes the launcher started first.
      for (int r : {0, 2}) {
        const std::string needle = "rank " + std::to_string(r) + " (pid ";
        const auto started = log.find(needle);
        REQUIRE(started != std::string::npos);
        const auto from = started + needle.size();
        const std::string pid = log.substr(from, log.find(')', from) - from);
        CHECK(log.find("rank " + std::to_string(r) + " (pid " + pid + "): recovered in place as rank " + std::to_string(r) +
                       " of 3, going on after step 5") != std::string::npos);
      }
      CHECK(log.find("[rank 1] rank 1 (pid") == std::string::npos);  // the replacement resumed as a fresh process does
      check_params(out, load_safetensors(ref), "shm");  // "shm": bit for bit
    }
  }
}

// Note [A rank dead inside the barrier]
TEST_CASE("shardflow run --recovery in-place, world 3 over shm: rank 1 killed inside a barrier, its arrival marked but not "
          "counted -> ranks 0 and 2 name its death at once (not the 20 s collective timeout) and go on in place") {
  const std::string out = scratch("barrier_kill.safetensors"), snaps = scratch("barrier_kill_snaps");
  std::filesystem::remove_all(snaps);
  auto args = mlp_args(1);
  args.insert(args.begin(), kTrainer);
  test::set_flag(args, "--steps", "8");
  for (auto a : {"--backend", "shm", "--save", out.c_str(), "--snapshot-dir", snaps.c_str(), "--snapshot-every", "1"}) args.push_back(a);
  // Rank 1's 150th barrier falls in step 7; its replacement (round 1) runs clean.
  std::string cmd = "if [ \"$SHARDFLOW_RECOVERY_ROUND\" = 0 ]; then export SHARDFLOW_TEST_FAULT=barrier:1:kill:150; fi; exec";
  for (const auto& a : args) cmd += " '" + a + "'";
  auto argv = launch(3, {"/bin/sh", "-c", cmd});
  argv.insert(argv.begin() + 2, {"--max-restarts", "1", "--recovery", "in-place", "--heartbeat-timeout", "2"});
  const std::string log = run_ok(argv);
  INFO(log);
  CHECK(log.find("shardflow test fault: rank 1 dies at barrier #150") != std::string::npos);
  CHECK(log.find(") died before it reached this collective") != std::string::npos);
  CHECK(log.find("did not arrive within") == std::string::npos);
  // "recovered in place: every rank joined round 1 0.10 s after the loss"; the collective timeout is 20 s.
  const std::string joined = "recovered in place: every rank joined round 1 ";
  const auto at = log.find(joined);
  REQUIRE(at != std::string::npos);
  CHECK(std::atof(log.c_str() + at + joined.size()) < 10.0);
}

// Note [Going on from the twins]
TEST_CASE("shardflow run --recovery in-place with --redundancy 2, world 3 (shm and gloo): rank 1 killed in step 7 -> its "
          "replacement gets its shard from its twin on rank 2 and the parameters from the survivors' memory, every rank goes on "
          "after the last finished step (snapshots alone would give step 4), and the job ends bit for bit where it ends "
          "uninterrupted, and under --recovery shrink the survivors go on at world 2 from there, within float rounding") {
  auto job_for = [](const std::string& backend, const std::string& out, const std::string& snaps, bool fault, const char* recovery) {
    std::string cmd = fault ? "if [ \"$SHARDFLOW_RECOVERY_ROUND\" = 0 ]; then export SHARDFLOW_TEST_FAULT=collective:1:kill:13; fi; exec"
                            : "exec";
    auto args = mlp_args(1);
    args.insert(args.begin(), kTrainer);
    test::set_flag(args, "--steps", "8");
    for (auto a : {"--backend", backend.c_str(), "--save", out.c_str(), "--snapshot-dir", snaps.c_str(), "--snapshot-every", "2",
                   "--redundancy", "2"})
      args.push_back(a);
    for (const auto& a : args) cmd += " '" + a + "'";
    auto argv = launch(3, {"/bin/sh", "-c", cmd});
    argv.insert(argv.begin() + 2, {"--max-restarts", "1", "--recovery", recovery});
    return argv;
  };
  // The step every rank goes on after, from the survivors' lines.
  auto going_on_after = [](const std::string& log) {
    const std::string needle = ", going on after step ";
    const auto at = log.find(needle);
    return at == std::string::npos ? -1 : std::stoi(log.substr(at + needle.size()));
  };
  for (const std::string backend : {"shm", "gloo"}) {
    CAPTURE(backend);
    const std::string ref = scratch("twins_ref_" + backend + ".safetensors"), ref_snaps = scratch("twins_ref_snaps_" + backend);
    std::filesystem::remove_all(ref_snaps);
    run_ok(job_for(backend, ref, ref_snaps, false, "in-place"));
    const std::string out = scratch("twins_" + backend + ".safetensors"), snaps = scratch("twins_snaps_" + backend);
    std::filesystem::remove_all(snaps);
    const std::string log = run_ok(job_for(backend, out, snaps, true, "in-place"));
    INFO(log);
    CHECK(log.find("recovering in place (round 1, 1 of 1 restarts)") != std::string::npos);
    CHECK(log.find("twins: resumed after step") != std::string::npos);
    CHECK(log.find("1 of the old round's 3 shard(s) from their twins") != std::string::npos);
    CHECK(going_on_after(log) >= 5);  // the step in flight discarded, none before it
    check_params(out, load_safetensors(ref), "shm");  // "shm": bit for bit
  }
  const TensorMap want = in_process(3, 1, 8);
  const std::string out = scratch("twins_shrink.safetensors"), snaps = scratch("twins_shrink_snaps");
  std::filesystem::remove_all(snaps);
  const std::string log = run_ok(job_for("shm", out, snaps, true, "shrink"));
  INFO(log);
  CHECK(log.find("recovered in place as rank 1 of 2, going on after step") != std::string::npos);
  CHECK(log.find("twins: resumed after step") != std::string::npos);
  CHECK(going_on_after(log) >= 5);
  check_params(out, want, "gloo");  // another world's sums: equal to float rounding
}

// Note [Syncs from the twin]: at world 2 each bucket's sync is its shift to the twin
TEST_CASE("shardflow run --recovery in-place with --redundancy 2, world 2 (shm, each rank a host of its own): rank 1 killed as a sync starts (the shift to "
          "its twin) -> its replacement gets its shard from its twin on rank 0, every rank goes on after the last finished step, "
          "and the job ends bit for bit where it ends uninterrupted") {
  auto job_for = [](const std::string& out, const std::string& snaps, bool fault) {
    // Each rank as a host of its own (LOCAL_WORLD_SIZE 1, LOCAL_RANK 0), where the twins give the syncs.
    std::string cmd = fault ? "export LOCAL_WORLD_SIZE=1 LOCAL_RANK=0; if [ \"$SHARDFLOW_RECOVERY_ROUND\" = 0 ]; then export SHARDFLOW_TEST_FAULT=sync:1:kill:13; fi; exec"
                            : "export LOCAL_WORLD_SIZE=1 LOCAL_RANK=0; exec";
    auto args = mlp_args(1);
    args.insert(args.begin(), kTrainer);
    test::set_flag(args, "--steps", "8");
    for (auto a : {"--backend", "shm", "--save", out.c_str(), "--snapshot-dir", snaps.c_str(), "--snapshot-every", "2", "--redundancy", "2"})
      args.push_back(a);
    for (const auto& a : args) cmd += " '" + a + "'";
    auto argv = launch(2, {"/bin/sh", "-c", cmd});
    argv.insert(argv.begin() + 2, {"--max-restarts", "1", "--recovery", "in-place"});
    return argv;
  };
  const std::string ref = scratch("twin_syncs_ref.safetensors"), ref_snaps = scratch("twin_syncs_ref_snaps");
  std::filesystem::remove_all(ref_snaps);
  run_ok(job_for(ref, ref_snaps, false));
  const std::string out = scratch("twin_syncs.safetensors"), snaps = scratch("twin_syncs_snaps");
  std::filesystem::remove_all(snaps);
  const std::string log = run_ok(job_for(out, snaps, true));
  INFO(log);
  CHECK(log.find("recovering in place (round 1, 1 of 1 restarts)") != std::string::npos);
  CHECK(log.find("1 of the old round's 2 shard(s) from their twins") != std::string::npos);
  const std::string needle = ", going on after step ";
  const auto at = log.find(needle);
  REQUIRE(at != std::string::npos);
  CHECK(std::stoi(log.substr(at + needle.size())) >= 5);  // the step in flight discarded, none before it (snapshots: 4)
  check_params(out, load_safetensors(ref), "shm");  // "shm": bit for bit
}

// Note [Recovering in place]: nothing to go back to
TEST_CASE("shardflow run --recovery in-place, world 3, no snapshot complete yet: rank 1 killed in step 3 -> the survivors' "
          "recover() refuses by name (their parameters moved, the replacement's are the initial ones), they start again "
          "(a second round, or every rank), and the job ends bit for bit where it ends uninterrupted — with --max-restarts 1 "
          "too: the refused round counts as no restart, so every rank restarts once") {
  std::string restarts = "2";
  SUBCASE("--max-restarts 2") {}
  // Note [A round that did not heal]: the round counted, no restart was left and the job failed.
  SUBCASE("--max-restarts 1") { restarts = "1"; }
  auto job_for = [&restarts](const std::string& out, bool fault) {
    std::string cmd = fault ? "if [ \"$SHARDFLOW_RESTART_COUNT\" = 0 ] && [ \"$SHARDFLOW_RECOVERY_ROUND\" = 0 ]; then export "
                              "SHARDFLOW_TEST_FAULT=collective:1:kill:5; fi; exec"
                            : "exec";
    auto args = mlp_args(1);
    args.insert(args.begin(), kTrainer);
    test::set_flag(args, "--steps", "6");
    const std::string snaps = out + ".snapshots";
    std::filesystem::remove_all(snaps);
    for (auto a : {"--backend", "shm", "--save", out.c_str(), "--snapshot-dir", snaps.c_str(), "--snapshot-every", "100"})
      args.push_back(a);
    for (const auto& a : args) cmd += " '" + a + "'";
    auto argv = launch(3, {"/bin/sh", "-c", cmd});
    argv.insert(argv.begin() + 2, {"--max-restarts", restarts, "--recovery", "in-place"});
    return argv;
  };
  const std::string ref = scratch("in_place_early_ref.safetensors"), out = scratch("in_place_early.safetensors");
  {
    Child job(job_for(ref, false), no_launch_env());
    INFO(job.output());
    REQUIRE(test::exited_ok(job.wait(120s)));
  }
  Child job(job_for(out, true), no_launch_env());
  const auto st = job.wait(120s);
  INFO(job.output());
  REQUIRE(test::exited_ok(st));
  CHECK(job.says("recovering in place (round 1"));
  CHECK(job.says(": no complete snapshot to go back to yet, and this rank's parameters moved through 2 iteration(s) since the start"));
  // The refusing survivors exit: the launcher starts them again, in a second round (where rank 1's
  // replacement has not moved yet) or with every rank.
  CHECK((job.says("restarting every rank") || job.says("recovering in place (round 2, 2 of 2 restarts)")));
  if (restarts == "1") {
    CHECK(job.says("so that round counts as no restart"));
    CHECK(job.says("restarting every rank (1 of 1 restarts)"));
  }
  check_params(out, load_safetensors(ref), "shm");  // "shm": bit for bit
}

// Note [Recovering in place], shrinking
TEST_CASE("shardflow run --recovery shrink, world 3: rank 1 or rank 0 killed in step 7 -> no process starts — the two "
          "survivors are numbered 0 and 1, reload step 5's snapshot at world 2 and end within float rounding of the "
          "uninterrupted world-3 run (the global batch unchanged, each rank's share larger)") {
  const TensorMap want = in_process(3, 1, 8);
  struct Case {
    std::string backend;
    int killed;
  };
  for (const auto& c : {Case{"shm", 1}, Case{"shm", 0}, Case{"gloo", 1}}) {
    CAPTURE(c.backend);
    CAPTURE(c.killed);
    const std::string tag = c.backend + std::to_string(c.killed);
    const std::string out = scratch("shrink_" + tag + ".safetensors"), snaps = scratch("shrink_snaps_" + tag);
    std::filesystem::remove_all(snaps);
    std::string cmd = "SHARDFLOW_TEST_FAULT=collective:" + std::to_string(c.killed) + ":kill:13 exec";
    auto args = mlp_args(1);
    args.insert(args.begin(), kTrainer);
    test::set_flag(args, "--steps", "8");
    for (auto a : {"--backend", c.backend.c_str(), "--save", out.c_str(), "--snapshot-dir", snaps.c_str(), "--snapshot-every", "1"})
      args.push_back(a);
    for (const auto& a : args) cmd += " '" + a + "'";
    auto argv = launch(3, {"/bin/sh", "-c", cmd});
    argv.insert(argv.begin() + 2, {"--max-restarts", "1", "--recovery", "shrink"});
    Child job(argv, no_launch_env());
    const auto st = job.wait(120s);
    const std::string log = job.output();
    INFO(log);
    REQUIRE(test::exited_ok(st));
    CHECK(log.find("recovering in place (round 1, 1 of 1 restarts): the other ranks keep running, at world 2 from now on") !=
          std::string::npos);
    CHECK(log.find("recovered in place: every rank joined round 1") != std::string::npos);
    CHECK(log.find("again in round") == std::string::npos);  // nothing started
    const int a = c.killed == 0 ? 1 : 0, b = 2;
    CHECK(log.find("rank " + std::to_string(a) + " (pid") != std::string::npos);
    CHECK(log.find("recovered in place as rank 0 of 2, going on after step 5") != std::string::npos);
    CHECK(log.find("rank " + std::to_string(b) + " (pid") != std::string::npos);
    CHECK(log.find("recovered in place as rank 1 of 2, going on after step 5") != std::string::npos);
    check_params(out, want, "gloo");  // another world's sums: equal to float rounding
  }
}
