// Dynamic loss scaling (Note [Loss scaling]), as torch.cuda.amp.GradScaler does it: an inf on one
// rank makes every rank skip the same step and halve the scale; clean steps grow it back; the
// parameters follow the unscaled gradients as if no step had been attempted. And under forward
// prefetch what the trainer reads of a step after wait() is that step's (Note [What the last step
// left, under prefetch]).
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "shardflow/sim.hpp"
#include "support/helpers.hpp"
#include "support/per_param_optimizer.hpp"

using namespace shardflow;
using namespace std::chrono_literals;

namespace {

constexpr int kWorld = 2, kIterations = 7, kInfAt = 2;
constexpr std::int64_t kNumel = 40;

float grad_at(int r, int it, std::size_t p, std::int64_t e) { return 0.0078125f * float((r * 3 + it * 5 + int(p) * 7 + int(e)) % 9) - 0.03125f; }

OptimizerConfig adamw() { return test::adamw(0.01f, 0.1f); }

// Iteration `it`'s backward on rank r, gradients last parameter first, multiplied by the loss
// scale; `inf`: one element of p0's gradient overflows.
void backward(Runtime& rt, const std::vector<Param>& h, int r, int it, float scale, bool inf) {
  rt.zero_grad();
  for (std::size_t p = 2; p-- > 0;) {
    float* g = rt.grad_f32(h[p]);
    for (std::int64_t e = 0; e < kNumel; ++e) g[e] = grad_at(r, it, p, e) * scale;
    if (inf && p == 0) g[3] = std::numeric_limits<float>::infinity();
    rt.grad_ready(h[p]);
  }
}

}  // namespace

TEST_CASE("fp16 loss scaling, an inf on rank 1 at iteration 2: every rank skips that step, the scale halves and grows back after 3 clean steps, the parameters as if the step was never tried — stages 0-2, and with forward prefetch behind a slow link the scale, the skip, the norm and the step count read right after wait() are that step's") {
  std::vector<std::vector<float>> init(2, std::vector<float>(kNumel));
  for (std::size_t p = 0; p < 2; ++p)
    for (std::int64_t e = 0; e < kNumel; ++e) init[p][std::size_t(e)] = 0.5f - 0.01f * float(e) + float(p);
  test::PerParamOptimizer ref(adamw(), init);
  for (int it = 0; it < kIterations; ++it)
    for (std::size_t p = 0; p < 2; ++p) {
      if (it == kInfAt) continue;
      std::vector<float> g;
      for (std::int64_t e = 0; e < kNumel; ++e) g.push_back((grad_at(0, it, p, e) + grad_at(1, it, p, e)) * 0.5f);
      ref.step(p, g);
    }
  // Note [What the last step left, under prefetch]: with forward prefetch behind a slow link wait()
  // returns before the pass has even been reduced; what the trainer reads of that step right after
  // (the scale, whether it skipped, the norm, the step count) must still be that step's.
  const std::vector<float> want_scales{1024, 1024, 1024, 512, 512, 512, 1024};
  std::map<int, std::vector<float>> norms_at;  // stage -> rank 0's norms without prefetch
  for (bool prefetch : {false, true})
    for (int stage : {0, 1, 2}) {
      if (prefetch && stage == 0) continue;  // nothing to prefetch: every rank steps every bucket
      CAPTURE(prefetch);
      CAPTURE(stage);
      SimLink slow;
      slow.latency_us = 3000.0;  // each collective lands well after wait() returned
      auto w = prefetch ? make_sim_world(kWorld, slow, 30s) : InProcessWorld::create(kWorld, 30s);
      Config cfg;
      cfg.zero.stage = ZeroStage(stage);
      cfg.zero.overlap = Overlap::interleaved;
      cfg.zero.forward_prefetch = prefetch;
      cfg.precision.dynamic_loss_scale = true;
      cfg.precision.init_scale = 1024.0f;
      cfg.precision.growth_interval = 3;
      cfg.buckets.first_cap_bytes = cfg.buckets.cap_bytes = kNumel * 4;
      std::vector<std::vector<float>> scales(kWorld), final(kWorld), norms(kWorld);
      std::vector<std::vector<char>> skipped(kWorld);
      std::vector<std::vector<std::int64_t>> steps(kWorld);
      test::require_all_ok(test::run_ranks(kWorld, [&](int r) {
        std::vector<float> flat(init[0]);
        flat.insert(flat.end(), init[1].begin(), init[1].end());
        Runtime rt(w->communicator(r), cfg);
        const auto h = test::register_flat(rt, flat.data(), 2, kNumel);
        rt.configure_optimizer(adamw());
        std::vector<float> before;
        for (int it = 0; it < kIterations; ++it) {
          const float scale = rt.loss_scale();  // the trainer scales its loss: the gradients come out scaled
          scales[std::size_t(r)].push_back(scale);
          for (const auto p : h) rt.wait_param(p);  // forward
          if (it == kInfAt) before = flat;
          backward(rt, h, r, it, scale, it == kInfAt && r == 1);
          rt.wait();
          skipped[std::size_t(r)].push_back(rt.last_step_skipped());
          norms[std::size_t(r)].push_back(rt.last_grad_norm());
          steps[std::size_t(r)].push_back(rt.optimizer_steps());
          if (it == kInfAt) {
            rt.wait_all_params();
            CHECK(flat == before);  // not a bit moved on any rank
          }
        }
        rt.wait_all_params();
        final[std::size_t(r)] = flat;
      }));
      if (!prefetch) norms_at[stage] = norms[0];
      for (int r = 0; r < kWorld; ++r) {
        CAPTURE(r);
        CHECK(scales[std::size_t(r)] == want_scales);
        CHECK(skipped[std::size_t(r)] == std::vector<char>{0, 0, 1, 0, 0, 0, 0});
        CHECK(steps[std::size_t(r)] == std::vector<std::int64_t>{1, 2, 3, 4, 5, 6, 7});  // the skipped step counts as tried
        CHECK(std::isinf(norms[std::size_t(r)][kInfAt]));
        for (int it = 0; it < kIterations; ++it)
          if (it != kInfAt) CHECK(norms[std::size_t(r)][std::size_t(it)] == doctest::Approx(norms_at[stage][std::size_t(it)]).epsilon(1e-6));
        CHECK(std::vector<float>(final[std::size_t(r)].begin(), final[std::size_t(r)].begin() + kNumel) == ref.params()[0]);
        CHECK(std::vector<float>(final[std::size_t(r)].begin() + kNumel, final[std::size_t(r)].end()) == ref.params()[1]);
      }
    }
}

