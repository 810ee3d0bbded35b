// CUDA kernels on a real device against the CPU reference, on fresh random inputs (the seed is
// printed). Without a GPU (or without CUDA in the build) it says why and exits 77, which ctest
// reports as skipped. The optimizer steps must match bit for bit (Note [Bitwise CPU parity]).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/dtype.hpp"
#include "kernels/cpu/elementwise.hpp"
#include "kernels/cpu/optim.hpp"
#include "support/gpu_suite.hpp"
#include "kernels/cuda/device.hpp"

#ifdef SHARDFLOW_WITH_CUDA_RUNTIME
#include <cuda_runtime.h>

#include "kernels/cuda/optim.cuh"

namespace {

using namespace shardflow;
void report(const std::string& what, std::size_t bad, std::size_t n) {
  test::gpu_check(bad == 0, what + ": " + std::to_string(bad) + " of " + std::to_string(n) + " differ");
}

template <class T>
T* upload(const std::vector<T>& v) {
  T* d = nullptr;
  cudaMalloc(&d, std::max<std::size_t>(v.size(), 1) * sizeof(T));
  cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  return d;
}
template <class T>
std::vector<T> download(const T* d, std::size_t n) {
  std::vector<T> v(n);
  cudaDeviceSynchronize();
  cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost);
  return v;
}
std::size_t differ(const std::vector<float>& a, const std::vector<float>& b) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < a.size(); ++i) bad += a[i] != b[i];
  return bad;
}

cuda::ShardBuffers shard(float* master, const void* grad, float* state_a, float* state_b, std::size_t n) {
  cuda::ShardBuffers b;
  b.master = master;
  b.grad = grad;
  b.state_a = state_a;
  b.state_b = state_b;
  b.n = n;
  return b;
}

void check_optimizers(std::mt19937& rng, std::size_t n) {
  std::normal_distribution<float> N(0.0f, 1.0f);
  std::vector<float> p(n), g(n);
  for (auto& v : p) v = N(rng);
  for (auto& v : g) v = 0.1f * N(rng);
  for (int kind = 0; kind < 4; ++kind) {  // sgd+momentum+nesterov+wd, adam, adam+l2, adamw
    std::vector<float> cp = p, ca(n, 0.0f), cb(n, 0.0f);
    float *dp = upload(p), *dg = upload(g), *da = upload(ca), *db = upload(cb);
    const cuda::ShardBuffers b = shard(dp, dg, da, db, n);
    kernels::SgdHyper sh{0.05f, 0.9f, 0.1f, 0.01f, true};
    kernels::AdamHyper ah{1e-3f, 0.9f, 0.999f, 1e-8f, kind == 1 ? 0.0f : 0.02f, kind == 3};
    for (int step = 1; step <= 3; ++step) {
      if (kind == 0) {
        kernels::sgd_step(cp.data(), g.data(), ca.data(), n, sh, step == 1);
        cuda::launch_sgd_step(b, sh, step == 1, nullptr);
      } else {
        kernels::adam_step(cp.data(), g.data(), ca.data(), cb.data(), n, ah, step);
        cuda::launch_adam_step(b, ah, step, nullptr);
      }
    }
    const char* names[] = {"sgd (momentum, nesterov, dampening, wd)", "adam", "adam + L2", "adamw"};
    report(std::string(names[kind]) + ", 3 steps, params", differ(download(dp, n), cp), n);
    report(std::string(names[kind]) + ", 3 steps, state", differ(download(da, n), ca), n);
    cudaFree(dp), cudaFree(dg), cudaFree(da), cudaFree(db);
  }
}

void check_master_weights(std::mt19937& rng, std::size_t n) {
  std::normal_distribution<float> N(0.0f, 1.0f);
  for (DType t : {DType::bf16, DType::f16}) {
    std::vector<float> master(n), g(n), m(n, 0.0f), v(n, 0.0f);
    for (auto& x : master) x = N(rng);
    for (auto& x : g) x = 0.1f * N(rng);
    std::vector<std::uint16_t> g16(n), p16(n);
    kernels::convert_from_f32(t, g16.data(), g.data(), n);
    kernels::convert_to_f32(t, g.data(), g16.data(), n);  // the CPU sees what the 16-bit gradient holds
    float *dm = upload(master), *da = upload(m), *db = upload(v);
    std::uint16_t *dg = upload(g16), *dp = upload(p16);
    cuda::ShardBuffers b = shard(dm, dg, da, db, n);
    b.param16 = dp;
    b.param_dtype = t;
    b.grad_dtype = t;
    b.grad_scale = 0.5f;
    kernels::AdamHyper ah{1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, true};
    std::vector<float> half_g(n);
    for (std::size_t i = 0; i < n; ++i) half_g[i] = g[i] * 0.5f;
    kernels::adam_step(master.data(), half_g.data(), m.data(), v.data(), n, ah, 1);
    cuda::launch_adam_step(b, ah, 1, nullptr);
    const std::string name = std::string("adamw, ") + dtype_name(t) + " params, fp32 masters, grad scale 0.5";
    report(name + ": masters", differ(download(dm, n), master), n);
    std::vector<std::uint16_t> want(n);
    kernels::convert_from_f32(t, want.data(), master.data(), n);
    const auto got = download(dp, n);
    std::size_t bad = 0;
    for (std::size_t i = 0; i < n; ++i) bad += got[i] != want[i];
    report(name + ": rounded params", bad, n);
    cudaFree(dm), cudaFree(da), cudaFree(db), cudaFree(dg), cudaFree(dp);
  }
}

