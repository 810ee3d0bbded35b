// CPU kernels: the optimizers against closed-form torch.optim trajectories, the Linear layer
// against finite differences, 16-bit rounding, the reduction kernel's aliasing, safetensors files.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>
#include <fstream>

#include "examples/mlp/model.hpp"
#include "support/helpers.hpp"
#include "kernels/cpu/dtype.hpp"
#include "kernels/cpu/elementwise.hpp"
#include "kernels/cpu/host_memory.hpp"
#include "kernels/cpu/linear.hpp"
#include "kernels/cpu/optim.hpp"
#include "kernels/cpu/vector_isa.hpp"
#include "shardflow/optimizer.hpp"
#include "shardflow/safetensors.hpp"

using namespace shardflow;
using namespace shardflow::kernels;

TEST_CASE("SGD with momentum follows torch: the buffer starts as the first gradient") {
  float p = 1.0f, g = 1.0f, buf = 0.0f;
  SgdHyper h{0.1f, 0.9f, 0.0f, 0.0f, false};
  sgd_step(&p, &g, &buf, 1, h, true);
  CHECK(p == doctest::Approx(0.9).epsilon(1e-7));
  sgd_step(&p, &g, &buf, 1, h, false);
  CHECK(p == doctest::Approx(0.71).epsilon(1e-6));
  sgd_step(&p, &g, &buf, 1, h, false);
  CHECK(p == doctest::Approx(0.439).epsilon(1e-6));
}

TEST_CASE("SGD nesterov and weight decay") {
  float p = 1.0f, g = 1.0f, buf = 0.0f;
  SgdHyper nest{0.1f, 0.9f, 0.0f, 0.0f, true};
  sgd_step(&p, &g, &buf, 1, nest, true);
  CHECK(p == doctest::Approx(0.81).epsilon(1e-6));
  sgd_step(&p, &g, &buf, 1, nest, false);
  CHECK(p == doctest::Approx(0.539).epsilon(1e-6));

  float q = 1.0f;
  SgdHyper wd{0.1f, 0.0f, 0.0f, 0.5f, false};
  sgd_step(&q, &g, nullptr, 1, wd, true);
  CHECK(q == doctest::Approx(0.85).epsilon(1e-7));
}

TEST_CASE("Adam with a constant gradient moves lr per step (bias correction), AdamW decays first") {
  float p = 1.0f, g = 2.0f, m = 0, v = 0;
  AdamHyper h;
  h.lr = 0.1f;
  for (int step = 1; step <= 3; ++step) {
    adam_step(&p, &g, &m, &v, 1, h, step);
    CHECK(p == doctest::Approx(1.0 - 0.1 * step).epsilon(1e-5));
  }
  float q = 1.0f, m2 = 0, v2 = 0;
  AdamHyper w = h;
  w.weight_decay = 0.1f;
  w.decoupled_weight_decay = true;
  adam_step(&q, &g, &m2, &v2, 1, w, 1);
  CHECK(q == doctest::Approx(1.0 * (1 - 0.1 * 0.1) - 0.1).epsilon(1e-6));
}

namespace {

// Adam's three weight-decay modes: none, L2 (Adam's own), decoupled (AdamW).
AdamHyper adam_in_mode(int mode) {
  AdamHyper h;
  h.lr = 0.01f;
  h.weight_decay = mode == 0 ? 0.0f : 0.1f;
  h.decoupled_weight_decay = mode == 2;
  return h;
}

}  // namespace

TEST_CASE("Adam from kept buffers into others = Adam in place, bit for bit, in each weight-decay mode, and the kept buffers untouched") {
  const std::size_t n = 1037;  // not a multiple of any vector width
  std::vector<float> p(n), g(n), m(n), v(n);
  for (std::size_t i = 0; i < n; ++i) {
    p[i] = std::sin(float(i)) * 3.0f;
    g[i] = std::cos(float(i) * 0.7f) * 0.01f;
    m[i] = g[i] * 0.5f;
    v[i] = g[i] * g[i] * 2.0f;
  }
  for (int mode = 0; mode < 3; ++mode) {
    CAPTURE(mode);
    const AdamHyper h = adam_in_mode(mode);
    auto p1 = p, m1 = m, v1 = v;
    adam_step(p1.data(), g.data(), m1.data(), v1.data(), n, h, 7);
    std::vector<float> p2(n, -1.0f), m2(n, -1.0f), v2(n, -1.0f);
    const auto p0 = p, m0 = m, v0 = v;
    adam_step(p2.data(), g.data(), m2.data(), v2.data(), n, h, 7, p.data(), m.data(), v.data());
    CHECK(std::memcmp(p1.data(), p2.data(), n * 4) == 0);
    CHECK(std::memcmp(m1.data(), m2.data(), n * 4) == 0);
    CHECK(std::memcmp(v1.data(), v2.data(), n * 4) == 0);
    CHECK(std::memcmp(p.data(), p0.data(), n * 4) == 0);
    CHECK(std::memcmp(m.data(), m0.data(), n * 4) == 0);
    CHECK(std::memcmp(v.data(), v0.data(), n * 4) == 0);
  }
}

