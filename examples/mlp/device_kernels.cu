// The MLP's element-wise device kernels (C++17 for nvcc); cuBLAS does the matmuls in device_model.cpp.
#include "examples/mlp/device_kernels.cuh"

namespace shardflow::mlp::dev {
namespace {

constexpr unsigned kThreads = 256;
unsigned blocks(std::size_t n) {
  std::size_t b = (n + kThreads - 1) / kThreads;
  return unsigned(b > 4096 ? 4096 : (b ? b : 1));
}
#define GRID_STRIDE(i, n) \
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < (n); i += std::size_t(gridDim.x) * blockDim.x)

__global__ void bias_rows_k(float* y, const float* b, std::size_t rows, int out) {
  GRID_STRIDE(i, rows * out) y[i] = b[i % out];
}
__global__ void relu_k(float* y, std::size_t n) {
  GRID_STRIDE(i, n) y[i] = y[i] > 0.0f ? y[i] : 0.0f;
}
__global__ void relu_back_k(const float* y, float* dx, std::size_t n) {
  GRID_STRIDE(i, n) dx[i] = y[i] > 0.0f ? dx[i] : 0.0f;
}
// dy = 2 (pred - y) / denom; *sq += sum (pred - y)^2 (for the loss mean).
__global__ void mse_k(const float* pred, const float* y, float* dy, std::size_t n, float inv_denom, float* sq) {
  float local = 0.0f;
  GRID_STRIDE(i, n) {
    const float d = pred[i] - y[i];
    dy[i] = 2.0f * d * inv_denom;
    local += d * d;
  }
  atomicAdd(sq, local);
}
__global__ void fill_k(float* x, std::size_t n, float v) {
  GRID_STRIDE(i, n) x[i] = v;
}

}  // namespace

void bias_rows(float* y, const float* b, std::size_t rows, int out, cudaStream_t s) {
  bias_rows_k<<<blocks(rows * out), kThreads, 0, s>>>(y, b, rows, out);
}
void relu(float* y, std::size_t n, cudaStream_t s) { relu_k<<<blocks(n), kThreads, 0, s>>>(y, n); }
void relu_back(const float* y, float* dx, std::size_t n, cudaStream_t s) {
  relu_back_k<<<blocks(n), kThreads, 0, s>>>(y, dx, n);
}
void mse(const float* pred, const float* y, float* dy, std::size_t n, float inv_denom, float* sq, cudaStream_t s) {
  mse_k<<<blocks(n), kThreads, 0, s>>>(pred, y, dy, n, inv_denom, sq);
}
void fill(float* x, std::size_t n, float v, cudaStream_t s) { fill_k<<<blocks(n), kThreads, 0, s>>>(x, n, v); }

}  // namespace shardflow::mlp::dev
