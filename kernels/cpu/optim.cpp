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

void adam_step(float* p, const float* g, float* m, float* v, std::size_t n, const AdamHyper& h,
               std::int64_t step) {
  // torch computes the bias corrections as Python floats (double) and hands the tensor ops float
  // scalars; doing the same keeps us within rounding of PyTorch.
  const double bc1 = 1.0 - std::pow(double(h.beta1), double(step));
  const double bc2 = 1.0 - std::pow(double(h.beta2), double(step));
  const float step_size = float(double(h.lr) / bc1);
  const float bc2_sqrt = float(std::sqrt(bc2));
  const float b1 = h.beta1, b2 = h.beta2, one_b1 = 1.0f - h.beta1, one_b2 = 1.0f - h.beta2;
  const float eps = h.eps, wd = h.weight_decay;
  const float decay = float(1.0 - double(h.lr) * double(h.weight_decay));
  const bool decoupled = h.decoupled_weight_decay;
  for (std::size_t i = 0; i < n; ++i) {
    float grad = g[i];
    float param = p[i];
    if (wd != 0.0f) {
      if (decoupled)
        param = param * decay;
      else
        grad = grad + wd * param;
    }
    const float mi = m[i] * b1 + grad * one_b1;
    const float vi = v[i] * b2 + one_b2 * grad * grad;
    m[i] = mi;
    v[i] = vi;
    const float denom = std::sqrt(vi) / bc2_sqrt + eps;
    p[i] = param - step_size * (mi / denom);
  }
}

}  // namespace shardflow::kernels
