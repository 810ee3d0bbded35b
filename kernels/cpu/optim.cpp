#include "kernels/cpu/optim.hpp"

#include <cmath>

namespace shardflow::kernels {

void sgd_step(float* p, const float* g, float* buf, std::size_t n, const SgdHyper& h, bool first) {
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

namespace {

// One loop per weight-decay mode, so the element loop has no branches and vectorises. In place
// (the parameters and state stepped where they are) or from kept buffers into others: two loops,
// because a loop whose inputs may alias its outputs in any way does not vectorise (GCC gives up
// on the run-time overlap checks of seven pointers: the step took twice as long).
template <bool kL2, bool kDecoupled>
inline void adam_element(float& p_out, float& m_out, float& v_out, float param, float grad, float m_in, float v_in, float b1, float b2,
                         float one_b1, float one_b2, float eps, float wd, float decay, float step_size, float bc2_sqrt) {
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
void adam_loop(float* p, const float* g, float* m, float* v, std::size_t n, float b1, float b2, float one_b1, float one_b2, float eps,
               float wd, float decay, float step_size, float bc2_sqrt) {
  for (std::size_t i = 0; i < n; ++i)
    adam_element<kL2, kDecoupled>(p[i], m[i], v[i], p[i], g[i], m[i], v[i], b1, b2, one_b1, one_b2, eps, wd, decay, step_size, bc2_sqrt);
}

template <bool kL2, bool kDecoupled>
void adam_loop_from(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v, const float* __restrict p_in,
                    const float* __restrict m_in, const float* __restrict v_in, std::size_t n, float b1, float b2, float one_b1,
                    float one_b2, float eps, float wd, float decay, float step_size, float bc2_sqrt) {
  for (std::size_t i = 0; i < n; ++i)
    adam_element<kL2, kDecoupled>(p[i], m[i], v[i], p_in[i], g[i], m_in[i], v_in[i], b1, b2, one_b1, one_b2, eps, wd, decay, step_size,
                                  bc2_sqrt);
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
  const bool from = p_in != nullptr;  // out of place: all three read from their own buffers
  auto run = [&](auto in_place, auto out_of_place) {
    if (from)
      out_of_place(p, g, m, v, p_in, m_in, v_in, n, h.beta1, h.beta2, 1.0f - h.beta1, 1.0f - h.beta2, h.eps, wd, decay, step_size, bc2_sqrt);
    else
      in_place(p, g, m, v, n, h.beta1, h.beta2, 1.0f - h.beta1, 1.0f - h.beta2, h.eps, wd, decay, step_size, bc2_sqrt);
  };
  if (wd == 0.0f)
    run(adam_loop<false, false>, adam_loop_from<false, false>);
  else if (h.decoupled_weight_decay)
    run(adam_loop<false, true>, adam_loop_from<false, true>);
  else
    run(adam_loop<true, false>, adam_loop_from<true, false>);
}

}  // namespace shardflow::kernels
