// gpt_train's learning-rate schedule, and bench/peers/torch_gpt.py's (the same formula, so the two
// programs end in the same place): a linear warm-up over `warmup` steps, then a cosine decay to a
// tenth of the peak at the last step.
#pragma once

#include <algorithm>
#include <cmath>

namespace gpt {

inline float lr_at(float peak, int step, int warmup, int steps) {
  if (step < warmup) return peak * float(step + 1) / float(warmup);
  const int span = std::max(1, steps - warmup);
  const double progress = std::min(1.0, double(step - warmup) / double(span));
  const double floor = 0.1 * peak;
  return float(floor + (peak - floor) * 0.5 * (1.0 + std::cos(M_PI * progress)));
}

}  // namespace gpt
