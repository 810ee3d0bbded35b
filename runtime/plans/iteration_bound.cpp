#include "runtime/plans/iteration_bound.hpp"

#include <algorithm>
#include <limits>
#include <numeric>
#include <queue>
#include <stdexcept>

namespace shardflow {
namespace {

struct LinkJob {
  double release, work, tail;
};

void check_times(const IterationTimes& t) {
  const std::size_t B = t.gradient_ms.size();
  auto fits = [&](const std::vector<double>& v, const char* name) {
    if (v.size() != B)
      throw std::invalid_argument(std::string("iteration bound: ") + name + " has " + std::to_string(v.size()) + " entries, gradient_ms " +
                                  std::to_string(B) + " (one per bucket)");
    for (std::size_t b = 0; b < B; ++b)
      if (!(v[b] >= 0) || v[b] == std::numeric_limits<double>::infinity())
        throw std::invalid_argument(std::string("iteration bound: ") + name + "[" + std::to_string(b) + "] = " + std::to_string(v[b]) +
                                    " is not a time (finite, >= 0)");
  };
  for (const auto& [v, name] : {std::pair{&t.gradient_ms, "gradient_ms"}, {&t.forward_ms, "forward_ms"}, {&t.reduce_ms, "reduce_ms"},
                                {&t.sync_ms, "sync_ms"}, {&t.step_ms, "step_ms"}})
    fits(*v, name);
  std::vector<char> seen(B, 0);
  if (t.forward_order.size() != B) throw std::invalid_argument("iteration bound: forward_order must name every bucket once");
  for (const auto b : t.forward_order) {
    if (b >= B || seen[b]) throw std::invalid_argument("iteration bound: forward_order must name every bucket once (bucket " + std::to_string(b) + ")");
    seen[b] = 1;
  }
}

// max over jobs of (completion + tail) when the link, preempting freely, always serves the
// released job with the longest tail: the least value any order reaches (Jackson's rule).
double jackson_bound(std::vector<LinkJob> jobs) {
  std::sort(jobs.begin(), jobs.end(), [](const LinkJob& a, const LinkJob& b) { return a.release < b.release; });
  auto by_tail = [](const LinkJob& a, const LinkJob& b) { return a.tail < b.tail; };
  std::priority_queue<LinkJob, std::vector<LinkJob>, decltype(by_tail)> ready(by_tail);
  double now = 0, worst = 0;
  std::size_t next = 0;
  while (next < jobs.size() || !ready.empty()) {
    if (ready.empty()) now = std::max(now, jobs[next].release);
    while (next < jobs.size() && jobs[next].release <= now) ready.push(jobs[next++]);
    LinkJob job = ready.top();
    ready.pop();
    // Runs until it ends or the next release, whichever comes first; a longer-tailed arrival
    // takes over then. Note [Progress in floating point]: what is left of a preempted job is
    // end - release, never work - (release - now): at times of tens of seconds (a sync that
    // spanned a trainer held between steps) the latter can leave a rest below half an ulp of
    // `now`, which then never advances it, and the loop spun for good (CI's ThreadSanitizer run,
    // a rank that never finished its iteration). Each pass either ends a job or admits the next
    // release (release > now), so the loop ends after at most twice the jobs.
    const double end = now + job.work;
    if (next < jobs.size() && jobs[next].release < end) {
      now = jobs[next].release;
      job.work = end - now;
      ready.push(job);
    } else {
      now = end;
      worst = std::max(worst, now + job.tail);
    }
  }
  return worst;
}

}  // namespace

IterationBound iteration_bound(const IterationTimes& t) {
  check_times(t);
  const std::size_t B = t.gradient_ms.size();
  IterationBound out;
  if (B == 0) return out;
  const double backward = *std::max_element(t.gradient_ms.begin(), t.gradient_ms.end());
  const double forward = std::accumulate(t.forward_ms.begin(), t.forward_ms.end(), 0.0);
  out.compute_ms = backward + forward;
  out.link_ms = std::accumulate(t.reduce_ms.begin(), t.reduce_ms.end(), 0.0) + std::accumulate(t.sync_ms.begin(), t.sync_ms.end(), 0.0);
  // Forward still to run once bucket b's parameters are needed: its segment and all after it.
  std::vector<double> forward_from(B, 0.0);
  double rest = 0;
  for (std::size_t i = B; i-- > 0;) forward_from[t.forward_order[i]] = rest += t.forward_ms[i];
  std::vector<LinkJob> jobs;
  for (std::size_t b = 0; b < B; ++b) {
    const double after_sync = forward_from[b];
    jobs.push_back({t.gradient_ms[b], t.reduce_ms[b], t.step_ms[b] + t.sync_ms[b] + after_sync});
    if (t.sync_ms[b] > 0) jobs.push_back({t.gradient_ms[b] + t.reduce_ms[b] + t.step_ms[b], t.sync_ms[b], after_sync});
  }
  // At least the first release plus all the link's work: the link alone never sets it.
  out.chain_ms = jackson_bound(std::move(jobs));
  out.iteration_ms = std::max(out.compute_ms, out.chain_ms);
  out.binding = out.compute_ms >= out.chain_ms ? "compute" : "the link and the dependencies";
  return out;
}

double efficiency_against_bound(double iteration_ms, const IterationBound& bound) {
  const double serial = bound.compute_ms + bound.link_ms;
  const double room = serial - bound.iteration_ms;
  if (room <= 0) return 1.0;
  return (serial - iteration_ms) / room;
}

}  // namespace shardflow
