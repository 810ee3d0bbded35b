// Fused optimizer steps, casts, scaling and squared norms over flat device buffers: what a rank
// runs on its ZeRO shard when the shard lives on a GPU. Each launch is asynchronous on `stream`.
//
// Note [Bitwise CPU parity]
// The optimizer kernels spell every multiply and add as __fmul_rn / __fadd_rn (no FMA
// contraction), divide with __fdiv_rn and take __fsqrt_rn, in the order of kernels/cpu/optim.cpp,
// and get the bias corrections computed on the host in double like the CPU path does. So a GPU
// step equals the CPU step bit for bit (which is what torch's single-tensor path computes), and
// the tests can demand equality rather than a tolerance.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/optim.hpp"
#include "shardflow/dtype.hpp"  // C++17: shardflow/types.hpp is C++20, which nvcc does not compile here

namespace shardflow {
struct OptimizerConfig;  // shardflow/optimizer.hpp
}  // namespace shardflow

namespace shardflow::cuda {

// One flat shard. `master` is the fp32 copy the update runs on; with 16-bit parameters the
// rounded result also goes to `param16` (null for fp32 parameters, whose master is the parameter).
// The gradient may be fp32 or 16-bit and is multiplied by `grad_scale` as it is read (averaging or
// clipping folded into the step instead of a separate pass).
struct ShardBuffers {
  float* master = nullptr;
  void* param16 = nullptr;
  DType param_dtype = DType::f32;
  const void* grad = nullptr;
  DType grad_dtype = DType::f32;
  float grad_scale = 1.0f;
  // A second factor read on the device when set: the clip coefficient, which launch_clip_coef
  // computes there, so the host never waits for the norm exchange.
  const float* grad_scale_ptr = nullptr;
  float* state_a = nullptr;  // SGD momentum / Adam exp_avg
  float* state_b = nullptr;  // Adam exp_avg_sq
  std::size_t n = 0;
};

void launch_sgd_step(const ShardBuffers& b, const kernels::SgdHyper& h, bool first, cudaStream_t stream);
void launch_adam_step(const ShardBuffers& b, const kernels::AdamHyper& h, std::int64_t step, cudaStream_t stream);
// h's rule as one of the two above (defined with the runtime's CUDA shard, runtime/zero/shard_ops_cuda.cpp,
// which g++ compiles: OptimizerConfig is C++20-side). `first`: SGD seeds its momentum; `step`: Adam's.
void launch_update(const OptimizerConfig& h, const ShardBuffers& b, bool first, std::int64_t step, cudaStream_t stream);

// x[i] *= s for a buffer of type t.
void launch_scale(DType t, void* x, std::size_t n, float s, cudaStream_t stream);
// dst[i] = src[i] converted (round to nearest even into 16 bits).
void launch_cast(DType dst_t, void* dst, DType src_t, const void* src, std::size_t n, cudaStream_t stream);
// *out += sum(x[i]^2) in fp32 (out is device memory; zero it first). The partial squared norm of
// this rank's shard for global gradient clipping.
void launch_sq_norm(DType t, const void* x, std::size_t n, float* out, cudaStream_t stream);
// *out = max(*out, max |x[i]|) (out is device memory; zero it first): the partial inf-norm.
void launch_abs_max(DType t, const void* x, std::size_t n, float* out, cudaStream_t stream);
// dst[i] = src[i] rounded to the nearest value of type t, kept as fp32 (kernels::round_to).
void launch_round_to(DType t, float* dst, const float* src, std::size_t n, cudaStream_t stream);
// From the ranks' partial norms (`count` floats: squared sums, or maxima when `inf`), on the device
// and in double like Shard::finish_norm on the CPU: *norm = the total norm, *coef = the clip
// coefficient min(1, max_norm / (norm + 1e-6)) that the steps multiply the gradients by.
void launch_clip_coef(const float* partials, int count, bool inf, float max_norm, float* coef, float* norm,
                      cudaStream_t stream);
// Flatten / unflatten: n device-to-device copies on the stream (the copy engines do this best).
void launch_gather(void* flat, const void* const* srcs, const std::size_t* bytes, int n, cudaStream_t stream);
void launch_scatter(const void* flat, void* const* dsts, const std::size_t* bytes, int n, cudaStream_t stream);

}  // namespace shardflow::cuda
