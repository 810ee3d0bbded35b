// Bad input everywhere a user types: every flag of mlp_train and shardflow (run, plan) with an
// invalid value, Config fields with invalid values, and every file input (--init, --data,
// checkpoints, plan's parameter list) missing, truncated or malformed. Each must end in a clear
// error naming the flag, field or file, a non-zero exit and no crash (no signal, no hang).
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "support/helpers.hpp"
#include "support/subprocess.hpp"

using namespace shardflow;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

struct Row {
  std::vector<std::string> argv;  // after the program
  std::string says;               // the message must contain this (the flag, field or file it names)
};

// Runs `program args`; the row passes when it exits (no signal, no hang) with a non-zero status and
// its output names what was wrong.
void check_rows(const std::string& program, const std::vector<Row>& rows) {
  for (const auto& row : rows) {
    std::vector<std::string> argv{program};
    argv.insert(argv.end(), row.argv.begin(), row.argv.end());
    std::string line;
    for (const auto& a : argv) line += a + " ";
    CAPTURE(line);
    test::Child child(argv);
    const auto status = child.wait(60s);
    REQUIRE(status.has_value());  // no hang
    CAPTURE(child.output());
    CHECK_FALSE(WIFSIGNALED(*status));  // no crash
    CHECK(WIFEXITED(*status));
    CHECK(WEXITSTATUS(*status) != 0);
    CHECK(child.says(row.says));
  }
}

// Files that are not what they claim, in a scratch folder.
struct Fixtures {
  fs::path dir = fs::temp_directory_path() / ("sf_bad_input_" + std::to_string(::getpid()));
  std::string empty, tiny, cut, bad_header, wrong_shape, ckpt_dir, cut_ckpt_dir, bad_json, not_list, neg_shape, small;
  Fixtures() {
    fs::create_directories(dir);
    auto write = [&](const std::string& name, const std::string& bytes) {
      std::ofstream(dir / name, std::ios::binary) << bytes;
      return (dir / name).string();
    };
    empty = write("empty.safetensors", "");
    tiny = write("tiny.safetensors", "abc");
    // A valid file cut short: its header promises more than there is.
    TensorMap t;
    std::vector<float> w(4 * 3, 0.5f);
    t["layers.0.weight"] = Tensor::from_f32(w.data(), {3, 4});
    save_safetensors((dir / "whole.safetensors").string(), t);
    const auto whole = fs::file_size(dir / "whole.safetensors");
    fs::copy_file(dir / "whole.safetensors", dir / "cut.safetensors");
    fs::resize_file(dir / "cut.safetensors", whole - 10);
    cut = (dir / "cut.safetensors").string();
    bad_header = write("bad_header.safetensors", std::string("\x10\0\0\0\0\0\0\0", 8) + "{\"x\": \"nope\"}   ");
    wrong_shape = (dir / "whole.safetensors").string();  // layers.0.weight [3, 4] for a 4,3 model it fits; 8,3 it does not
    ckpt_dir = (dir / "ckpt_missing").string();
    fs::create_directories(dir / "ckpt_cut");
    fs::copy_file(dir / "cut.safetensors", dir / "ckpt_cut" / "checkpoint.safetensors");
    cut_ckpt_dir = (dir / "ckpt_cut").string();
    bad_json = write("bad.json", "[{\"name\": \"w\", \"shape\": [3,");
    not_list = write("not_list.json", "{\"params\": 3}");
    neg_shape = write("neg.json", "[{\"name\": \"w\", \"shape\": [-3]}]");
    // Too small for stage 2 to pool at world 2: sharding saves 620 bytes, less than one buffer.
    small = write("small.json", "[{\"name\": \"w\", \"shape\": [300]}, {\"name\": \"b\", \"shape\": [10]}]");
  }
  ~Fixtures() { fs::remove_all(dir); }
};

}  // namespace

