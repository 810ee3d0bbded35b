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

// One loop per weight-decay mode, so the element loop has no branches and vectorises.
template <bool kL2, bool kDecoupled>
void adam_loop(float* p, const float* g, float* m, float* v, std::size_t n, float b1, float b2, float one_b1,
               float one_b2, float eps, float wd, float decay, float step_size, float bc2_sqrt) {
  for (std::size_t i = 0; i < n; ++i) {
    float grad = g[i];
    float param = p[i];
    if constexpr (kDecoupled) param = param * decay;
    if constexpr (kL2) grad = grad + wd * param;
    const float mi = m[i] * b1 + grad * one_b1;
    const float vi = v[i] * b2 + one_b2 * grad * grad;
    m[i] = mi;
    v[i] = vi;
    const float denom = std::sqrt(vi) / bc2_sqrt + eps;
    p[i] = param - step_size * (mi / denom);
  }
}

}  // namespace

void adam_step(float* p, const float* g, float* m, float* v, std::size_t n, const AdamHyper& h,
               std::int64_t step) {
  // torch computes the bias corrections as Python floats (double) and hands the tensor ops float
  // scalars; doing the same keeps us within rounding of PyTorch.
  const double bc1 = 1.0 - std::pow(double(h.beta1), double(step));
  const double bc2 = 1.0 - std::pow(double(h.beta2), double(step));
  const float step_size = float(double(h.lr) / bc1);
  const float bc2_sqrt = float(std::sqrt(bc2));
  const float decay = float(1.0 - double(h.lr) * double(h.weight_decay));
  const float wd = h.weight_decay;
  auto run = [&](auto loop) {
    loop(p, g, m, v, n, h.beta1, h.beta2, 1.0f - h.beta1, 1.0f - h.beta2, h.eps, wd, decay, step_size, bc2_sqrt);
  };
  if (wd == 0.0f)
    run(adam_loop<false, false>);
  else if (h.decoupled_weight_decay)
    run(adam_loop<false, true>);
  else
    run(adam_loop<true, false>);
}

}  // namespace shardflow::kernels
