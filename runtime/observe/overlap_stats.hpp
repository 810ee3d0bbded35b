// The figures behind Runtime::stats(): per synchronised iteration, how long the trainer computed,
// how long it was held up by the runtime (exposed), how long the link was busy and how much of that
// hid behind compute, how long the optimizer ran, and the bytes each collective kind moved.
//
// Every figure is a measure of intervals within the iteration's window (from the end of the last
// wait() to the end of this one): exposed = time the trainer thread was blocked in a runtime wait
// (wait(), wait_param(), backpressure in grad()), compute = the window minus exposed, link = busy
// comm-stream time, hidden = link time outside the blocked intervals. Collectives that straddle a
// window boundary count where they complete (forward prefetch: a sync issued in one iteration and
// completed in the next forward is hidden behind that forward).
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <vector>

#include "shardflow/shardflow.hpp"

namespace shardflow {

class OverlapStats {
 public:
  using Time = std::int64_t;  // microseconds
  // A collective on the link: [begin, end), of kind `kind` (CollectiveKind) moving `bytes` (`wire`
  // of them on this rank's link: wire_bytes); a
  // parameter sync or a reduction (norm exchanges count as reductions). For bucket `bucket` (-1:
  // none), also when it was issued (Note [Choosing the interleave lag]).
  // `ready`: when it could have gone out, its turn aside (-1: unknown; `issued` stands in).
  void link(Time begin, Time end, int kind, std::size_t bytes, std::size_t wire, bool sync, std::int64_t bucket, Time issued, Time ready = -1);
  // The first gradient of a synchronised pass (forward and zero_grad ended), and finish_backward.
  void backward_started(Time t);
  void backward_ended(Time t);
  // The open window so far: the trainer's backward, and the link time of its reductions and of
  // parameter syncs (forward prefetch sizes its split from these: Note [Forward prefetch]).
  struct Open {
    double backward_ms = 0, reduce_ms = 0, sync_ms = 0;
    // Per bucket: from its reduction's completion to the moment its sync could go out (the hops
    // and the step between them), -1 where either is missing. Note [Choosing the interleave lag],
    // Note [The step chain, its turn aside].
    std::vector<double> step_chain_ms;
  };
  Open open_window() const;
  // `t` less the time the trainer was held up in this window before it: where `t` falls on the
  // trainer's own clock (the times of a pass with stage 2 backpressure, as if never held up).
  Time unblocked(Time t) const;
  void blocked(Time begin, Time end);
  void optimizer(Time begin, Time end);
  // The trainer started working on an iteration (first call of a window opens it).
  void touch(Time t);
  // A synchronised iteration ended at `t`; `done_in_backward` of `buckets` were complete when
  // backward finished; `bucket_ready[b]`: when bucket b's last gradient came in (its bound).
  // `with_bound`: false where the window's collectives are not one pass's (Note [A window of
  // another schedule]): its bound_ms stays 0.
  void end_iteration(Time t, std::uint64_t iteration, std::size_t buckets, std::size_t done_in_backward,
                     const std::vector<Time>& bucket_ready = {}, bool with_bound = true);
  RuntimeStats snapshot() const;
  IterationStats last() const {
    std::lock_guard lock(mu_);
    return steps_.empty() ? IterationStats{} : steps_.back();
  }

 private:
  struct Interval {
    Time begin, end;
  };
  mutable std::mutex mu_;
  Time window_start_ = -1, first_grad_ = -1, backward_end_ = -1;
  Time sync_us_ = 0, reduce_us_ = 0;
  std::vector<Interval> link_, blocked_, optimizer_;
  std::vector<Time> reduce_done_, sync_ready_;  // per bucket in this window, -1: not yet
  std::vector<Time> reduce_link_us_, sync_link_us_;  // per bucket in this window: its time on the link
  double window_bound_ms(Time lo, const std::vector<Time>& bucket_ready, std::size_t buckets) const;
  std::array<std::uint64_t, 5> bytes_{};
  std::uint64_t wire_bytes_ = 0;
  std::vector<IterationStats> steps_;
};

}  // namespace shardflow
