// Element-wise CUDA kernels over flat buffers; each launch helper sits beside its kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace shardflow::cuda {

// x[i] *= s on `stream` (bucket averaging when a backend cannot fuse it).
void launch_scale_f32(float* x, std::size_t n, float s, cudaStream_t stream);

}  // namespace shardflow::cuda
