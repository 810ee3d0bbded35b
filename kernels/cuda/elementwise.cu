#include "kernels/cuda/elementwise.cuh"

namespace shardflow::cuda {

// Grid-stride loop: one launch shape serves any size, and the grid stays small enough that the
// launch overhead does not dominate small buckets.
__global__ void scale_f32_kernel(float* x, std::size_t n, float s) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x)
    x[i] *= s;
}

void launch_scale_f32(float* x, std::size_t n, float s, cudaStream_t stream) {
  if (n == 0) return;
  const unsigned threads = 256;
  std::size_t blocks = (n + threads - 1) / threads;
  if (blocks > 4096) blocks = 4096;
  scale_f32_kernel<<<unsigned(blocks), threads, 0, stream>>>(x, n, s);
}

}  // namespace shardflow::cuda
