// What the multi-host suites compare a job against: the parameters another layout of the same
// training saved, and the stages and overlap modes they run it in.
#pragma once

#include <string>
#include <vector>

#include "helpers.hpp"
#include "launch_helpers.hpp"
#include "shardflow/safetensors.hpp"
#include "subprocess.hpp"

namespace shardflow::test {

// Bit for bit (tolerance 0), or each tensor within `tolerance` in relative norm.
inline void check_params(const std::string& got_path, const std::string& want_path, double tolerance = 0.0) {
  const TensorMap want = load_safetensors(want_path), got = load_safetensors(got_path);
  REQUIRE(got.size() == want.size());
  for (const auto& [name, t] : want) {
    CAPTURE(name);
    if (tolerance == 0.0) {
      CHECK(got.at(name).to_f32("got") == t.to_f32("want"));
    } else {
      const double err = rel_error(got.at(name).to_f32("got"), t.to_f32("want"));
      CAPTURE(err);
      CHECK(err <= tolerance);
    }
  }
}

// Every ZeRO stage and overlap mode: 0; 1 with none, after_backward, interleaved; 2 interleaved,
// without and with forward prefetch.
struct TrainMode {
  int stage;
  const char* overlap;
  bool prefetch;
  std::string tag() const { return std::to_string(stage) + overlap + (prefetch ? "_prefetch" : ""); }
};
inline const std::vector<TrainMode> kEveryMode = {{0, "none", false},        {1, "none", false},        {1, "after_backward", false},
                                                  {1, "interleaved", false}, {2, "interleaved", false}, {2, "interleaved", true}};

// The small MLP job (mlp_args) in mode `m`, no --backend (auto), saving its parameters to `save`.
inline std::vector<std::string> mode_trainer(const TrainMode& m, const std::string& save) {
  auto args = mlp_args(m.stage);
  args.insert(args.begin(), kTrainer);
  set_flag(args, "--overlap", m.overlap);
  for (const auto& a : {std::string("--save"), save}) args.push_back(a);
  if (m.prefetch) args.push_back("--forward-prefetch");
  return args;
}

// Every mode on one host of 4 ranks, then on 2 hosts x 2 ranks with --backend auto: the two levels
// (named in the log), within 1e-5 of the one host (the sums go in another order). `launch(node,
// nnodes, nproc, prog)` is the launcher command of node `node` (on loopback or in a namespace).
template <class Launch>
void two_levels_match_one_host(const std::string& suite, Launch launch, const std::map<std::string, std::string>& env) {
  using namespace std::chrono_literals;
  for (const auto& m : kEveryMode) {
    CAPTURE(m.stage);
    CAPTURE(m.overlap);
    CAPTURE(m.prefetch);
    const std::string one = scratch(suite, "one_host_" + m.tag() + ".safetensors"), two = scratch(suite, "two_hosts_" + m.tag() + ".safetensors");
    {
      Child job(launch(0, 1, 4, mode_trainer(m, one)), env);
      INFO(job.output());
      REQUIRE(exited_ok(job.wait(120s)));
    }
    Child a(launch(0, 2, 2, mode_trainer(m, two)), env);
    Child b(launch(1, 2, 2, mode_trainer(m, scratch(suite, "unused.safetensors"))), env);
    const auto sb = b.wait(120s), sa = a.wait(120s);
    INFO(a.output());
    INFO(b.output());
    REQUIRE(exited_ok(sa));
    REQUIRE(exited_ok(sb));
    CHECK(a.says("world 4 (hierarchical (shm inside a host, gloo between hosts))"));
    check_params(two, one, 1e-5);
  }
}

}  // namespace shardflow::test