namespace {

// Values over the whole float range a step meets: zeros, subnormals, tiny and large magnitudes,
// both signs (non-negative for Adam's second moment).
std::vector<float> spread(std::size_t n, std::uint32_t seed, bool non_negative) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> exponent(-140, 12);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::vector<float> x(n);
  for (std::size_t i = 0; i < n; ++i) {
    x[i] = i % 17 == 0 ? 0.0f : std::ldexp(mantissa(rng), exponent(rng));
    if (!non_negative && rng() % 2) x[i] = -x[i];
  }
  return x;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Runs `step` with the baseline loops and again with AVX2's, restoring the process's choice.
template <typename Step>
void on_each_path(Step step) {
  const VectorIsa before = vector_isa();
  use_vector_isa(VectorIsa::baseline);
  step(VectorIsa::baseline);
  use_vector_isa(VectorIsa::avx2);
  step(VectorIsa::avx2);
  use_vector_isa(before);
}

}  // namespace

// Note [Vector loops, the same bits]
TEST_CASE("the optimizer steps give the baseline's bits on AVX2's loops: Adam in each weight-decay mode, in place and from kept "
          "buffers, and SGD plain, with momentum, nesterov and weight decay, at sizes that leave a remainder") {
  if (!cpu_has_avx2()) {
    MESSAGE("this CPU has no AVX2: one path only");
    return;
  }
  for (const std::size_t n : {std::size_t(1), std::size_t(7), std::size_t(37), std::size_t(4099)}) {
    CAPTURE(n);
    const auto p = spread(n, 1, false), g = spread(n, 2, false), m = spread(n, 3, false), v = spread(n, 4, true);
    for (int mode = 0; mode < 3; ++mode) {
      CAPTURE(mode);
      const AdamHyper h = adam_in_mode(mode);
      for (const bool from : {false, true}) {
        CAPTURE(from);
        std::vector<float> out[2][3];
        on_each_path([&](VectorIsa isa) {
          auto& [p1, m1, v1] = out[int(isa)];
          if (from) {
            p1.assign(n, 0.0f), m1.assign(n, 0.0f), v1.assign(n, 0.0f);
            adam_step(p1.data(), g.data(), m1.data(), v1.data(), n, h, 3, p.data(), m.data(), v.data());
          } else {
            p1 = p, m1 = m, v1 = v;
            adam_step(p1.data(), g.data(), m1.data(), v1.data(), n, h, 3);
          }
        });
        for (int k = 0; k < 3; ++k) CHECK(same_bits(out[0][k], out[1][k]));
      }
    }
    for (int mode = 0; mode < 4; ++mode) {
      CAPTURE(mode);
      SgdHyper h;
      h.lr = 0.05f;
      h.momentum = mode == 0 ? 0.0f : 0.9f;
      h.dampening = mode == 1 ? 0.1f : 0.0f;
      h.nesterov = mode == 2;
      h.weight_decay = mode == 3 ? 1e-3f : 0.0f;
      for (const bool first : {true, false}) {
        std::vector<float> out[2][2];
        on_each_path([&](VectorIsa isa) {
          auto& [p1, b1] = out[int(isa)];
          p1 = p, b1 = m;
          sgd_step(p1.data(), g.data(), b1.data(), n, h, first);
        });
        CHECK(same_bits(out[0][0], out[1][0]));
        CHECK(same_bits(out[0][1], out[1][1]));
      }
    }
  }
}