void check_elementwise(std::mt19937& rng, std::size_t n) {
  std::normal_distribution<float> N(0.0f, 3.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = N(rng);
  float* dx = upload(x);
  std::vector<float> want = x;
  kernels::scale(DType::f32, want.data(), n, 0.25f);
  cuda::launch_scale(DType::f32, dx, n, 0.25f, nullptr);
  report("scale fp32", differ(download(dx, n), want), n);
  for (DType t : {DType::bf16, DType::f16}) {
    std::vector<std::uint16_t> want16(n);
    kernels::convert_from_f32(t, want16.data(), want.data(), n);
    std::uint16_t* d16 = nullptr;
    cudaMalloc(&d16, n * 2);
    cuda::launch_cast(t, d16, DType::f32, dx, n, nullptr);
    const auto got = download(d16, n);
    std::size_t bad = 0;
    for (std::size_t i = 0; i < n; ++i) bad += got[i] != want16[i];
    report(std::string("cast fp32 -> ") + dtype_name(t), bad, n);
    cudaFree(d16);
  }
  float* dnorm = nullptr;
  cudaMalloc(&dnorm, 4);
  cudaMemset(dnorm, 0, 4);
  cuda::launch_sq_norm(DType::f32, dx, n, dnorm, nullptr);
  double ref = 0;
  for (float v : want) ref += double(v) * v;
  const float got = download(dnorm, 1)[0];
  const double rel = std::abs(got - ref) / ref;
  test::gpu_check(rel < 1e-5, "squared norm fp32: " + std::to_string(rel) + " relative error");
  cudaFree(dnorm);
  cudaFree(dx);
}

// What the runtime's CUDA shard adds: the clip coefficient read on the device (grad_scale_ptr),
// the inf-norm partial, rounding fp32 to a 16-bit wire, and the coefficient kernel itself.
void check_clipping(std::mt19937& rng, std::size_t n) {
  std::normal_distribution<float> N(0.0f, 1.0f);
  std::vector<float> p(n), g(n), a(n, 0.0f), b(n, 0.0f);
  for (auto& v : p) v = N(rng);
  for (auto& v : g) v = N(rng);
  // Partials of two "ranks", the coefficient from them as Shard::finish_norm computes it on the CPU.
  const std::vector<float> partials = {float(n) * 0.7f, float(n) * 0.4f};
  float* dpart = upload(partials);
  float* dscalars = nullptr;
  cudaMalloc(&dscalars, 8);
  for (bool inf : {false, true}) {
    const double total = inf ? std::max(partials[0], partials[1]) : double(partials[0]) + double(partials[1]);
    const double norm = inf ? total : std::sqrt(total);
    const double c = 1.0 / (norm + 1e-6);
    const float want_coef = c < 1.0 ? float(c) : 1.0f;
    cuda::launch_clip_coef(dpart, 2, inf, 1.0f, dscalars, dscalars + 1, nullptr);
    const auto got = download(dscalars, 2);
    test::gpu_check(got[0] == want_coef && got[1] == float(norm),
                    std::string("clip coefficient (") + (inf ? "inf" : "2") + "-norm) as the CPU computes it");
  }
  // A step whose gradient is scaled by the device coefficient equals the CPU's scale-then-step.
  std::vector<float> cp = p, cg = g;
  float *dp = upload(p), *dg = upload(g), *da = upload(a), *db = upload(b);
  cuda::ShardBuffers sb = shard(dp, dg, da, db, n);
  sb.grad_scale_ptr = dscalars;  // the inf-norm coefficient from above
  const float coef = download(dscalars, 1)[0];
  kernels::scale(DType::f32, cg.data(), n, coef);
  kernels::AdamHyper ah{1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, true};
  kernels::adam_step(cp.data(), cg.data(), a.data(), b.data(), n, ah, 1);
  cuda::launch_adam_step(sb, ah, 1, nullptr);
  report("adamw with the clip coefficient read on the device", differ(download(dp, n), cp), n);
  // Partial inf-norm: exact (a max has no rounding).
  float* dmax = nullptr;
  cudaMalloc(&dmax, 4);
  cudaMemset(dmax, 0, 4);
  cuda::launch_abs_max(DType::f32, dg, n, dmax, nullptr);
  float want_max = 0.0f;
  for (float v : g) want_max = std::max(want_max, std::abs(v));
  test::gpu_check(download(dmax, 1)[0] == want_max, "max |g| (partial inf-norm)");
  // fp32 kept at what a 16-bit wire carries.
  for (DType t : {DType::bf16, DType::f16}) {
    std::vector<float> want(n);
    kernels::round_to(t, want.data(), g.data(), n);
    cuda::launch_round_to(t, dp, dg, n, nullptr);
    report(std::string("round fp32 to ") + dtype_name(t), differ(download(dp, n), want), n);
  }
  cudaFree(dp), cudaFree(dg), cudaFree(da), cudaFree(db), cudaFree(dmax), cudaFree(dpart), cudaFree(dscalars);
}

}  // namespace
#endif

int main() {
  return shardflow::test::gpu_main([] {
#ifdef SHARDFLOW_WITH_CUDA_RUNTIME
    using namespace shardflow;
    const unsigned seed = std::random_device{}();
    std::printf("seed %u\n", seed);
    std::mt19937 rng(seed);
    for (std::size_t n : {std::size_t{1}, std::size_t{1000003}}) {
      check_optimizers(rng, n);
      check_master_weights(rng, n);
      check_elementwise(rng, n);
      check_clipping(rng, n);
    }
    test::gpu_check(cudaGetLastError() == cudaSuccess, "no CUDA error pending");
#endif
  });
}
