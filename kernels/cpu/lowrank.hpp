// The dense algebra of low-rank gradient compression (PowerSGD), row-major, through OpenBLAS.
#pragma once

#include <cstddef>

namespace shardflow::kernels {

// C[n, m] = op(A) · op(B), op(A) [n, k] (A stored [k, n] when ta), op(B) [k, m] (B stored [m, k]
// when tb).
void gemm(bool ta, bool tb, int n, int m, int k, const float* A, const float* B, float* C);

// Gram-Schmidt over the r columns of P [n, r], as torch's _orthogonalize_gram_schmidt: each column
// divided by its norm (+ eps; a zero column stays zero when eps is 0), then taken out of the
// columns after it.
void orthogonalize_columns(float* P, int n, int r, float eps);

}  // namespace shardflow::kernels
