#include "kernels/cuda/access.cuh"
#include "kernels/cuda/collective.cuh"

namespace shardflow::cuda {
namespace {

__global__ void reduce_peers_kernel(DType t, PeerPtrs srcs, int n, void* out, std::size_t count, float scale) {
  SF_GRID_STRIDE(i, count) {
    float acc = load(srcs.p[0], t, i);
    for (int k = 1; k < n; ++k) acc = __fadd_rn(acc, load(srcs.p[k], t, i));
    store(out, t, i, scale == 1.0f ? acc : __fmul_rn(acc, scale));
  }
}

}  // namespace

void launch_reduce_peers(DType t, const PeerPtrs& srcs, int n, void* out, std::size_t count, float scale,
                         cudaStream_t stream) {
  if (count == 0) return;
  const unsigned threads = 256;
  reduce_peers_kernel<<<blocks_for(count, threads), threads, 0, stream>>>(t, srcs, n, out, count, scale);
}

}  // namespace shardflow::cuda
