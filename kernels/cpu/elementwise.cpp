#include "kernels/cpu/elementwise.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/cpu/dtype.hpp"

namespace shardflow::kernels {
namespace {

// Summation in a fixed order, one pass per extra source: each pass is a streaming loop the compiler
// vectorises, and the scale is fused into the last pass instead of another sweep over memory.
void reduce_f32(float* dst, const float* const* s, int n, std::size_t count, float scale) {
  if (n == 1) {
    const float* a = s[0];
    if (scale == 1.0f) {
      if (dst != a)
        for (std::size_t i = 0; i < count; ++i) dst[i] = a[i];
    } else {
      for (std::size_t i = 0; i < count; ++i) dst[i] = a[i] * scale;
    }
    return;
  }
  const float* a = s[0];
  const float* b = s[1];
  if (n == 2) {
    if (scale == 1.0f)
      for (std::size_t i = 0; i < count; ++i) dst[i] = a[i] + b[i];
    else
      for (std::size_t i = 0; i < count; ++i) dst[i] = (a[i] + b[i]) * scale;
    return;
  }
  // Three or more sources: accumulate into dst. dst may alias one of the sources; reading source k
  // after dst was overwritten would be wrong, so accumulate in blocks held in a small local buffer.
  constexpr std::size_t kBlock = 2048;
  float acc[kBlock];
  for (std::size_t base = 0; base < count; base += kBlock) {
    const std::size_t m = count - base < kBlock ? count - base : kBlock;
    for (std::size_t i = 0; i < m; ++i) acc[i] = a[base + i] + b[base + i];
    for (int k = 2; k < n; ++k) {
      const float* c = s[k] + base;
      for (std::size_t i = 0; i < m; ++i) acc[i] += c[i];
    }
    float* d = dst + base;
    if (scale == 1.0f)
      for (std::size_t i = 0; i < m; ++i) d[i] = acc[i];
    else
      for (std::size_t i = 0; i < m; ++i) d[i] = acc[i] * scale;
  }
}

template <float (*Load)(std::uint16_t), std::uint16_t (*Store)(float)>
void reduce_16(std::uint16_t* dst, const std::uint16_t* const* s, int n, std::size_t count, float scale) {
  for (std::size_t i = 0; i < count; ++i) {
    float acc = Load(s[0][i]);
    for (int k = 1; k < n; ++k) acc += Load(s[k][i]);
    dst[i] = Store(scale == 1.0f ? acc : acc * scale);
  }
}

}  // namespace

void reduce_sum(DType t, void* dst, const void* const* srcs, int nsrc, std::size_t count, float scale) {
  if (count == 0 || nsrc <= 0) return;
  switch (t) {
    case DType::f32:
      reduce_f32(static_cast<float*>(dst), reinterpret_cast<const float* const*>(srcs), nsrc, count, scale);
      return;
    case DType::bf16:
      reduce_16<bf16_to_f32, f32_to_bf16>(static_cast<std::uint16_t*>(dst),
                                          reinterpret_cast<const std::uint16_t* const*>(srcs), nsrc, count, scale);
      return;
    case DType::f16:
      reduce_16<f16_to_f32, f32_to_f16>(static_cast<std::uint16_t*>(dst),
                                        reinterpret_cast<const std::uint16_t* const*>(srcs), nsrc, count, scale);
      return;
  }
}

void convert_to_f32(DType t, float* dst, const void* src, std::size_t count) {
  const auto* h = static_cast<const std::uint16_t*>(src);
  switch (t) {
    case DType::f32:
      if (count) std::copy_n(static_cast<const float*>(src), count, dst);
      return;
    case DType::bf16:
      for (std::size_t i = 0; i < count; ++i) dst[i] = bf16_to_f32(h[i]);
      return;
    case DType::f16:
      for (std::size_t i = 0; i < count; ++i) dst[i] = f16_to_f32(h[i]);
      return;
  }
}

void convert_from_f32(DType t, void* dst, const float* src, std::size_t count) {
  auto* h = static_cast<std::uint16_t*>(dst);
  switch (t) {
    case DType::f32:
      if (count) std::copy_n(src, count, static_cast<float*>(dst));
      return;
    case DType::bf16:
      for (std::size_t i = 0; i < count; ++i) h[i] = f32_to_bf16(src[i]);
      return;
    case DType::f16:
      for (std::size_t i = 0; i < count; ++i) h[i] = f32_to_f16(src[i]);
      return;
  }
}

void round_to(DType t, float* dst, const float* src, std::size_t count) {
  switch (t) {
    case DType::f32:
      if (count && dst != src) std::copy_n(src, count, dst);
      return;
    case DType::bf16:
      for (std::size_t i = 0; i < count; ++i) dst[i] = bf16_to_f32(f32_to_bf16(src[i]));
      return;
    case DType::f16:
      for (std::size_t i = 0; i < count; ++i) dst[i] = f16_to_f32(f32_to_f16(src[i]));
      return;
  }
}

void scale(DType t, void* x, std::size_t count, float s) {
  const void* src[1] = {x};
  reduce_sum(t, x, src, 1, count, s);
}

void relu_forward(const float* x, float* y, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

void relu_backward(const float* y, const float* dy, float* dx, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}

float mse_loss(const float* pred, const float* target, std::size_t n) {
  if (n == 0) return 0.0f;
  double sum = 0.0;  // double: the loss is a reported number, keep it stable for large batches
  for (std::size_t i = 0; i < n; ++i) {
    const double d = double(pred[i]) - double(target[i]);
    sum += d * d;
  }
  return float(sum / double(n));
}

void mse_backward(const float* pred, const float* target, float* dpred, std::size_t n, double denom) {
  const float k = float(2.0 / denom);
  for (std::size_t i = 0; i < n; ++i) dpred[i] = k * (pred[i] - target[i]);
}

namespace {
// log sum_c exp(z_c), from the row's maximum.
double log_sum_exp(const float* z, int classes) {
  float m = z[0];
  for (int c = 1; c < classes; ++c) m = std::max(m, z[c]);
  double sum = 0.0;
  for (int c = 0; c < classes; ++c) sum += std::exp(double(z[c]) - double(m));
  return double(m) + std::log(sum);
}
}  // namespace

float softmax_xent_loss(const float* logits, const float* target, int rows, int classes) {
  if (rows <= 0) return 0.0f;
  double total = 0.0;
  for (int r = 0; r < rows; ++r) {
    const float* z = logits + std::size_t(r) * classes;
    const float* t = target + std::size_t(r) * classes;
    const double lse = log_sum_exp(z, classes);
    for (int c = 0; c < classes; ++c)
      if (t[c] != 0.0f) total -= double(t[c]) * (double(z[c]) - lse);
  }
  return float(total / rows);
}

void softmax_xent_backward(const float* logits, const float* target, float* dlogits, int rows, int classes, double denom) {
  const double k = 1.0 / denom;
  for (int r = 0; r < rows; ++r) {
    const std::size_t o = std::size_t(r) * classes;
    const double lse = log_sum_exp(logits + o, classes);
    for (int c = 0; c < classes; ++c) dlogits[o + c] = float(k * (std::exp(double(logits[o + c]) - lse) - double(target[o + c])));
  }
}

}  // namespace shardflow::kernels
