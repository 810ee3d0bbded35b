// The shortest iteration any schedule of a bucket plan could reach, from its measured times.
//
// Note [The iteration's bound]
// Efficiency against max(T_comp, T_comm) says how much of the smaller of the two was hidden, but
// not how much could have been: the layers' dependencies forbid full overlap (nothing is reduced
// before backward produces it; forward's first layer needs its parameters synced before the
// iteration's last gradient has even been reduced). The bound takes the dependencies as they are
// and the link as one resource, and asks for the period T between two backward starts:
//   - compute: backward, then the next forward, one after the other: T >= B + F;
//   - the link: each bucket's reduction is a job released when backward produced its gradient;
//     its sync a job released when the reduction and the bucket's step could have ended at the
//     earliest. Each carries a tail: what must still follow it before T (the step, the sync and
//     the forward from that bucket's layers on, for a reduction; that forward, for a sync).
//     T >= C_j + tail_j for every job j, whatever order the link serves them in.
// Every reduction and sync of iteration k lies between backward k's start and backward k+1's
// start (forward k+1 needs every sync, and the next reductions wait for backward k+1), so one
// window of length T holds them. The least max(C_j + tail_j) over orders with preemption allowed
// is Jackson's rule (serve the released job with the longest tail), exact for that relaxation and
// therefore a lower bound on every real schedule: any schedule the comm stream can issue, with any
// bucket order, priority or number of syncs in backward, takes at least this long.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace shardflow {

struct IterationTimes {
  std::vector<std::uint32_t> forward_order;  // every bucket once, in the order forward first needs it
  std::vector<double> forward_ms;            // [i]: forward from needing forward_order[i] until needing the next (the last: until backward)
  std::vector<double> gradient_ms;           // per bucket: from backward's start until its last gradient is in
  std::vector<double> reduce_ms;             // per bucket: its reduction's time on the link
  std::vector<double> sync_ms;               // per bucket: its parameter sync's time on the link (0: none, DDP)
  std::vector<double> step_ms;               // per bucket: its optimizer step between the two (0: free or none)
};

struct IterationBound {
  double iteration_ms = 0;  // the bound: max(compute_ms, chain_ms)
  double compute_ms = 0;    // T_comp = B + F
  double link_ms = 0;       // T_comm: the link's work alone, every reduction and sync back to back
  double chain_ms = 0;      // Jackson's bound on the link jobs with their release times and tails (>= link_ms)
  std::string binding;      // "compute" or "the link and the dependencies": which one sets the bound
};

// Throws std::invalid_argument naming the field whose length or values do not fit.
IterationBound iteration_bound(const IterationTimes& t);

// Efficiency of a measured iteration against the bound: the share of the overlap the bound allows
// that the measured iteration reached, (T_comp + T_comm - T_iter) / (T_comp + T_comm - bound);
// 1 at the bound, 0 with nothing overlapped. 1 when the bound allows no overlap at all.
double efficiency_against_bound(double iteration_ms, const IterationBound& bound);

}  // namespace shardflow
