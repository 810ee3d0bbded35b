// Fused optimizer steps on a GPU as a fraction of a device-to-device copy's bandwidth: the step is
// memory-bound, so the copy engine's (or a copy kernel's) bandwidth is the ceiling. Bytes moved per
// element: fp32 AdamW reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq
// (28 B); with bf16 parameters + fp32 masters and a bf16 gradient: 4+4 master, 2 param16 write,
// 2 grad, 16 state = 28 B. A copy of B bytes moves 2B.
//
//   build/bench/bench_optim_cuda [--elements 67108864] [--reps 50]
#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>

#include "kernels/cuda/device.hpp"

#ifdef SHARDFLOW_WITH_CUDA_RUNTIME
#include <cuda_runtime.h>

#include "kernels/cuda/optim.cuh"
#endif

int main(int argc, char** argv) {
  using namespace shardflow;
  CLI::App app{"fused AdamW / SGD bandwidth vs device-to-device copy"};
  std::size_t n = std::size_t{64} << 20;
  int reps = 50;
  app.add_option("--elements", n, "elements per shard")->capture_default_str();
  app.add_option("--reps", reps, "timed repetitions (after 3 warm-up)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (!cuda::compiled_with_cuda() || cuda::device_count() == 0) {
    std::printf("SKIP: %s\n", cuda::describe().c_str());
    return 0;
  }
#ifdef SHARDFLOW_WITH_CUDA_RUNTIME
  std::printf("%s\n", cuda::describe().c_str());
  float *p, *g, *m, *v, *copy_dst;
  void *p16, *g16;
  cudaMalloc(&p, n * 4);
  cudaMalloc(&g, n * 4);
  cudaMalloc(&m, n * 4);
  cudaMalloc(&v, n * 4);
  cudaMalloc(&copy_dst, n * 4 * 7);
  cudaMalloc(&p16, n * 2);
  cudaMalloc(&g16, n * 2);
  cudaMemset(p, 0, n * 4);
  cudaMemset(g, 0, n * 4);
  cudaMemset(m, 0, n * 4);
  cudaMemset(v, 0, n * 4);
  cudaMemset(g16, 0, n * 2);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  auto time_ms = [&](auto&& f) {
    for (int i = 0; i < 3; ++i) f();
    cudaEventRecord(a);
    for (int i = 0; i < reps; ++i) f();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    return double(ms) / reps;
  };
  // The copy moves as many bytes as the step does: 28 B per element = a copy of 14 B per element.
  const std::size_t copy_bytes = n * 14;
  const double copy_ms = time_ms([&] { cudaMemcpyAsync(copy_dst, reinterpret_cast<char*>(copy_dst) + copy_bytes, copy_bytes, cudaMemcpyDeviceToDevice); });
  const double copy_gbs = 2.0 * double(copy_bytes) / (copy_ms * 1e6);
  std::printf("%-44s %9.3f ms  %8.1f GB/s\n", "device-to-device copy (same bytes)", copy_ms, copy_gbs);

  kernels::AdamHyper h;
  h.lr = 1e-3f;
  h.weight_decay = 0.01f;
  h.decoupled_weight_decay = true;
  cuda::ShardBuffers s;
  s.master = p;
  s.grad = g;
  s.state_a = m;
  s.state_b = v;
  s.n = n;
  std::int64_t step = 1;
  auto report = [&](const char* what, double ms, double bytes_per_elem) {
    const double gbs = bytes_per_elem * double(n) / (ms * 1e6);
    std::printf("%-44s %9.3f ms  %8.1f GB/s  %.2f of copy\n", what, ms, gbs, gbs / copy_gbs);
  };
  report("AdamW fp32", time_ms([&] { cuda::launch_adam_step(s, h, step++, nullptr); }), 28);
  cuda::ShardBuffers s16 = s;
  s16.param16 = p16;
  s16.param_dtype = DType::bf16;
  s16.grad = g16;
  s16.grad_dtype = DType::bf16;
  report("AdamW bf16 params + fp32 master, bf16 grad", time_ms([&] { cuda::launch_adam_step(s16, h, step++, nullptr); }), 28);
  kernels::SgdHyper sh;
  sh.momentum = 0.9f;
  report("SGD momentum fp32", time_ms([&] { cuda::launch_sgd_step(s, sh, false, nullptr); }), 20);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    std::printf("CUDA error: %s\n", cudaGetErrorString(e));
    return 1;
  }
#endif
  return 0;
}
