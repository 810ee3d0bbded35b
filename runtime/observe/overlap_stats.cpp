#include "runtime/observe/overlap_stats.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <stdexcept>

#include "runtime/plans/iteration_bound.hpp"

namespace shardflow {
namespace {

constexpr std::size_t kKeepSteps = 10000;

using Time = OverlapStats::Time;

// Total length of the union of `v` clipped to [lo, hi].
template <class I>
Time covered(std::vector<I> v, Time lo, Time hi) {
  for (auto& i : v) {
    i.begin = std::max(i.begin, lo);
    i.end = std::min(i.end, hi);
  }
  std::sort(v.begin(), v.end(), [](const I& a, const I& b) { return a.begin < b.begin; });
  Time total = 0, cur_b = 0, cur_e = -1;
  for (const auto& i : v) {
    if (i.end <= i.begin) continue;
    if (i.begin > cur_e) {
      if (cur_e > cur_b) total += cur_e - cur_b;
      cur_b = i.begin;
      cur_e = i.end;
    } else {
      cur_e = std::max(cur_e, i.end);
    }
  }
  if (cur_e > cur_b) total += cur_e - cur_b;
  return total;
}

double median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const auto n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

// Note [The step chain, its turn aside]
// The interleave lag is chosen from the step chain: a bucket's reduction's completion to its sync.
// Measured to the sync's issue, it held the sync's wait for its turn as well: at lag L a sync goes
// out only after the reduction of bucket b + L, so the chain measured on the fifth iteration, the
// one the lag is chosen again on, grew by up to L gradients' time, and chose a lag again. One
// outlier on the first iteration (the ranks' first reductions, waiting for each other: 5 ms a
// bucket against 0.8 steady) then stuck (test_overlap, world 3 at stage 2: lag 5, then chains of
// 13, 9 and 4 ms, lag 2 for good, in 1 run of 5 on a busy 2-core VM). So the chain ends when the
// comm stream was told the sync was ready, whenever its turn came.
void OverlapStats::link(Time begin, Time end, int kind, std::size_t bytes, std::size_t wire, bool sync, std::int64_t bucket, Time issued,
                        Time ready) {
  std::lock_guard lock(mu_);
  link_.push_back({begin, end});
  (sync ? sync_us_ : reduce_us_) += end - begin;
  if (kind >= 0 && kind < int(bytes_.size())) bytes_[std::size_t(kind)] += bytes;
  wire_bytes_ += wire;
  if (bucket < 0) return;
  const auto b = std::size_t(bucket);
  if (b >= reduce_done_.size()) {
    reduce_done_.resize(b + 1, -1);
    sync_ready_.resize(b + 1, -1);
    reduce_link_us_.resize(b + 1, 0);
    sync_link_us_.resize(b + 1, 0);
  }
  (sync ? sync_link_us_ : reduce_link_us_)[b] += end - begin;
  if (sync) {
    const Time could = ready >= 0 ? std::min(ready, issued) : issued;
    sync_ready_[b] = sync_ready_[b] < 0 ? could : std::min(sync_ready_[b], could);  // its first op
  } else {
    reduce_done_[b] = std::max(reduce_done_[b], end);  // its last op
  }
}

void OverlapStats::blocked(Time begin, Time end) {
  std::lock_guard lock(mu_);
  if (window_start_ < 0) window_start_ = begin;
  blocked_.push_back({begin, end});
}

void OverlapStats::optimizer(Time begin, Time end) {
  std::lock_guard lock(mu_);
  optimizer_.push_back({begin, end});
}

void OverlapStats::backward_started(Time t) {
  std::lock_guard lock(mu_);
  if (window_start_ < 0) window_start_ = t;
  if (first_grad_ < 0) first_grad_ = t;
}

void OverlapStats::backward_ended(Time t) {
  std::lock_guard lock(mu_);
  backward_end_ = t;
}

OverlapStats::Open OverlapStats::open_window() const {
  std::lock_guard lock(mu_);
  Open o;
  // The trainer's own backward: without the time it was held up (stage 2 backpressure).
  if (first_grad_ >= 0 && backward_end_ >= first_grad_)
    o.backward_ms = double(backward_end_ - first_grad_ - covered(blocked_, first_grad_, backward_end_)) / 1e3;
  o.reduce_ms = double(reduce_us_) / 1e3;
  o.sync_ms = double(sync_us_) / 1e3;
  o.step_chain_ms.assign(reduce_done_.size(), -1.0);
  for (std::size_t b = 0; b < reduce_done_.size(); ++b)
    if (reduce_done_[b] >= 0 && sync_ready_[b] >= 0) o.step_chain_ms[b] = double(sync_ready_[b] - reduce_done_[b]) / 1e3;
  return o;
}

OverlapStats::Time OverlapStats::unblocked(Time t) const {
  std::lock_guard lock(mu_);
  return window_start_ < 0 ? t : t - covered(blocked_, window_start_, t);
}

void OverlapStats::touch(Time t) {
  std::lock_guard lock(mu_);
  if (window_start_ < 0) window_start_ = t;
}

// The bound on this window's own times (Note [The iteration's bound]), on the trainer's clock (the
// time it was held up left out). Forward is one span here (the runtime sees only its start and the
// first gradient): it is split between the buckets in proportion to their reductions' link time,
// that is their size, and needs them last bucket first, as backward filled them first to last.
// The steps count as free, so it stays a bound when they run beside compute. Syncs that complete
// in this window's forward belong to the iteration before (forward prefetch): in a steady run they
// take what this one's will.
double OverlapStats::window_bound_ms(Time lo, const std::vector<Time>& bucket_ready, std::size_t buckets) const {
  if (buckets == 0 || first_grad_ < 0 || bucket_ready.size() < buckets) return 0;
  auto on_trainer = [&](Time x) { return x - covered(blocked_, lo, x); };
  const Time g0 = on_trainer(first_grad_);
  IterationTimes t;
  double sizes = 0;
  for (std::size_t b = 0; b < buckets; ++b) {
    if (bucket_ready[b] < first_grad_) return 0;  // not ready in this pass: nothing measured
    t.gradient_ms.push_back(double(on_trainer(bucket_ready[b]) - g0) / 1e3);
    t.reduce_ms.push_back(b < reduce_link_us_.size() ? double(reduce_link_us_[b]) / 1e3 : 0.0);
    t.sync_ms.push_back(b < sync_link_us_.size() ? double(sync_link_us_[b]) / 1e3 : 0.0);
    t.step_ms.push_back(0.0);
    sizes += t.reduce_ms.back();
  }
  const double forward = double(g0 - lo) / 1e3;
  for (std::size_t i = 0; i < buckets; ++i) {
    const auto b = std::uint32_t(buckets - 1 - i);
    t.forward_order.push_back(b);
    t.forward_ms.push_back(sizes > 0 ? forward * t.reduce_ms[b] / sizes : forward / double(buckets));
  }
  try {
    return iteration_bound(t).iteration_ms;
  } catch (const std::invalid_argument&) {
    return 0;  // a clock that ran backwards: no figure rather than a wrong one
  }
}

void OverlapStats::end_iteration(Time t, std::uint64_t iteration, std::size_t buckets, std::size_t done_in_backward,
                                 const std::vector<Time>& bucket_ready, bool with_bound) {
  std::lock_guard lock(mu_);
  const Time lo = window_start_ < 0 ? t : window_start_, hi = t;
  IterationStats s;
  s.iteration = iteration;
  s.iteration_ms = double(hi - lo) / 1e3;
  const Time exposed = covered(blocked_, lo, hi);
  std::vector<Interval> link_or_blocked = link_;
  link_or_blocked.insert(link_or_blocked.end(), blocked_.begin(), blocked_.end());
  s.exposed_ms = double(exposed) / 1e3;
  s.compute_ms = s.iteration_ms - s.exposed_ms;
  s.link_ms = double(covered(link_, lo, hi)) / 1e3;
  s.hidden_ms = double(covered(link_or_blocked, lo, hi) - exposed) / 1e3;  // link time outside the blocked intervals
  s.optimizer_ms = double(covered(optimizer_, lo, hi)) / 1e3;
  s.buckets = buckets;
  s.buckets_done_in_backward = done_in_backward;
  s.bytes = bytes_;
  s.wire_bytes = wire_bytes_;
  if (with_bound) {  // a window of two passes' syncs (or none) tells nothing of one pass's
    s.bound_ms = window_bound_ms(lo, bucket_ready, buckets);
    if (s.bound_ms > 0) s.over_bound = s.iteration_ms / s.bound_ms;
  }
  bytes_ = {};
  wire_bytes_ = 0;
  sync_us_ = reduce_us_ = 0;
  first_grad_ = backward_end_ = -1;
  reduce_done_.clear();
  sync_ready_.clear();
  reduce_link_us_.clear();
  sync_link_us_.clear();
  // Intervals still running past the window's end count in the next one.
  auto keep = [hi](std::vector<Interval>& v) { std::erase_if(v, [hi](const Interval& i) { return i.end <= hi; }); };
  keep(link_);
  keep(blocked_);
  keep(optimizer_);
  window_start_ = hi;
  steps_.push_back(s);
  if (steps_.size() > kKeepSteps) steps_.erase(steps_.begin());
}

RuntimeStats OverlapStats::snapshot() const {
  std::lock_guard lock(mu_);
  RuntimeStats r;
  r.steps = steps_;
  // Median over the steps after the first five (warm-up, the bucket rebuild); all of them when
  // there are no more than five.
  const std::size_t skip = steps_.size() > 5 ? 5 : 0;
  auto med = [&](auto field) {
    std::vector<double> v;
    for (std::size_t i = skip; i < steps_.size(); ++i) v.push_back(double(field(steps_[i])));
    return median_of(std::move(v));
  };
  auto& m = r.median;
  m.iteration = steps_.empty() ? 0 : steps_.back().iteration;
  m.iteration_ms = med([](const IterationStats& s) { return s.iteration_ms; });
  m.compute_ms = med([](const IterationStats& s) { return s.compute_ms; });
  m.link_ms = med([](const IterationStats& s) { return s.link_ms; });
  m.hidden_ms = med([](const IterationStats& s) { return s.hidden_ms; });
  m.exposed_ms = med([](const IterationStats& s) { return s.exposed_ms; });
  m.optimizer_ms = med([](const IterationStats& s) { return s.optimizer_ms; });
  m.buckets = std::size_t(med([](const IterationStats& s) { return s.buckets; }));
  m.buckets_done_in_backward = std::size_t(med([](const IterationStats& s) { return s.buckets_done_in_backward; }));
  for (std::size_t k = 0; k < m.bytes.size(); ++k) m.bytes[k] = std::uint64_t(med([k](const IterationStats& s) { return s.bytes[k]; }));
  m.wire_bytes = std::uint64_t(med([](const IterationStats& s) { return s.wire_bytes; }));
  // The bound's figures over the iterations that have one (Note [A window of another schedule]).
  auto med_bounded = [&](auto field) {
    std::vector<double> v;
    for (std::size_t i = skip; i < steps_.size(); ++i)
      if (steps_[i].bound_ms > 0) v.push_back(field(steps_[i]));
    return median_of(std::move(v));
  };
  m.bound_ms = med_bounded([](const IterationStats& s) { return s.bound_ms; });
  m.over_bound = med_bounded([](const IterationStats& s) { return s.over_bound; });
  return r;
}

namespace {
nlohmann::json to_json(const IterationStats& s) {
  nlohmann::json bytes = nlohmann::json::object();
  for (std::size_t k = 0; k < s.bytes.size(); ++k) bytes[collective_name(CollectiveKind(k))] = s.bytes[k];
  return {{"iteration", s.iteration},       {"iteration_ms", s.iteration_ms}, {"compute_ms", s.compute_ms},
          {"link_ms", s.link_ms},           {"hidden_ms", s.hidden_ms},       {"exposed_ms", s.exposed_ms},
          {"optimizer_ms", s.optimizer_ms}, {"buckets", s.buckets},           {"buckets_done_in_backward", s.buckets_done_in_backward},
          {"bytes", bytes},                 {"wire_bytes", s.wire_bytes},     {"bound_ms", s.bound_ms},
          {"over_bound", s.over_bound}};
}
}  // namespace

std::string RuntimeStats::to_json() const {
  nlohmann::json steps_j = nlohmann::json::array();
  for (const auto& s : steps) steps_j.push_back(shardflow::to_json(s));
  return nlohmann::json{{"median", shardflow::to_json(median)}, {"steps", steps_j}}.dump(1);
}

}  // namespace shardflow
