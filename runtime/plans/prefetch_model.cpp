#include "runtime/plans/prefetch_model.hpp"

#include <algorithm>
#include <numeric>

#include "runtime/plans/collective_schedule.hpp"
#include "runtime/plans/run_plan.hpp"

namespace shardflow {

std::vector<std::uint32_t> complete_forward_order(std::vector<std::uint32_t> order, std::size_t buckets) {
  std::vector<char> have(buckets, 0);
  for (auto b : order) have[b] = 1;
  for (std::size_t b = buckets; b-- > 0;)
    if (!have[b]) order.push_back(std::uint32_t(b));
  return order;
}

std::vector<std::uint32_t> prefetch_sync_order(const std::vector<std::uint32_t>& forward_order, std::size_t early) {
  const std::size_t B = forward_order.size();
  early = std::min(early, B);
  std::vector<char> late(B, 0);
  for (std::size_t i = 0; i < B - early; ++i) late[forward_order[i]] = 1;
  std::vector<std::uint32_t> order;
  order.reserve(B);
  for (std::uint32_t b = 0; b < B; ++b)
    if (!late[b]) order.push_back(b);
  order.insert(order.end(), forward_order.begin(), forward_order.begin() + std::ptrdiff_t(B - early));
  return order;
}

double steady_iteration_ms(const PrefetchTimes& t, std::size_t early) {
  const std::size_t B = t.reduce_ms.size();
  if (B == 0) return 0;
  ScheduleSpec spec;
  spec.buckets = B;
  spec.syncs = true;
  spec.interleave = early > 0;
  spec.lag = t.lag;
  spec.sync_order = prefetch_sync_order(t.forward_order, early);
  spec.interleaved_syncs = early;
  const auto entries = collective_order(spec);
  const std::size_t G = t.grads_in_flight;
  const std::size_t refill = backpressure_refill(G);
  // Iterations until the link's backlog settles (forward waits for the syncs, so it cannot grow
  // without bound), then the mean of the last few.
  constexpr int kIterations = 30, kCounted = 10;
  std::vector<double> available(B, 0.0), grad(B), reduced(B), synced(B);
  double now = 0, link = 0, start = 0, sum = 0;
  for (int it = 0; it < kIterations; ++it) {
    const double previous = start;
    start = now;
    if (it >= kIterations - kCounted) sum += start - previous;
    for (std::size_t i = 0; i < B; ++i) now = std::max(now, available[t.forward_order[i]]) + t.forward_ms[i];
    // Backward's gradients in bucket order, each delayed by the waits for a free buffer before it
    // (Note [Backpressure in the replay]); a reduction needs only the gradients up to its own.
    // A wait lasts until `refill` buffers are free, and the buckets those free go on without one
    // (Note [Backpressure in refills]).
    double held = 0, backward_end = now;
    std::size_t produced = 0, free_until = 0;
    auto produce_up_to = [&](std::size_t last) {
      for (; produced <= last; ++produced) {
        const std::size_t b = produced;
        if (G && b >= G && b >= free_until) {
          const double begins = now + (b ? t.gradient_ms[b - 1] : 0.0) + held;
          if (reduced[b - G] > begins) {
            const double freed = *std::max_element(reduced.begin() + std::ptrdiff_t(b - G), reduced.begin() + std::ptrdiff_t(b - G + refill));
            held += freed - begins;
            free_until = b + refill;
          }
        }
        backward_end = std::max(backward_end, grad[b] = now + t.gradient_ms[b] + held);
      }
    };
    for (const auto& e : entries) {
      if (e.kind == ScheduledCollective::reduce) {
        produce_up_to(e.bucket);
        link = reduced[e.bucket] = std::max(link, grad[e.bucket]) + t.reduce_ms[e.bucket];
      } else if (e.kind == ScheduledCollective::sync) {
        link = synced[e.bucket] = std::max(link, reduced[e.bucket]) + t.sync_ms[e.bucket];
      }
    }
    if (B) produce_up_to(B - 1);
    now = backward_end;  // wait() returns once backward is handed over
    available = synced;
  }
  return sum / kCounted;
}

PrefetchChoice best_early_syncs(const PrefetchTimes& t) {
  const std::size_t B = t.reduce_ms.size();
  // Each candidate replays B buckets for a few dozen iterations: past a few hundred buckets every
  // K would cost seconds at the end of iteration 2, so a grid of 256 values is tried instead.
  const std::size_t step = std::max<std::size_t>(1, (B + 255) / 256);
  std::vector<PrefetchChoice> tried;
  for (std::size_t k = 0; k <= B; k = k == B ? B + 1 : std::min(B, k + step)) tried.push_back({k, steady_iteration_ms(t, k)});
  double best = tried.front().iteration_ms;
  for (const auto& c : tried) best = std::min(best, c.iteration_ms);
  PrefetchChoice pick = tried.front();
  for (const auto& c : tried)
    if (c.iteration_ms <= best * (1 + 1e-3)) pick = c;  // ties: the larger K
  return pick;
}

PrefetchTimes observed_prefetch_times(std::vector<std::uint32_t> forward_order, const std::vector<std::int64_t>& asked_us,
                                      const std::vector<std::int64_t>& gradient_us, const std::vector<double>& link_weight,
                                      double reduce_ms, double sync_ms, std::size_t lag) {
  const std::size_t B = gradient_us.size();
  const std::size_t asked = std::min(forward_order.size(), asked_us.size());
  forward_order.resize(asked);

  PrefetchTimes t;
  t.lag = lag;
  t.forward_order = complete_forward_order(std::move(forward_order), B);
  t.forward_ms.assign(B, 0.0);
  t.gradient_ms.assign(B, 0.0);
  t.reduce_ms.assign(B, 0.0);
  t.sync_ms.assign(B, 0.0);
  if (B == 0) return t;
  std::int64_t first_grad = -1, last_grad = -1;
  for (auto g : gradient_us)
    if (g >= 0) {
      first_grad = first_grad < 0 ? g : std::min(first_grad, g);
      last_grad = std::max(last_grad, g);
    }
  if (first_grad < 0) first_grad = last_grad = asked ? asked_us[asked - 1] : 0;
  for (std::size_t i = 0; i + 1 < asked; ++i) t.forward_ms[i] = double(std::max<std::int64_t>(0, asked_us[i + 1] - asked_us[i])) / 1e3;
  const double mean_forward = asked >= 2 ? double(asked_us[asked - 1] - asked_us[0]) / double(asked - 1) : 0;
  const double mean_backward = B >= 2 ? double(last_grad - first_grad) / double(B - 1) : 0;
  const double forward_share = mean_forward + mean_backward > 0 ? mean_forward / (mean_forward + mean_backward) : 0.5;
  double backward_start = double(first_grad);
  if (asked) {
    const double gap = double(std::max<std::int64_t>(0, first_grad - asked_us[asked - 1]));
    t.forward_ms[asked - 1] = gap * forward_share / 1e3;
    backward_start -= gap * (1 - forward_share);
  }
  for (std::size_t b = 0; b < B; ++b)
    t.gradient_ms[b] = (double(gradient_us[b] < 0 ? first_grad : gradient_us[b]) - backward_start) / 1e3;
  const double total = std::accumulate(link_weight.begin(), link_weight.end(), 0.0);
  for (std::size_t b = 0; b < B && total > 0; ++b) {
    t.reduce_ms[b] = reduce_ms * link_weight[b] / total;
    t.sync_ms[b] = sync_ms * link_weight[b] / total;
  }
  return t;
}

}  // namespace shardflow
