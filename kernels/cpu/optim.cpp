#include "kernels/cpu/optim.hpp"

#include <cmath>

#include "kernels/cpu/vector_isa.hpp"

// Each element loop below is compiled for x86-64's baseline and, through a wrapper of the target
// "avx2", for AVX2, and the step picks one at run time: the same bits either way (Note [Vector
// loops, the same bits], kernels/cpu/vector_isa.cpp). The loops are always inlined so that the
// wrapper's copy is the one compiled for AVX2.
#if defined(__x86_64__) && defined(__GNUC__)
#define SHARDFLOW_AVX2_LOOPS 1
#define SHARDFLOW_TARGET_AVX2 __attribute__((target("avx2")))
#endif

namespace shardflow::kernels {

namespace {

template <typename Loop, typename... Args>
void run_loop(Args... args) {
#ifdef SHARDFLOW_AVX2_LOOPS
  if (vector_isa() == VectorIsa::avx2) return Loop::avx2(args...);
#endif
  Loop::baseline(args...);
}

[[gnu::always_inline]] inline void sgd_loop(float* p, const float* g, float* buf, std::size_t n, SgdHyper h, bool first) {
  const float wd = h.weight_decay, mom = h.momentum, damp = 1.0f - h.dampening, lr = h.lr;
  for (std::size_t i = 0; i < n; ++i) {
    float d = g[i];
    if (wd != 0.0f) d = d + wd * p[i];
    if (mom != 0.0f) {
      const float b = first ? d : buf[i] * mom + damp * d;
      buf[i] = b;
      d = h.nesterov ? d + mom * b : b;
    }
    p[i] = p[i] - lr * d;
  }
}

struct SgdLoop {
  static void baseline(float* p, const float* g, float* buf, std::size_t n, SgdHyper h, bool first) { sgd_loop(p, g, buf, n, h, first); }
#ifdef SHARDFLOW_AVX2_LOOPS
  SHARDFLOW_TARGET_AVX2 static void avx2(float* p, const float* g, float* buf, std::size_t n, SgdHyper h, bool first) {
    sgd_loop(p, g, buf, n, h, first);
  }
#endif
};

}  // namespace

void sgd_step(float* p, const float* g, float* buf, std::size_t n, const SgdHyper& h, bool first) {
  run_loop<SgdLoop>(p, g, buf, n, h, first);
}

namespace {

// One loop per weight-decay mode, so the element loop has no branches and vectorises. In place
// (the parameters and state stepped where they are) or from kept buffers into others: two loops,
// because a loop whose inputs may alias its outputs in any way does not vectorise (GCC gives up
// on the run-time overlap checks of seven pointers: the step took twice as long).
template <bool kL2, bool kDecoupled>
[[gnu::always_inline]] inline void adam_element(float& p_out, float& m_out, float& v_out, float param, float grad, float m_in, float v_in,
                                                float b1, float b2, float one_b1, float one_b2, float eps, float wd, float decay,
                                                float step_size, float bc2_sqrt) {
  if constexpr (kDecoupled) param = param * decay;
  if constexpr (kL2) grad = grad + wd * param;
  const float mi = m_in * b1 + grad * one_b1;
  const float vi = v_in * b2 + one_b2 * grad * grad;
  m_out = mi;
  v_out = vi;
  const float denom = std::sqrt(vi) / bc2_sqrt + eps;
  p_out = param - step_size * (mi / denom);
}

template <bool kL2, bool kDecoupled>
[[gnu::always_inline]] inline void adam_loop(float* p, const float* g, float* m, float* v, std::size_t n, float b1, float b2, float one_b1,
                                             float one_b2, float eps, float wd, float decay, float step_size, float bc2_sqrt) {
  for (std::size_t i = 0; i < n; ++i)
    adam_element<kL2, kDecoupled>(p[i], m[i], v[i], p[i], g[i], m[i], v[i], b1, b2, one_b1, one_b2, eps, wd, decay, step_size, bc2_sqrt);
}

template <bool kL2, bool kDecoupled>
[[gnu::always_inline]] inline void adam_loop_from(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v,
                                                  const float* __restrict p_in, const float* __restrict m_in, const float* __restrict v_in,
                                                  std::size_t n, float b1, float b2, float one_b1, float one_b2, float eps, float wd,
                                                  float decay, float step_size, float bc2_sqrt) {
  for (std::size_t i = 0; i < n; ++i)
    adam_element<kL2, kDecoupled>(p[i], m[i], v[i], p_in[i], g[i], m_in[i], v_in[i], b1, b2, one_b1, one_b2, eps, wd, decay, step_size,
                                  bc2_sqrt);
}

// One weight-decay mode's loop, in place or from kept buffers, for each instruction set.
template <bool kL2, bool kDecoupled, bool kFrom>
struct AdamLoop {
  template <typename... A>
  [[gnu::always_inline]] static void body(A... a) {
    if constexpr (kFrom)
      adam_loop_from<kL2, kDecoupled>(a...);
    else
      adam_loop<kL2, kDecoupled>(a...);
  }
  template <typename... A>
  static void baseline(A... a) {
    body(a...);
  }
#ifdef SHARDFLOW_AVX2_LOOPS
  template <typename... A>
  SHARDFLOW_TARGET_AVX2 static void avx2(A... a) {
    body(a...);
  }
#endif
};

template <bool kL2, bool kDecoupled>
void adam_mode(float* p, const float* g, float* m, float* v, std::size_t n, const float* p_in, const float* m_in, const float* v_in,
               float b1, float b2, float eps, float wd, float decay, float step_size, float bc2_sqrt) {
  if (p_in)  // out of place: all three read from their own buffers
    run_loop<AdamLoop<kL2, kDecoupled, true>>(p, g, m, v, p_in, m_in, v_in, n, b1, b2, 1.0f - b1, 1.0f - b2, eps, wd, decay, step_size,
                                              bc2_sqrt);
  else
    run_loop<AdamLoop<kL2, kDecoupled, false>>(p, g, m, v, n, b1, b2, 1.0f - b1, 1.0f - b2, eps, wd, decay, step_size, bc2_sqrt);
}

}  // namespace

void adam_step(float* p, const float* g, float* m, float* v, std::size_t n, const AdamHyper& h,
               std::int64_t step, const float* p_in, const float* m_in, const float* v_in) {
  // torch computes the bias corrections as Python floats (double) and hands the tensor ops float
  // scalars; doing the same keeps us within rounding of PyTorch.
  const double bc1 = 1.0 - std::pow(double(h.beta1), double(step));
  const double bc2 = 1.0 - std::pow(double(h.beta2), double(step));
  const float step_size = float(double(h.lr) / bc1);
  const float bc2_sqrt = float(std::sqrt(bc2));
  const float decay = float(1.0 - double(h.lr) * double(h.weight_decay));
  const float wd = h.weight_decay;
  if (wd == 0.0f)
    adam_mode<false, false>(p, g, m, v, n, p_in, m_in, v_in, h.beta1, h.beta2, h.eps, wd, decay, step_size, bc2_sqrt);
  else if (h.decoupled_weight_decay)
    adam_mode<false, true>(p, g, m, v, n, p_in, m_in, v_in, h.beta1, h.beta2, h.eps, wd, decay, step_size, bc2_sqrt);
  else
    adam_mode<true, false>(p, g, m, v, n, p_in, m_in, v_in, h.beta1, h.beta2, h.eps, wd, decay, step_size, bc2_sqrt);
}

}  // namespace shardflow::kernels
