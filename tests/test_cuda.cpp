// CUDA kernels on a real device against the CPU reference. Without a GPU (or without CUDA in the
// build) it says why and exits 77, which ctest reports as skipped.
#include <cstdio>
#include <vector>

#include "kernels/cpu/elementwise.hpp"
#include "kernels/cuda/device.hpp"

#ifdef SHARDFLOW_WITH_CUDA_RUNTIME
#include <cuda_runtime.h>
#endif

int main() {
  using namespace shardflow;
  if (!cuda::compiled_with_cuda() || cuda::device_count() == 0) {
    std::printf("SKIP: %s\n", cuda::describe().c_str());
    return 77;
  }
#ifdef SHARDFLOW_WITH_CUDA_RUNTIME
  std::printf("%s\n", cuda::describe().c_str());
  const std::size_t n = (1u << 20) + 3;
  std::vector<float> host(n), want(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = want[i] = 0.001f * float(i % 1000) - 0.3f;
  kernels::scale(DType::f32, want.data(), n, 0.25f);
  float* dev = nullptr;
  if (cudaMalloc(&dev, n * 4) != cudaSuccess) return 1;
  cudaMemcpy(dev, host.data(), n * 4, cudaMemcpyHostToDevice);
  cuda::scale_f32_sync(dev, n, 0.25f);
  cudaMemcpy(host.data(), dev, n * 4, cudaMemcpyDeviceToHost);
  cudaFree(dev);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) bad += host[i] != want[i];
  std::printf("scale_f32: %zu of %zu elements differ from the CPU\n", bad, n);
  std::printf("%d passed, %d failed\n", bad == 0, bad != 0);
  return bad ? 1 : 0;
#else
  return 77;
#endif
}
