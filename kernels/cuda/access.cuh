// Device-side helpers the kernel files share: typed element access (16-bit types are widened to
// fp32 and rounded to nearest even on the way back) and the grid-stride launch shape.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>

#include "kernels/cuda/optim.cuh"  // DType for nvcc

namespace shardflow::cuda {
namespace {

__device__ __forceinline__ float load(const void* p, DType t, std::size_t i) {
  switch (t) {
    case DType::bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case DType::f16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

__device__ __forceinline__ void store(void* p, DType t, std::size_t i, float v) {
  switch (t) {
    case DType::bf16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    case DType::f16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    default: static_cast<float*>(p)[i] = v;
  }
}

#define SF_GRID_STRIDE(i, n) \
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < (n); i += std::size_t(gridDim.x) * blockDim.x)

// Grid-stride loops with a grid capped at a few waves: one launch shape serves any shard size.
inline unsigned blocks_for(std::size_t n, unsigned threads) {
  std::size_t b = (n + threads - 1) / threads;
  return unsigned(b > 8192 ? 8192 : (b == 0 ? 1 : b));
}

}  // namespace
}  // namespace shardflow::cuda
