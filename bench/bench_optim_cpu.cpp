// The optimizer steps on one CPU core, x86-64's baseline loops against AVX2's (Note [Vector loops,
// the same bits], kernels/cpu/vector_isa.cpp), alternated in one process (A B A B, medians), with
// a memcpy of the bytes a step moves as the memory's ceiling. fp32 AdamW reads param, grad,
// exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq: 28 B an element; SGD with momentum
// reads param, grad and its buffer and writes two: 20 B. Each path's AdamW is checked against the
// other's, bit for bit (test_kernels holds every step to it).
//
//   build/bench/bench_optim_cpu [--elements 2097152] [--rounds 9] [--reps 10]
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/optim.hpp"
#include "kernels/cpu/vector_isa.hpp"

using namespace shardflow::kernels;
using Clock = std::chrono::steady_clock;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct State {
  std::vector<float> p, g, m, v, p_out, m_out, v_out;
  explicit State(std::size_t n) : p(n), g(n), m(n), v(n), p_out(n), m_out(n), v_out(n) {
    std::mt19937 rng(3);
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (std::size_t i = 0; i < n; ++i) {
      p[i] = d(rng), g[i] = d(rng) * 1e-2f, m[i] = d(rng) * 1e-3f, v[i] = std::abs(d(rng)) * 1e-5f;
    }
  }
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"CPU optimizer steps: the baseline loops against AVX2's, and a memcpy of the same bytes"};
  std::size_t n = std::size_t{1} << 21;  // about a rank's shard of 16 x Linear(512, 512) at world 2
  int rounds = 9, reps = 10;
  app.add_option("--elements", n, "elements in the shard")->capture_default_str();
  app.add_option("--rounds", rounds, "alternated rounds (medians)")->capture_default_str();
  app.add_option("--reps", reps, "steps timed per round and path (their mean is the round's figure)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (!cpu_has_avx2()) {
    std::printf("SKIP: this CPU has no AVX2 (one path only)\n");
    return 0;
  }
  State s(n);
  AdamHyper adamw;
  adamw.weight_decay = 0.01f;
  adamw.decoupled_weight_decay = true;
  SgdHyper sgd;
  sgd.momentum = 0.9f;
  struct Row {
    std::string name;
    double bytes_per_element;
    std::function<void(int)> step;
  };
  const std::vector<Row> rows{
      {"AdamW in place", 28, [&](int k) { adam_step(s.p.data(), s.g.data(), s.m.data(), s.v.data(), n, adamw, k + 1); }},
      {"AdamW from kept buffers", 28,
       [&](int k) { adam_step(s.p_out.data(), s.g.data(), s.m_out.data(), s.v_out.data(), n, adamw, k + 1, s.p.data(), s.m.data(), s.v.data()); }},
      {"SGD momentum", 20, [&](int k) { sgd_step(s.p.data(), s.g.data(), s.m.data(), n, sgd, k == 0); }},
      {"memcpy of 3 buffers", 24, [&](int) {  // the memory's pace: AdamW's 3 writes and 3 of its 4 reads
         std::memcpy(s.p_out.data(), s.p.data(), n * 4);
         std::memcpy(s.m_out.data(), s.m.data(), n * 4);
         std::memcpy(s.v_out.data(), s.v.data(), n * 4);
       }}};
  const VectorIsa paths[] = {VectorIsa::baseline, VectorIsa::avx2};
  std::vector<std::vector<double>> ms(rows.size() * 2);
  for (int r = 0; r < rounds; ++r)
    for (std::size_t i = 0; i < rows.size(); ++i)
      for (int k = 0; k < 2; ++k) {
        const int a = (k + r) % 2;  // which path goes first alternates with the round
        use_vector_isa(paths[a]);
        rows[i].step(0);  // warm
        const auto t0 = Clock::now();
        for (int k = 0; k < reps; ++k) rows[i].step(k);
        ms[i * 2 + std::size_t(a)].push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / reps);
      }
  // The two paths' bits, from the same inputs.
  std::vector<float> stepped[2];
  for (int a = 0; a < 2; ++a) {
    use_vector_isa(paths[a]);
    State t(std::min<std::size_t>(n, 1 << 16));
    adam_step(t.p.data(), t.g.data(), t.m.data(), t.v.data(), t.p.size(), adamw, 5);
    stepped[a] = t.p;
  }
  const bool same = std::memcmp(stepped[0].data(), stepped[1].data(), stepped[0].size() * 4) == 0;
  std::printf("bench_optim_cpu: %zu elements, one thread, %d rounds alternated x %d steps (medians); AdamW's bits equal on both paths: %s\n", n,
              rounds, reps, same ? "yes" : "NO");
  std::printf("  %-26s %12s %12s %10s %14s\n", "", "baseline ms", "avx2 ms", "avx2/base", "avx2 GB/s");
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const double base = median(ms[i * 2]), avx2 = median(ms[i * 2 + 1]);
    std::printf("  %-26s %12.3f %12.3f %10.2f %14.1f\n", rows[i].name.c_str(), base, avx2, avx2 / base,
                double(n) * rows[i].bytes_per_element / (avx2 * 1e6));
  }
  return same ? 0 : 1;
}
