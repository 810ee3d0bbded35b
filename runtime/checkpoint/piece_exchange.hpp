// Moving state in parameter coordinates to the ranks that need it, each element once
// (Note [Pieces to their new owners]).
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "runtime/plans/shard_plan.hpp"
#include "shardflow/communicator.hpp"

namespace shardflow {

// Half-open ranges [lo, hi) of parameter coordinates, sorted and disjoint.
struct Span {
  std::size_t lo = 0, hi = 0;
  bool operator==(const Span&) const = default;
};
using Spans = std::vector<Span>;

// Every piece `rank` owns in the plan, over all buckets, as spans (adjacent ones merged).
Spans owned_spans(const ShardPlan& sp, const std::vector<std::size_t>& param_base, int rank);
Spans unite(const Spans& a, const Spans& b);
Spans intersect(const Spans& a, const Spans& b);
Spans subtract(const Spans& a, const Spans& b);  // what a covers and b does not
Spans clip(const Spans& a, std::size_t lo, std::size_t hi);
std::size_t length(const Spans& a);

// Note [Pieces to their new owners]
// A rebuild or a restore from the twins has every element of the state on one rank (its holder)
// and wants it on others (its new owner and the owner's twin; the parameters' values on every
// rank). Summing windows in which each element is one rank's value and zeros elsewhere gets it
// there (Note [State migration]), but an all-reduce puts 2 (W - 1) / W of the whole window on
// each rank's link, wherever the element has to go. Here each element crosses once, and only to a
// rank that needs it and does not hold it: for each distance d = 1 .. W - 1 every rank packs what
// it holds and rank + d needs, and one shift by d moves the packs (Note [Shift]: every rank
// issues the same ops in the same order, so the collectives stay ordered). Where the backend
// shifts unequal counts (Gloo: CollectiveOp::recv_count) each pack goes as it is; elsewhere a
// shift moves one count per rank, so each is padded to the longest pack at its distance (a copy
// in memory there, not a link; over two levels the longest of its sub-collective's ranks, and only
// inside the hosts: the shifts by whole hosts run on Gloo's lanes, which take each rank's own
// count, so no padding crosses the link; Note [Pieces over two levels]): every rank computes the
// counts from the same spans. What a rank holds is written where it is; what arrives is written
// into the same window at coordinates the rank does not hold, so the packs still to go are not
// overwritten. A needed element that no rank holds is an error, never a zero taken for state.
struct PieceExchange {
  int rank = 0, world = 1;
  std::vector<Spans> holds;  // [rank] what its window holds before the exchange (disjoint across ranks)
  std::vector<Spans> needs;  // [rank] what its window must hold after it
  bool unequal = false;      // the backend shifts unequal counts (Communicator::shifts_unequal): no padding
  int host_ranks = 0;        // > 0: two levels of that many ranks a host (Note [Pieces over two levels])
  bool unequal_in_host = false;  // the same for the shifts inside the hosts (two levels: shared memory pads)
};

// Note [Pieces over two levels]
// Two levels (Note [Two-level collectives]) shift only by whole hosts, along each local index's
// lane, and inside each host (CollectiveOp::in_host). So there a piece goes in one shift only to
// a rank of its holder's host or of its holder's local index, and the exchange's shifts are the
// L - 1 inside the hosts and the H - 1 by whole hosts. The restore's common case fits: a lost
// rank replaced at the same world takes the moments from the twins, whole hosts away, and the
// values from a rank of its own host (Note [Values the ranks hold already] prefers one that a
// shift reaches). A window with a piece that no shift carries (a block every rank's parameters
// got wrong, held by its owner alone and needed on another host and lane) is not exchanged:
// start_window refuses it, and the restore sums that window instead (twin_restore.cpp). Shifts
// by any distance, as a hop inside the host and one between the hosts, were tried: the relay
// does not know its source's count, so every pack was padded to the longest (bench/RESULTS.md).
// Whether a piece goes from rank `from` to rank `to` in one of x's shifts.
bool reaches(const PieceExchange& x, int from, int to);
// Whether every piece of [begin, begin + n) that a rank needs and does not hold goes in one shift.
bool routable(const PieceExchange& x, std::size_t begin, std::size_t n);
// `window` holds this rank's `holds` in [begin, begin + window.size()); afterwards it also holds
// its `needs` there. `run` issues one collective and waits for it; `tag` names the ops.
void exchange_window(const PieceExchange& x, std::size_t begin, std::vector<float>& window,
                     const std::function<void(const CollectiveOp&)>& run, const std::string& tag);
// The same in two halves, so that one window's shifts are in flight while the caller prepares the
// next and finishes the one before (Note [Windows in flight], twin_restore.cpp): start_window
// packs and starts every distance's shift (`start` submits one); finish_window waits for them and
// writes what arrived into `window`, which must be the one start_window read. The packs and the
// arrivals live in the WindowInFlight: it must outlive its shifts (settle_window waits for any
// still in flight, ignoring their errors, before it can go on an error path).
struct WindowInFlight {
  struct Shift {
    Spans takes;
    std::vector<float> out, in;
    Communicator::Started started;
  };
  std::size_t begin = 0;
  std::vector<Shift> shifts;
};
WindowInFlight start_window(const PieceExchange& x, std::size_t begin, const std::vector<float>& window,
                            const std::function<Communicator::Started(const CollectiveOp&)>& start, const std::string& tag);
void finish_window(WindowInFlight& f, std::vector<float>& window, const std::function<void(Communicator::Started&)>& wait);
void settle_window(WindowInFlight& f, const std::function<void(Communicator::Started&)>& wait) noexcept;
// What exchange_window sends from this rank for the whole coordinate range, in elements (its packs,
// or the padded shifts; windows of `window` elements; a window that is not routable() as its
// all-reduce puts on a ring's link, 2 (W - 1) / W of it): for logs and tests.
std::size_t exchange_elements(const PieceExchange& x, std::size_t total, std::size_t window);

}  // namespace shardflow