TEST_CASE("mlp_train: every flag with an invalid value is refused, naming the flag") {
  std::vector<Row> rows = {
      {{"--sizes", "0,3"}, "--sizes"},
      {{"--sizes", "4"}, "--sizes"},
      {{"--sizes", "784,abc,10"}, "--sizes"},
      {{"--steps", "-1"}, "--steps"},
      {{"--steps", "abc"}, "--steps"},
      {{"--global-batch", "0"}, "--global-batch"},
      {{"--global-batch", "3", "--world-size", "2"}, "--global-batch 3 is not divisible by the world size 2"},
      {{"--world-size", "0"}, "--world-size"},
      {{"--optimizer", "lamb"}, "optimizer 'lamb'"},
      {{"--lr", "-1"}, "lr"},
      {{"--lr", "nan"}, "lr"},
      {{"--lr", "inf"}, "lr"},
      {{"--momentum", "-0.5"}, "momentum"},
      {{"--weight-decay", "-0.5"}, "--weight-decay"},
      {{"--weight-decay", "-1"}, "--weight-decay"},
      {{"--beta1", "1.5"}, "beta1"},
      {{"--beta2", "-1"}, "beta2"},
      {{"--eps", "-1"}, "eps"},
      {{"--eps", "inf"}, "eps"},
      {{"--nesterov"}, "nesterov"},
      {{"--loss", "l1"}, "--loss 'l1'"},
      {{"--every", "-1"}, "--every"},
      {{"--checkpoint-max-file-mb", "-1"}, "--checkpoint-max-file-mb"},
      {{"--first-bucket-mb", "0"}, "--first-bucket-mb"},
      {{"--bucket-mb", "-1"}, "--bucket-mb"},
      {{"--min-buckets", "-2"}, "--min-buckets"},
      {{"--freeze", "layers.9.weight"}, "--freeze: the model has no parameter 'layers.9.weight'"},
      {{"--comm-hook", "foo"}, "--comm-hook"},
      {{"--comm-hook", "powersgd", "--powersgd-rank", "0"}, "powersgd"},
      {{"--timeout", "0"}, "--timeout"},
      {{"--zero-stage", "3"}, "--zero-stage must be 0, 1 or 2, got 3"},
      {{"--zero-stage", "-1"}, "--zero-stage must be 0, 1 or 2, got -1"},
      {{"--zero-stage", "1", "--optimizer", "adamw", "--max-buckets-in-flight", "3"},
       "--max-buckets-in-flight = 3 limits ZeRO-2's gradient buffers in flight, but --zero-stage = 1"},
      {{"--overlap", "sometimes"}, "overlap mode 'sometimes'"},
      {{"--partition", "rows"}, "partition 'rows'"},
      {{"--interleave-lag", "-5"}, "--interleave-lag must be -1 (auto) or 0 to 64, got -5"},
      {{"--no-snapshot-memory"}, "--no-snapshot-memory asks for no snapshots in the launcher's memory, but --snapshot-dir is not set"},
      {{"--interleave-lag", "2", "--zero-stage", "1", "--optimizer", "adamw"}, "--interleave-lag = 2 places each parameter sync after"},
      {{"--prefetch-syncs-in-backward", "2", "--zero-stage", "1", "--optimizer", "adamw"},
       "--prefetch-syncs-in-backward = 2 splits forward prefetch's syncs, but --forward-prefetch is off"},
      {{"--clip-grad-norm", "-1"}, "--clip-grad-norm"},
      {{"--clip-grad-norm", "nan"}, "--clip-grad-norm"},
      {{"--accumulate", "0"}, "--accumulate"},
      {{"--comm-dtype", "fp8"}, "dtype 'fp8'"},
      {{"--param-dtype", "int8"}, "dtype 'int8'"},
      {{"--device", "tpu"}, "--device 'tpu'"},
      {{"--device", "cuda:x"}, "--device 'cuda:x'"},
      {{"--backend", "mpi"}, "--backend 'mpi'"},
      {{"--backend", "gloo"}, "--backend gloo needs one process per rank"},
      {{"--backend", "sim", "--sim-gbytes-per-s", "0"}, "bandwidth"},
      {{"--backend", "sim", "--sim-latency-us", "-1"}, "latency"},
      {{"--backend", "sim", "--sim-world", "-1"}, "simulated world -1"},
      {{"--sim-gbytes-per-s", "5"}, "add --backend sim"},
      {{"--log-every", "-1"}, "--log-every"},
      {{"--stats-json", "/nonexistent/dir/x.json"}, "--stats-json '/nonexistent/dir/x.json'"},
      {{"--trace", "/nonexistent/dir/t.json"}, "/nonexistent/dir/t.json"},
      {{"--plot"}, "--plot"},
      {{"--frobnicate"}, "--frobnicate"},
  };
  // A small model, so that a row that wrongly starts training ends quickly; CLI11 refuses a flag
  // given twice, so the --sizes rows keep only their own.
  for (auto& r : rows) {
    r.argv.push_back("--quiet");
    if (r.argv.front() != "--sizes") r.argv.insert(r.argv.end(), {"--sizes", "8,4,2"});
  }
  check_rows(MLP_TRAIN_PATH, rows);
  // The runtime's own environment settings are read when the Runtime starts, not at first use.
  check_rows("/usr/bin/env", {{{"SHARDFLOW_CPU_VECTORS=sse9", MLP_TRAIN_PATH, "--sizes", "8,4,2", "--quiet"}, "SHARDFLOW_CPU_VECTORS='sse9'"},
                              {{"SHARDFLOW_HUGE_PAGES=yes", MLP_TRAIN_PATH, "--sizes", "8,4,2", "--quiet"}, "SHARDFLOW_HUGE_PAGES='yes'"},
                              {{"SHARDFLOW_KEEP_FREED_MEMORY=maybe", MLP_TRAIN_PATH, "--sizes", "8,4,2", "--quiet"}, "SHARDFLOW_KEEP_FREED_MEMORY"}});
}

