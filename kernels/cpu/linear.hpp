// nn.Linear on the CPU through OpenBLAS, PyTorch layout: W is [out, in], row-major.
#pragma once

#include <cstddef>

namespace shardflow::kernels {

// y[B, out] = x[B, in] · W^T + b
void linear_forward(const float* x, const float* W, const float* b, float* y, int batch, int in, int out);

// Gradients accumulate into dW [out, in] and db [out] (like autograd accumulates into .grad, so
// micro-batches can be summed without a copy). dx [B, in] is overwritten; pass null to skip it
// (the first layer needs no input gradient).
void linear_backward(const float* x, const float* W, const float* dy, float* dW, float* db, float* dx,
                     int batch, int in, int out);

// OpenBLAS threads per call. Ranks that are threads of one process each run their own GEMMs, so
// they set this to 1 rather than oversubscribe the cores.
void set_blas_threads(int n);

}  // namespace shardflow::kernels
