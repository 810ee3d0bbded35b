// The data phase of the in-process backend over device memory (N ranks sharing one GPU): every
// rank's kernel reads its peers' buffers directly, the way peer_collective does on the CPU.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "kernels/cuda/optim.cuh"  // DType for nvcc

namespace shardflow::cuda {

constexpr int kMaxPeers = 16;
// Passed by value as a kernel argument: no device-side pointer table to allocate per op.
struct PeerPtrs {
  const void* p[kMaxPeers];
};

// out[i] = scale * (src[0][i] + ... + src[n-1][i]), summed in rank order in fp32 with explicit
// round-to-nearest adds (__fadd_rn), so every rank's chunk is bitwise the CPU reduction
// (kernels::reduce_sum) of the same inputs. `out` may alias one source.
void launch_reduce_peers(DType t, const PeerPtrs& srcs, int n, void* out, std::size_t count, float scale,
                         cudaStream_t stream);

}  // namespace shardflow::cuda