TEST_CASE("SHARDFLOW_CPU_VECTORS takes auto, baseline or avx2, and refuses anything else, or AVX2 on a CPU without it, by name") {
  CHECK(vector_isa_setting(nullptr, true) == VectorIsa::avx2);
  CHECK(vector_isa_setting(nullptr, false) == VectorIsa::baseline);
  CHECK(vector_isa_setting("auto", true) == VectorIsa::avx2);
  CHECK(vector_isa_setting("baseline", true) == VectorIsa::baseline);
  CHECK(vector_isa_setting("avx2", true) == VectorIsa::avx2);
  CHECK_THROWS_WITH_AS(vector_isa_setting("avx2", false), doctest::Contains("this CPU has no AVX2"), UsageError);
  CHECK_THROWS_WITH_AS(vector_isa_setting("avx512", true), doctest::Contains("SHARDFLOW_CPU_VECTORS='avx512'"), UsageError);
  CHECK_THROWS_WITH_AS(vector_isa_setting("", true), doctest::Contains("SHARDFLOW_CPU_VECTORS=''"), UsageError);
}

TEST_CASE("Optimizer defaults are torch's: AdamW decays by 0.01, Adam and SGD do not") {
  OptimizerConfig c;
  c.kind = OptimizerConfig::Kind::adamw;
  CHECK(c.effective_weight_decay() == doctest::Approx(0.01));
  c.kind = OptimizerConfig::Kind::adam;
  CHECK(c.effective_weight_decay() == 0.0f);
  c.weight_decay = 0.2f;
  CHECK(c.effective_weight_decay() == doctest::Approx(0.2));
  CHECK_THROWS_AS(OptimizerConfig::parse_kind("lamb"), UsageError);
  OptimizerConfig bad;
  bad.nesterov = true;  // without momentum
  CHECK_THROWS_AS(bad.validate(), UsageError);
}

namespace {
// dW[k] (layer 0's weight gradient) against central differences of the model's loss.
void check_by_finite_differences(mlp::Model& m, const std::vector<float>& x, const std::vector<float>& y, int rows,
                                 const std::vector<float>& dW, std::initializer_list<std::size_t> at) {
  auto& W = m.layers()[0].weight;
  for (std::size_t k : at) {
    CAPTURE(k);
    const float h = 1e-2f, keep = W[k];
    W[k] = keep + h;
    const double up = m.forward(x.data(), y.data(), rows);
    W[k] = keep - h;
    const double down = m.forward(x.data(), y.data(), rows);
    W[k] = keep;
    CHECK(dW[k] == doctest::Approx((up - down) / (2 * h)).epsilon(1e-2));
  }
}
}  // namespace

TEST_CASE("Linear backward matches finite differences of the MSE loss") {
  const int B = 3, in = 4, out = 5;
  mlp::Model m({in, out});
  m.init(7);
  std::vector<float> x(B * in), y(B * out);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 0.1f * float(int(i % 7) - 3);
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = 0.05f * float(int(i % 5) - 2);
  std::vector<float> dW(out * in, 0.0f), db(out, 0.0f);
  m.forward(x.data(), y.data(), B);
  int ready_calls = 0;
  m.backward(y.data(), double(B * out), [&](int, bool bias) { return bias ? db.data() : dW.data(); },
             [&](int, bool) { ++ready_calls; });
  CHECK(ready_calls == 2);
  check_by_finite_differences(m, x, y, B, dW, {0, 7, 19});
}

TEST_CASE("softmax cross-entropy: finite differences of the loss, and logits of 1000 neither overflow nor lose it") {
  const int B = 3, in = 4, C = 5;
  mlp::Model m({in, C}, mlp::Loss::cross_entropy);
  m.init(11);
  std::vector<float> x(B * in), y(B * C, 0.0f);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 0.3f * float(int(i % 7) - 3);
  for (int r = 0; r < B; ++r) y[std::size_t(r * C + (2 * r + 1) % C)] = 1.0f;  // one-hot labels
  std::vector<float> dW(C * in, 0.0f), db(C, 0.0f);
  m.forward(x.data(), y.data(), B);
  m.backward(y.data(), double(B), [&](int, bool bias) { return bias ? db.data() : dW.data(); }, [](int, bool) {});
  check_by_finite_differences(m, x, y, B, dW, {0, 6, 17});
  // A confident wrong answer: loss 1000 - 0 exactly, gradient softmax - target.
  const float logits[2] = {1000.0f, 0.0f}, target[2] = {0.0f, 1.0f};
  CHECK(softmax_xent_loss(logits, target, 1, 2) == doctest::Approx(1000.0));
  float d[2];
  softmax_xent_backward(logits, target, d, 1, 2, 1.0);
  CHECK(d[0] == doctest::Approx(1.0));
  CHECK(d[1] == doctest::Approx(-1.0));
}

