// Memory-bound kernels over flat buffers: the reduction used by the CPU collectives, bucket scaling,
// ReLU and the losses of the example trainer (MSE, softmax cross-entropy).
#pragma once

#include <cstddef>

#include "shardflow/types.hpp"

namespace shardflow::kernels {

// dst[i] = scale * (srcs[0][i] + srcs[1][i] + ... + srcs[n-1][i]), summed in that order so that
// every rank computing the same chunk gets bitwise the same result. 16-bit types accumulate in fp32.
// dst may alias any one source.
void reduce_sum(DType t, void* dst, const void* const* srcs, int nsrc, std::size_t count, float scale);

// dst[i] = float(src[i]) for a buffer of type t; and back, rounding to nearest even.
void convert_to_f32(DType t, float* dst, const void* src, std::size_t count);
void convert_from_f32(DType t, void* dst, const float* src, std::size_t count);

// dst[i] = src[i] rounded to the nearest value type t can hold, kept as fp32.
void round_to(DType t, float* dst, const float* src, std::size_t count);

// x[i] *= s
void scale(DType t, void* x, std::size_t count, float s);

// y = max(x, 0); in place allowed.
void relu_forward(const float* x, float* y, std::size_t n);
// dx = dy where the forward output was positive, else 0; in place on dy allowed.
void relu_backward(const float* y, const float* dy, float* dx, std::size_t n);

// loss = mean((pred - target)^2) over n elements; dpred = 2 (pred - target) / denom, where denom is
// the element count the mean is over (the global batch's, for data parallel equivalence).
float mse_loss(const float* pred, const float* target, std::size_t n);
void mse_backward(const float* pred, const float* target, float* dpred, std::size_t n, double denom);

// Softmax cross-entropy of `rows` rows of `classes` logits against target distributions (one-hot
// labels, or soft targets summing to 1): loss = mean over rows of -sum_c target log softmax(logits).
// dlogits = (softmax(logits) - target) / denom, where denom is the row count the mean is over.
// The log-sum-exp subtracts each row's maximum, so large logits neither overflow nor lose the loss.
float softmax_xent_loss(const float* logits, const float* target, int rows, int classes);
void softmax_xent_backward(const float* logits, const float* target, float* dlogits, int rows, int classes, double denom);

}  // namespace shardflow::kernels