TEST_CASE("mlp_train: file inputs missing, empty, truncated or malformed are refused, naming the file") {
  Fixtures f;
  check_rows(MLP_TRAIN_PATH, {
                                 {{"--init", (f.dir / "missing.safetensors").string()}, "missing.safetensors"},
                                 {{"--init", f.empty}, f.empty},
                                 {{"--init", f.tiny}, f.tiny},
                                 {{"--init", f.cut}, f.cut},
                                 {{"--init", f.bad_header}, f.bad_header},
                                 {{"--init", f.wrong_shape, "--sizes", "8,3"}, "layers.0.weight"},
                                 {{"--data", f.cut, "--sizes", "4,3"}, f.cut},
                                 {{"--data", f.wrong_shape, "--sizes", "4,3"}, "tensor 'x' is missing"},
                                 {{"--resume", f.ckpt_dir, "--optimizer", "adamw", "--sizes", "4,3"}, f.ckpt_dir},
                                 {{"--resume", f.cut_ckpt_dir, "--optimizer", "adamw", "--sizes", "4,3"}, f.cut_ckpt_dir},
                             });
}

TEST_CASE("shardflow run and plan: invalid flags and malformed parameter lists are refused, naming them") {
  Fixtures f;
  check_rows(SHARDFLOW_LAUNCHER_PATH, {
                                          {{"run", "--nproc_per_node", "0", "--", "/bin/true"}, "--nproc-per-node"},
                                          {{"run", "--nnodes", "0", "--", "/bin/true"}, "--nnodes"},
                                          {{"run", "--nnodes", "2", "--node-rank", "5", "--", "/bin/true"}, "--node-rank 5"},
                                          {{"run", "--master-port", "70000", "--", "/bin/true"}, "--master-port"},
                                          {{"run", "--rdzv-endpoint", "nohost", "--", "/bin/true"}, "--rdzv-endpoint 'nohost'"},
                                          {{"run", "--rdzv-backend", "zk", "--", "/bin/true"}, "--rdzv-backend 'zk'"},
                                          {{"run", "--rdzv-endpoints", "h:2379", "--", "/bin/true"}, "--rdzv-endpoints is for --rdzv-backend etcd"},
                                          {{"run", "--rdzv-id", "j", "--", "/bin/true"}, "--rdzv-id is for --rdzv-backend etcd"},
                                          {{"run", "--rdzv-backend", "etcd", "--", "/bin/true"}, "needs --rdzv-endpoints"},
                                          {{"run", "--rdzv-backend", "etcd", "--rdzv-endpoints", "h:2379", "--token", "t", "--", "/bin/true"}, "--rdzv-id ID"},
                                          {{"run", "--iface", "nosuch0", "--", "/bin/true"}, "nosuch0"},
                                          {{"run", "--local-addr", "999.1.1.1", "--", "/bin/true"}, "--local-addr"},
                                          {{"run", "--rdzv-timeout", "-1", "--", "/bin/true"}, "--rdzv-timeout"},
                                          {{"run", "--heartbeat-timeout", "0", "--", "/bin/true"}, "--heartbeat-timeout"},
                                          {{"run", "--kill-grace", "-1", "--", "/bin/true"}, "--kill-grace"},
                                          {{"run", "--max-restarts", "-1", "--", "/bin/true"}, "--max-restarts"},
                                          {{"run", "--nnodes", "1:x", "--", "/bin/true"}, "--nnodes '1:x'"},
                                          {{"run", "--nnodes", "1:2", "--token", "t", "--", "/bin/true"}, "--max-restarts"},
                                          {{"run", "--rejoin-timeout", "-1", "--", "/bin/true"}, "--rejoin-timeout"},
                                          {{"run", "--recovery", "sideways", "--", "/bin/true"}, "--recovery"},
                                          {{"run", "--recovery", "in-place", "--", "/bin/true"}, "give --max-restarts N too"},
                                          {{"run", "--recovery", "shrink", "--", "/bin/true"}, "--recovery shrink heals a lost rank"},
                                          {{"run", "--standalone", "--", "/bin/true"}, "--standalone"},
                                          {{"run", "--", "/no/such/program"}, "rank 0"},
                                          {{"plan", "--params", (f.dir / "missing.json").string(), "--world-size", "2"}, "missing.json"},
                                          {{"plan", "--params", f.bad_json, "--world-size", "2"}, f.bad_json},
                                          {{"plan", "--params", f.not_list, "--world-size", "2"}, f.not_list},
                                          {{"plan", "--params", f.neg_shape, "--world-size", "2"}, "dimension -3"},
                                          {{"plan", "--params", f.neg_shape, "--world-size", "0"}, "--world-size"},
                                          {{"plan", "--params", f.neg_shape, "--world-size", "2", "--zero-stage", "5"}, "--zero-stage"},
                                          {{"plan", "--params", f.neg_shape, "--world-size", "2", "--optimizer", "x"}, "--optimizer"},
                                          {{"plan", "--params", f.neg_shape, "--world-size", "2", "--bucket-cap-mb", "0"}, "--bucket-cap-mb"},
                                          {{"plan", "--params", f.small, "--world-size", "2", "--zero-stage", "1", "--max-buckets-in-flight", "2"},
                                           "--max-buckets-in-flight = 2 limits ZeRO-2's gradient buffers in flight, but stage 1 keeps"},
                                          {{"plan", "--params", f.small, "--world-size", "2", "--zero-stage", "2", "--max-buckets-in-flight", "2"},
                                           "--max-buckets-in-flight = 2 limits ZeRO-2's gradient buffers in flight, but stage 2 keeps whole"},
                                          {{"frobnicate"}, "frobnicate"},
                                      });
}

