#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "kernels/cuda/access.cuh"
#include "kernels/cuda/optim.cuh"

namespace shardflow::cuda {
namespace {

__global__ void sgd_kernel(ShardBuffers b, kernels::SgdHyper h, bool first) {
  const float damp = __fadd_rn(1.0f, -h.dampening);
  SF_GRID_STRIDE(i, b.n) {
    float p = b.master[i];
    float d = __fmul_rn(load(b.grad, b.grad_dtype, i), b.grad_scale);
    if (b.grad_scale_ptr) d = __fmul_rn(d, *b.grad_scale_ptr);
    if (h.weight_decay != 0.0f) d = __fadd_rn(d, __fmul_rn(h.weight_decay, p));
    if (h.momentum != 0.0f) {
      const float m = first ? d : __fadd_rn(__fmul_rn(b.state_a[i], h.momentum), __fmul_rn(damp, d));
      b.state_a[i] = m;
      d = h.nesterov ? __fadd_rn(d, __fmul_rn(h.momentum, m)) : m;
    }
    p = __fadd_rn(p, -__fmul_rn(h.lr, d));
    b.master[i] = p;
    if (b.param16) store(b.param16, b.param_dtype, i, p);
  }
}

struct AdamScalars {
  float b1, b2, one_b1, one_b2, eps, wd, decay, step_size, bc2_sqrt;
  bool l2, decoupled;
};

__global__ void adam_kernel(ShardBuffers b, AdamScalars s) {
  SF_GRID_STRIDE(i, b.n) {
    float g = __fmul_rn(load(b.grad, b.grad_dtype, i), b.grad_scale);
    if (b.grad_scale_ptr) g = __fmul_rn(g, *b.grad_scale_ptr);
    float p = b.master[i];
    if (s.decoupled) p = __fmul_rn(p, s.decay);
    if (s.l2) g = __fadd_rn(g, __fmul_rn(s.wd, p));
    const float m = __fadd_rn(__fmul_rn(b.state_a[i], s.b1), __fmul_rn(g, s.one_b1));
    const float v = __fadd_rn(__fmul_rn(b.state_b[i], s.b2), __fmul_rn(__fmul_rn(s.one_b2, g), g));
    b.state_a[i] = m;
    b.state_b[i] = v;
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.bc2_sqrt), s.eps);
    p = __fadd_rn(p, -__fmul_rn(s.step_size, __fdiv_rn(m, denom)));
    b.master[i] = p;
    if (b.param16) store(b.param16, b.param_dtype, i, p);
  }
}

__global__ void scale_kernel(DType t, void* x, std::size_t n, float s) {
  SF_GRID_STRIDE(i, n) store(x, t, i, load(x, t, i) * s);
}

__global__ void cast_kernel(DType dt, void* dst, DType st, const void* src, std::size_t n) {
  SF_GRID_STRIDE(i, n) store(dst, dt, i, load(src, st, i));
}

// Each block reduces its grid-stride share in shared memory, then adds one value to *out.
__global__ void sq_norm_kernel(DType t, const void* x, std::size_t n, float* out) {
  __shared__ float partial[256];
  float acc = 0.0f;
  SF_GRID_STRIDE(i, n) {
    const float v = load(x, t, i);
    acc += v * v;
  }
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicAdd(out, partial[0]);
}

// Non-negative floats order like their bit patterns: atomicMax on the bits is a float max.
__global__ void abs_max_kernel(DType t, const void* x, std::size_t n, float* out) {
  __shared__ float partial[256];
  float acc = 0.0f;
  SF_GRID_STRIDE(i, n) acc = fmaxf(acc, fabsf(load(x, t, i)));
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) partial[threadIdx.x] = fmaxf(partial[threadIdx.x], partial[threadIdx.x + s]);
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned*>(out), __float_as_uint(partial[0]));
}

__global__ void round_kernel(DType t, float* dst, const float* src, std::size_t n) {
  SF_GRID_STRIDE(i, n) {
    float v = src[i];
    if (t == DType::bf16) v = __bfloat162float(__float2bfloat16_rn(v));
    if (t == DType::f16) v = __half2float(__float2half_rn(v));
    dst[i] = v;
  }
}

