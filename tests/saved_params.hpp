// What the multi-host suites compare a job against: the parameters another layout of the same
// training saved, and the stages and overlap modes they run it in.
#pragma once

#include <string>
#include <vector>

#include "helpers.hpp"
#include "launch_helpers.hpp"
#include "shardflow/safetensors.hpp"

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

}  // namespace shardflow::test