TEST_CASE("linear_backward accumulates into the gradient, as autograd does") {
  const int B = 2, in = 3, out = 2;
  std::vector<float> x{1, 2, 3, 4, 5, 6}, W(out * in, 0.5f), dy{1, 0, 0, 1};
  std::vector<float> dW(out * in, 1.0f), db(out, 1.0f);
  linear_backward(x.data(), W.data(), dy.data(), dW.data(), db.data(), nullptr, B, in, out);
  // dW = 1 + dy^T x: row 0 takes x row 0, row 1 takes x row 1.
  CHECK(dW == std::vector<float>{2, 3, 4, 5, 6, 7});
  CHECK(db == std::vector<float>{2, 2});
}

TEST_CASE("bf16 rounds to nearest even and keeps NaN — fp16 round trips") {
  CHECK(f32_to_bf16(1.0f) == 0x3F80);
  CHECK(f32_to_bf16(1.00390625f) == 0x3F80);   // exactly halfway: to even
  CHECK(f32_to_bf16(1.01171875f) == 0x3F82);   // 1 + 3 * 2^-8: halfway, up to even
  CHECK(std::isnan(bf16_to_f32(f32_to_bf16(std::nanf("")))));
  CHECK(f16_to_f32(f32_to_f16(0.5f)) == 0.5f);
  CHECK(f16_to_f32(f32_to_f16(65504.0f)) == 65504.0f);
  CHECK(std::isinf(f16_to_f32(f32_to_f16(1e6f))));
}

TEST_CASE("reduce_sum may write over one of its sources, for any number of sources") {
  for (int n = 1; n <= 5; ++n) {
    std::vector<std::vector<float>> s(std::size_t(n), std::vector<float>(5000));
    std::vector<const void*> ptr;
    for (int k = 0; k < n; ++k) {
      for (std::size_t i = 0; i < 5000; ++i) s[std::size_t(k)][i] = float(k + 1) * float(i % 13);
      ptr.push_back(s[std::size_t(k)].data());
    }
    reduce_sum(DType::f32, s[std::size_t(n - 1)].data(), ptr.data(), n, 5000, 2.0f);
    for (std::size_t i = 0; i < 5000; ++i) REQUIRE(s[std::size_t(n - 1)][i] == 2.0f * float(n * (n + 1) / 2) * float(i % 13));
  }
}

TEST_CASE("safetensors: round trip, and malformed files are refused naming the file") {
  const std::string path = "test_kernels_roundtrip.safetensors";
  TensorMap t;
  std::vector<float> a{1, 2, 3, 4, 5, 6};
  t["layers.0.weight"] = Tensor::from_f32(a.data(), {2, 3});
  t["empty"] = Tensor::from_f32(nullptr, {0});
  save_safetensors(path, t, {{"format", "pt"}});
  auto back = load_safetensors(path);
  REQUIRE(back.size() == 2);
  CHECK(back["layers.0.weight"].shape == Shape{2, 3});
  CHECK(back["layers.0.weight"].to_f32("w") == a);
  CHECK(back["empty"].numel() == 0);

  {  // cut the file short: the data section no longer holds the tensor
    std::ifstream in(path, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), {});
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), std::streamsize(bytes.size() - 8));
  }
  try {
    load_safetensors(path);
    FAIL("a truncated file loaded");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find(path) != std::string::npos);
  }
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    const char len[8] = {4, 0, 0, 0, 0, 0, 0, 0};
    out.write(len, 8);
    out.write("{nope", 4);
  }
  CHECK_THROWS_AS(load_safetensors(path), Error);
  CHECK_THROWS_AS(load_safetensors("does-not-exist.safetensors"), Error);
  std::remove(path.c_str());
}

