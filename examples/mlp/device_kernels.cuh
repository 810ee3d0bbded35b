// Launchers for the MLP's element-wise kernels on `s` (examples/mlp/device_kernels.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace shardflow::mlp::dev {

void bias_rows(float* y, const float* b, std::size_t rows, int out, cudaStream_t s);  // y[r, o] = b[o]
void relu(float* y, std::size_t n, cudaStream_t s);
void relu_back(const float* y, float* dx, std::size_t n, cudaStream_t s);  // dx = y > 0 ? dx : 0
// dy = 2 (pred - y) * inv_denom; *sq += sum (pred - y)^2
void mse(const float* pred, const float* y, float* dy, std::size_t n, float inv_denom, float* sq, cudaStream_t s);
void fill(float* x, std::size_t n, float v, cudaStream_t s);

}  // namespace shardflow::mlp::dev