// One thread: `count` is the world size.
__global__ void clip_coef_kernel(const float* partials, int count, bool inf, float max_norm, float* coef, float* norm) {
  double total = 0.0;
  for (int r = 0; r < count; ++r) total = inf ? fmax(total, double(partials[r])) : total + double(partials[r]);
  const double n = inf ? total : sqrt(total);
  *norm = float(n);
  const double c = double(max_norm) / (n + 1e-6);  // torch.nn.utils.clip_grad_norm_
  *coef = c < 1.0 ? float(c) : 1.0f;
}

constexpr unsigned kThreads = 256;
// Reductions end in one atomic per block: a grid of at most 1024 blocks keeps those few.
unsigned reduce_blocks(std::size_t n) { return blocks_for(n, kThreads) > 1024 ? 1024 : blocks_for(n, kThreads); }

}  // namespace

void launch_sgd_step(const ShardBuffers& b, const kernels::SgdHyper& h, bool first, cudaStream_t stream) {
  if (b.n == 0) return;
  sgd_kernel<<<blocks_for(b.n, kThreads), kThreads, 0, stream>>>(b, h, first);
}

void launch_adam_step(const ShardBuffers& b, const kernels::AdamHyper& h, std::int64_t step, cudaStream_t stream) {
  if (b.n == 0) return;
  // Note [Bitwise CPU parity]: the scalars exactly as kernels/cpu/optim.cpp derives them.
  const double bc1 = 1.0 - std::pow(double(h.beta1), double(step));
  const double bc2 = 1.0 - std::pow(double(h.beta2), double(step));
  AdamScalars s{};
  s.b1 = h.beta1;
  s.b2 = h.beta2;
  s.one_b1 = 1.0f - h.beta1;
  s.one_b2 = 1.0f - h.beta2;
  s.eps = h.eps;
  s.wd = h.weight_decay;
  s.decay = float(1.0 - double(h.lr) * double(h.weight_decay));
  s.step_size = float(double(h.lr) / bc1);
  s.bc2_sqrt = float(std::sqrt(bc2));
  s.l2 = h.weight_decay != 0.0f && !h.decoupled_weight_decay;
  s.decoupled = h.weight_decay != 0.0f && h.decoupled_weight_decay;
  adam_kernel<<<blocks_for(b.n, kThreads), kThreads, 0, stream>>>(b, s);
}

void launch_scale(DType t, void* x, std::size_t n, float s, cudaStream_t stream) {
  if (n) scale_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream>>>(t, x, n, s);
}

void launch_cast(DType dt, void* dst, DType st, const void* src, std::size_t n, cudaStream_t stream) {
  if (n) cast_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream>>>(dt, dst, st, src, n);
}

void launch_sq_norm(DType t, const void* x, std::size_t n, float* out, cudaStream_t stream) {
  if (n) sq_norm_kernel<<<reduce_blocks(n), kThreads, 0, stream>>>(t, x, n, out);
}

void launch_abs_max(DType t, const void* x, std::size_t n, float* out, cudaStream_t stream) {
  if (n) abs_max_kernel<<<reduce_blocks(n), kThreads, 0, stream>>>(t, x, n, out);
}

void launch_round_to(DType t, float* dst, const float* src, std::size_t n, cudaStream_t stream) {
  if (n) round_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream>>>(t, dst, src, n);
}

void launch_clip_coef(const float* partials, int count, bool inf, float max_norm, float* coef, float* norm,
                      cudaStream_t stream) {
  clip_coef_kernel<<<1, 1, 0, stream>>>(partials, count, inf, max_norm, coef, norm);
}

void launch_gather(void* flat, const void* const* srcs, const std::size_t* bytes, int n, cudaStream_t stream) {
  auto* out = static_cast<char*>(flat);
  for (int i = 0; i < n; ++i) {
    cudaMemcpyAsync(out, srcs[i], bytes[i], cudaMemcpyDeviceToDevice, stream);
    out += bytes[i];
  }
}

void launch_scatter(const void* flat, void* const* dsts, const std::size_t* bytes, int n, cudaStream_t stream) {
  const auto* in = static_cast<const char*>(flat);
  for (int i = 0; i < n; ++i) {
    cudaMemcpyAsync(dsts[i], in, bytes[i], cudaMemcpyDeviceToDevice, stream);
    in += bytes[i];
  }
}

}  // namespace shardflow::cuda
