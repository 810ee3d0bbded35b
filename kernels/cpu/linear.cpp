#include "kernels/cpu/linear.hpp"

#include <cblas.h>

namespace shardflow::kernels {

void linear_forward(const float* x, const float* W, const float* b, float* y, int batch, int in, int out) {
  if (batch == 0 || out == 0) return;
  // Seed y with the bias so the GEMM adds onto it (beta = 1): one pass over y instead of two.
  for (int r = 0; r < batch; ++r)
    for (int o = 0; o < out; ++o) y[std::size_t(r) * out + o] = b ? b[o] : 0.0f;
  if (in == 0) return;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, batch, out, in, 1.0f, x, in, W, in, 1.0f, y, out);
}

void linear_backward(const float* x, const float* W, const float* dy, float* dW, float* db, float* dx,
                     int batch, int in, int out) {
  if (out > 0 && in > 0 && batch > 0) {
    // dW[out, in] += dy^T[out, B] · x[B, in]
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, out, in, batch, 1.0f, dy, out, x, in, 1.0f, dW, in);
  }
  if (db) {
    for (int r = 0; r < batch; ++r)
      for (int o = 0; o < out; ++o) db[o] += dy[std::size_t(r) * out + o];
  }
  if (dx && batch > 0 && in > 0) {
    if (out == 0) {
      for (std::size_t i = 0; i < std::size_t(batch) * in; ++i) dx[i] = 0.0f;
    } else {
      // dx[B, in] = dy[B, out] · W[out, in]
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, batch, in, out, 1.0f, dy, out, W, in, 0.0f, dx, in);
    }
  }
}

void set_blas_threads(int n) { openblas_set_num_threads(n); }

}  // namespace shardflow::kernels