TEST_CASE("Config and OptimizerConfig: every field with an invalid value is refused, naming the field") {
  struct ConfigRow {
    const char* says;
    std::function<void(Config&)> set;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const std::vector<ConfigRow> rows = {
      {"zero.stage", [](Config& c) { c.zero.stage = ZeroStage(7); }},
      {"zero.partition", [](Config& c) { c.zero.partition = Partition(9); }},
      {"zero.partition", [](Config& c) { c.zero.partition = Partition::param; }},  // stage 0 shards nothing
      {"zero.overlap", [](Config& c) { c.zero.overlap = Overlap(9); }},
      {"precision.comm_dtype", [](Config& c) { c.precision.comm_dtype = DType(99); }},
      {"zero.max_buckets_in_flight", [](Config& c) { c.zero.max_buckets_in_flight = 1; }},
      {"zero.max_buckets_in_flight", [](Config& c) { c.zero.stage = ZeroStage::optimizer_state, c.zero.max_buckets_in_flight = 4; }},
      {"zero.clip_grad_norm", [](Config& c) { c.zero.clip_grad_norm = -1; }},
      {"zero.clip_grad_norm", [nan](Config& c) { c.zero.clip_grad_norm = nan; }},
      {"zero.clip_norm_type", [](Config& c) { c.zero.clip_grad_norm = 1, c.zero.clip_norm_type = 3; }},
      {"precision.init_scale", [inf](Config& c) { c.precision.dynamic_loss_scale = true, c.precision.init_scale = inf; }},
      {"precision.growth_factor", [](Config& c) { c.precision.dynamic_loss_scale = true, c.precision.growth_factor = 1; }},
      {"precision.backoff_factor", [](Config& c) { c.precision.dynamic_loss_scale = true, c.precision.backoff_factor = 1; }},
      {"precision.growth_interval", [](Config& c) { c.precision.dynamic_loss_scale = true, c.precision.growth_interval = 0; }},
      {"buckets.first_cap_bytes", [](Config& c) { c.buckets.first_cap_bytes = 0; }},
      {"zero.prefetch_syncs_in_backward", [](Config& c) { c.zero.prefetch_syncs_in_backward = -2; }},
      {"zero.interleave_lag", [](Config& c) { c.zero.interleave_lag = 65; }},
      {"zero.interleave_lag", [](Config& c) { c.zero.stage = ZeroStage::optimizer_state, c.zero.interleave_lag = 1; }},  // overlap none
      {"zero.interleave_lag", [](Config& c) { c.zero.overlap = Overlap::interleaved, c.zero.interleave_lag = 1; }},  // stage 0: no syncs
      {"zero.prefetch_syncs_in_backward", [](Config& c) { c.zero.prefetch_syncs_in_backward = 0; }},  // no prefetch
      {"zero.prefetch_syncs_in_backward", [](Config& c) {
         c.zero.stage = ZeroStage::optimizer_state, c.zero.forward_prefetch = true, c.zero.prefetch_syncs_in_backward = 3;  // overlap none
       }},
      {"zero.fuse_syncs_bytes", [](Config& c) { c.zero.fuse_syncs_bytes = 1 << 20; }},  // stage 0: no syncs
      {"zero.fuse_syncs_bytes", [](Config& c) {
         c.zero.stage = ZeroStage::optimizer_state, c.zero.partition = Partition::param, c.zero.fuse_syncs_bytes = 1 << 20;
       }},
      {"timeouts.collective", [](Config& c) { c.timeouts.collective = 0ms; }},
      {"join.uneven_inputs", [](Config& c) { c.join.uneven_inputs = c.zero.forward_prefetch = true; }},
      {"trace.path", [](Config& c) { c.trace.path = "/nonexistent/dir/trace.json"; }},
      {"snapshot.every", [](Config& c) { c.snapshot.every = -1; }},
      {"snapshot.every", [](Config& c) { c.snapshot.dir = "/tmp/s"; }},
      {"snapshot.dir", [](Config& c) { c.snapshot.every = 2; }},
      {"snapshot.keep", [](Config& c) { c.snapshot.dir = "/tmp/s", c.snapshot.every = 2, c.snapshot.keep = 0; }},
      {"snapshot.disk_every", [](Config& c) { c.snapshot.disk_every = -1; }},
      {"snapshot.disk_every", [](Config& c) { c.snapshot.dir = "/tmp/s", c.snapshot.every = 2, c.snapshot.disk_every = 3; }},
      // Settings of a feature that is off: they would do nothing.
      {"zero.clip_norm_type", [inf](Config& c) { c.zero.clip_norm_type = inf; }},
      {"precision.growth_interval", [](Config& c) { c.precision.growth_interval = 10; }},
      {"precision.init_scale", [](Config& c) { c.precision.init_scale = 1024; }},
      {"snapshot.keep", [](Config& c) { c.snapshot.keep = 3; }},
      {"snapshot.disk_every", [](Config& c) { c.snapshot.disk_every = 10; }},
      {"snapshot.memory", [](Config& c) { c.snapshot.memory = false; }},
  };
  auto world = InProcessWorld::create(1);
  for (const auto& row : rows) {
    CAPTURE(row.says);
    Config c;
    row.set(c);
    CHECK_THROWS_WITH_AS(Runtime(world->communicator(0), c), doctest::Contains(row.says), UsageError);
  }
  struct OptRow {
    const char* says;
    std::function<void(OptimizerConfig&)> set;
  };
  const std::vector<OptRow> opt_rows = {
      {"lr", [](OptimizerConfig& o) { o.lr = -1; }},        {"lr", [nan](OptimizerConfig& o) { o.lr = nan; }},
      {"lr", [inf](OptimizerConfig& o) { o.lr = inf; }},    {"momentum", [](OptimizerConfig& o) { o.momentum = -1; }},
      {"weight_decay", [](OptimizerConfig& o) { o.weight_decay = -0.5f; }},
      {"weight_decay", [inf](OptimizerConfig& o) { o.weight_decay = inf; }},
      {"beta1", [](OptimizerConfig& o) { o.beta1 = 1; }},   {"beta2", [nan](OptimizerConfig& o) { o.beta2 = nan; }},
      {"eps", [](OptimizerConfig& o) { o.eps = -1; }},      {"eps", [inf](OptimizerConfig& o) { o.eps = inf; }},
      {"nesterov", [](OptimizerConfig& o) { o.nesterov = true; }},
      {"StepRule", [](OptimizerConfig& o) { o.kind = OptimizerConfig::Kind::custom; }},
  };
  for (const auto& row : opt_rows) {
    CAPTURE(row.says);
    OptimizerConfig o;
    row.set(o);
    CHECK_THROWS_WITH_AS(o.validate(), doctest::Contains(row.says), UsageError);
  }
}

// Note [Snapshots]
TEST_CASE("a limit of stage 2's buffers in flight that the plan cannot honour is refused, naming it: a model too small to pool at world 2, and world 1") {
  Config cfg;
  cfg.zero.stage = ZeroStage::gradients;
  cfg.zero.max_buckets_in_flight = 2;
  cfg.setting_names = {{"zero.max_buckets_in_flight", "--max-buckets-in-flight"}};
  for (int n : {1, 2}) {
    CAPTURE(n);
    auto world = InProcessWorld::create(n, 20s);
    std::vector<std::string> said(static_cast<std::size_t>(n));
    test::require_all_ok(test::run_ranks(n, [&](int r) {
      std::vector<float> w(300, 0.5f), b(10, 0.5f);
      Runtime rt(world->communicator(r), cfg);
      const auto pw = rt.register_param({"w", {300}, DType::f32, Device::cpu(), w.data()});
      rt.register_param({"b", {10}, DType::f32, Device::cpu(), b.data()});
      try {
        rt.configure_optimizer(OptimizerConfig{});  // the optimizer's state slots size the plan
        rt.grad_ready(pw);
      } catch (const UsageError& e) {
        said[std::size_t(r)] = e.what();
      }
    }));
    for (const auto& what : said) {
      CHECK(what.find("--max-buckets-in-flight = 2 limits ZeRO-2's gradient buffers in flight") != std::string::npos);
      CHECK(what.find(n == 1 ? "at world 1 nothing is sharded" : "parameter 'w'") != std::string::npos);
    }
  }
}

TEST_CASE("snapshots misused: no resumed_step() before the first backward, no runtime optimizer, resumed_step() after training started — each named") {
  const auto dir = (std::filesystem::temp_directory_path() / ("shardflow_snapshots_" + std::to_string(::getpid()))).string();
  Config cfg;
  cfg.snapshot.dir = dir;
  cfg.snapshot.every = 1;
  cfg.setting_names = {{"snapshot.dir", "--snapshot-dir"}};
  auto world = InProcessWorld::create(1);
  float w[4] = {1, 2, 3, 4};
  {
    Runtime rt(world->communicator(0), cfg);
    const auto p = rt.register_param({"w", {4}, DType::f32, Device::cpu(), w});
    rt.configure_optimizer(OptimizerConfig{});
    CHECK_THROWS_WITH_AS(rt.grad_ready(p), doctest::Contains("--snapshot-dir is set, but resumed_step() was not called"), UsageError);
  }
  {
    Runtime rt(world->communicator(0), cfg);
    rt.register_param({"w", {4}, DType::f32, Device::cpu(), w});
    CHECK_THROWS_WITH_AS(rt.resumed_step(), doctest::Contains("call configure_optimizer first"), UsageError);
  }
  {
    Runtime rt(world->communicator(0), cfg);
    const auto p = rt.register_param({"w", {4}, DType::f32, Device::cpu(), w});
    rt.configure_optimizer(OptimizerConfig{});
    CHECK(rt.resumed_step() == 0);  // nothing there yet: a fresh start
    rt.grad_ready(p);
    rt.wait();
    CHECK(rt.resumed_step() == 0);  // the same answer later
    rt.wait_checkpoint();
    CHECK(std::filesystem::exists(dir + "/step-1/index.json"));
  }
  {
    Runtime rt(world->communicator(0), cfg);
    rt.register_param({"w", {4}, DType::f32, Device::cpu(), w});
    rt.configure_optimizer(OptimizerConfig{});
    CHECK(rt.resumed_step() == 1);  // the snapshot the run before left
  }
  std::filesystem::remove_all(dir);
}