TEST_CASE("forward prefetch, the peer gone before the step: reading the norm (or the scale) after wait() fails within the collective timeout, naming the missing rank, never a hang") {
  for (const bool norm_first : {true, false}) {
    CAPTURE(norm_first);
    auto w = InProcessWorld::create(kWorld, 2s);
    Config cfg;
    cfg.timeouts.collective = 2s;
    cfg.zero.stage = ZeroStage::optimizer_state;
    cfg.zero.overlap = Overlap::interleaved;
    cfg.zero.forward_prefetch = true;
    cfg.zero.clip_grad_norm = 1.0f;
    cfg.buckets.first_cap_bytes = cfg.buckets.cap_bytes = kNumel * 4;
    std::string error = "none";
    std::chrono::steady_clock::duration took{};
    std::int64_t steps_after = -1;
    const auto outcome = test::run_ranks(kWorld, [&](int r) {
      std::vector<float> flat(2 * kNumel, 0.5f);
      Runtime rt(w->communicator(r), cfg);
      const auto h = test::register_flat(rt, flat.data(), 2, kNumel);
      rt.configure_optimizer(adamw());
      // Rank 1 leaves before the eighth backward (after the settled fifth iteration, where the
      // runtime waits for a whole pass to choose the split again: Note [Choosing on a settled iteration]).
      const int iterations = r == 1 ? 7 : 8;
      for (int it = 0; it < iterations; ++it) {
        for (const auto p : h) rt.wait_param(p);
        backward(rt, h, r, it, 1.0f, false);
        rt.wait();
      }
      if (r == 1) return rt.wait_all_params();
      const auto t0 = std::chrono::steady_clock::now();
      try {
        norm_first ? (void)rt.last_grad_norm() : (void)rt.loss_scale();
      } catch (const Error& e) {
        error = e.what();
      }
      took = std::chrono::steady_clock::now() - t0;
      // The failed step is no step: what is read after the failure is the last step taken.
      steps_after = rt.optimizer_steps();
    });
    for (const auto& e : outcome) CHECK(test::message_of(e) == "");
    CHECK(error.find("rank(s) 1 did not arrive") != std::string::npos);
    CHECK(took < 10s);
    CHECK(steps_after == 7);
  }
}

TEST_CASE("loss scaling settings: bad values are named — without the runtime's optimizer it is refused at the first backward") {
  auto w = InProcessWorld::create(1, 5s);
  Config c;
  c.precision.dynamic_loss_scale = true;
  c.precision.backoff_factor = 1.5f;
  CHECK_THROWS_WITH_AS(Runtime(w->communicator(0), c), doctest::Contains("precision.backoff_factor"), UsageError);
  c.precision.backoff_factor = 0.5f;
  Runtime rt(w->communicator(0), c);
  float x[4] = {};
  const auto p = rt.register_param({"x", {4}, DType::f32, Device::cpu(), x});
  rt.zero_grad();
  CHECK_THROWS_WITH_AS(rt.grad_ready(p), doctest::Contains("precision.dynamic_loss_scale = true does nothing here"), UsageError);
}
