#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "kernels/cuda/device.hpp"
#include "kernels/cuda/elementwise.cuh"

namespace shardflow::cuda {

bool compiled_with_cuda() { return true; }

int device_count() {
  int n = 0;
  // Without a driver this returns cudaErrorInsufficientDriver: that means "no GPU", not a failure.
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error so later probes start clean
    return 0;
  }
  return n;
}

std::string describe() {
  int rt = 0;
  cudaRuntimeGetVersion(&rt);
  std::string s = "CUDA runtime " + std::to_string(rt / 1000) + "." + std::to_string((rt % 1000) / 10);
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return s + ", no device (" + cudaGetErrorString(e) + ")";
  }
  s += ", " + std::to_string(n) + " device(s)";
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) == cudaSuccess) s += std::string(i ? ", " : ": ") + p.name;
  }
  return s;
}

void scale_f32_sync(float* x, std::size_t n, float s) {
  launch_scale_f32(x, n, s, nullptr);
  cudaError_t e = cudaStreamSynchronize(nullptr);
  if (e != cudaSuccess) throw std::runtime_error(std::string("scale_f32_sync: ") + cudaGetErrorString(e));
}

}  // namespace shardflow::cuda
