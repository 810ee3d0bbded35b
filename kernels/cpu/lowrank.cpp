#include "kernels/cpu/lowrank.hpp"

#include <cblas.h>

#include <cmath>

namespace shardflow::kernels {

void gemm(bool ta, bool tb, int n, int m, int k, const float* A, const float* B, float* C) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, n, m, k, 1.0f, A, ta ? n : k, B, tb ? k : m,
              0.0f, C, m);
}

void orthogonalize_columns(float* P, int n, int r, float eps) {
  for (int i = 0; i < r; ++i) {
    double norm2 = 0.0;
    for (int row = 0; row < n; ++row) norm2 += double(P[row * r + i]) * double(P[row * r + i]);
    const float norm = float(std::sqrt(norm2)) + eps;
    const float inv = norm > 0.0f ? 1.0f / norm : 0.0f;
    for (int row = 0; row < n; ++row) P[row * r + i] *= inv;
    for (int j = i + 1; j < r; ++j) {
      double dot = 0.0;
      for (int row = 0; row < n; ++row) dot += double(P[row * r + i]) * double(P[row * r + j]);
      for (int row = 0; row < n; ++row) P[row * r + j] -= float(dot) * P[row * r + i];
    }
  }
}

}  // namespace shardflow::kernels