TEST_CASE("fp16 conversions agree bit for bit with the compiler's _Float16: every half, and a sweep of floats") {
  std::size_t bad = 0;
  for (std::uint32_t h = 0; h < 65536; ++h) {
    _Float16 ref;
    const std::uint16_t hh = std::uint16_t(h);
    std::memcpy(&ref, &hh, 2);
    const float want = float(ref), got = f16_to_f32(hh);
    if (std::isnan(want) ? !std::isnan(got) : std::memcmp(&want, &got, 4) != 0) ++bad;
  }
  CHECK(bad == 0);
  bad = 0;
  std::size_t checked = 0;
  auto check = [&](std::uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    const _Float16 ref = static_cast<_Float16>(f);
    std::uint16_t want;
    std::memcpy(&want, &ref, 2);
    const std::uint16_t got = f32_to_f16(f);
    const bool nan = std::isnan(f);
    if (nan ? (got & 0x7c00u) != 0x7c00u || (got & 0x3ffu) == 0 : got != want) ++bad;
    ++checked;
  };
  for (std::uint64_t u = 0; u < (std::uint64_t{1} << 32); u += 4093) check(std::uint32_t(u));  // ~1M floats
  // Around every half's rounding boundary: the halfway points and their neighbours.
  for (std::uint32_t h = 0; h < 0x7c00; ++h) {
    const float lo = f16_to_f32(std::uint16_t(h)), hi = f16_to_f32(std::uint16_t(h + 1));
    const float mid = lo + (hi - lo) / 2;
    std::uint32_t m;
    std::memcpy(&m, &mid, 4);
    for (std::uint32_t d : {m - 1, m, m + 1}) {
      check(d);
      check(d | 0x80000000u);
    }
  }
  INFO(checked << " floats checked");
  CHECK(bad == 0);
}

namespace {

// The kernel's view of the mapping holding `at`: its VmFlags line from /proc/self/smaps, which
// carries "hg" once the range is advised onto huge pages (with THP built in).
std::string vm_flags_at(std::uintptr_t at) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line, flags;
  bool inside = false;
  while (std::getline(smaps, line)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find('-') < line.find(' ')) inside = lo <= at && at < hi;
    else if (inside && line.rfind("VmFlags:", 0) == 0) flags = line;
  }
  return flags;
}

}  // namespace

TEST_CASE("a trainer's own large buffer, reserved and advised before its first write, has its 2 MiB-aligned part on transparent huge pages, as the runtime's blocks do") {
  std::vector<float> weight;
  const std::size_t n = std::size_t{3} << 20;  // 12 MiB of fp32, as glibc maps it (not 2 MiB-aligned)
  weight.reserve(n);
  shardflow::advise_huge_pages(weight.data(), n * sizeof(float));
  weight.assign(n, 0.0f);
  const auto inside = (reinterpret_cast<std::uintptr_t>(weight.data()) + (std::uintptr_t{4} << 20)) & ~((std::uintptr_t{2} << 20) - 1);
  const auto flags = vm_flags_at(inside);
  REQUIRE_FALSE(flags.empty());
  const bool wanted = shardflow::huge_pages_setting(std::getenv("SHARDFLOW_HUGE_PAGES"));
  if (std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled")) CHECK((flags.find(" hg") != std::string::npos) == wanted);
  CHECK(std::all_of(weight.begin(), weight.end(), [](float v) { return v == 0.0f; }));
}

TEST_CASE("host blocks of a huge page or more start on a 2 MiB boundary, read as zeros and are advised onto transparent huge pages (Note [Huge pages for large blocks]), and SHARDFLOW_HUGE_PAGES takes 0 or 1 and refuses anything else by name") {
  const std::size_t n = (std::size_t{5} << 20) + 100;  // not a whole number of pages
  const auto block = shardflow::alloc_zeroed(n);
  const auto at = reinterpret_cast<std::uintptr_t>(block.get());
  const bool wanted = shardflow::huge_pages_setting(std::getenv("SHARDFLOW_HUGE_PAGES"));
  if (wanted) CHECK(at % (std::uintptr_t{2} << 20) == 0);
  std::size_t nonzero = 0;
  for (std::size_t i = 0; i < n; i += 4093) nonzero += block.get()[i] != std::byte{0};
  CHECK(nonzero == 0);
  block.get()[n - 1] = std::byte{1};  // the whole length is writable
  const auto flags = vm_flags_at(at);
  REQUIRE_FALSE(flags.empty());
  if (std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled")) CHECK((flags.find(" hg") != std::string::npos) == wanted);
  const auto small = shardflow::alloc_zeroed(100);
  CHECK(reinterpret_cast<std::uintptr_t>(small.get()) % 64 == 0);
  CHECK(shardflow::huge_pages_setting(nullptr));
  CHECK(shardflow::huge_pages_setting("1"));
  CHECK_FALSE(shardflow::huge_pages_setting("0"));
  CHECK_THROWS_WITH_AS(shardflow::huge_pages_setting("yes"), doctest::Contains("SHARDFLOW_HUGE_PAGES='yes'"), shardflow::UsageError);
}
