// One iteration's collectives on one rank: which, in what order, and the ops each one issues.
//
// Note [Collective schedule]
// Reductions go out in bucket order (R0, R1, ...). Parameter syncs (S) and the norm exchange (N)
// need a place in the sequence that does not depend on timing:
//   after_backward / none:   R0 .. R(B-1) [N] S0 .. S(B-1)
//   interleaved, no clip:    R0 S0 R1 S1 ... R(B-1) S(B-1)            (Config::zero.interleave_lag 0)
//                            R0 R1 S0 R2 S1 ... R(B-1) S(B-2) S(B-1)  (lag 1)
// In the interleaved schedule S(b) goes after R(b+lag) and waits for bucket b's step. Lag 0 sends
// each sync as soon as its bucket is stepped, so when backward takes longer per bucket than the
// link, every bucket but the last is reduced, stepped and synced while backward still runs (with
// lag 1 the last two are left for after backward: measured, 0-1 of 4 buckets done in backward).
// The price: R(b+1) queues behind S(b), so when the link is the bottleneck it idles while bucket b
// steps; lag 1 keeps the next reduction on the link during that step. With clipping every step
// needs the global norm, which needs every reduction, so the syncs go after N.
// Note [Syncs in batches]: small buckets' syncs can go out as one all-gather only when they follow
// each other in the schedule (Note [Fused syncs]), so in the interleaved part the syncs that could
// fuse go in batches: S(x)..S(y), as many as together fit the fuse cap, all after the reduction the
// batch's last member waits for (R(y + lag)), e.g. lag 0 with two a batch: R0 R1 S0 S1 R2 R3 S2 S3.
// A batch holds its first syncs back by a few small buckets' reductions, which is what fusing costs.
// With forward prefetch the syncs the next forward needs first go last: K of them (Note [Forward
// prefetch]) interleave with the reductions, each S(x) after R(x + lag) (Note [An early sync after
// its own reduction]), the rest follow the last reduction in forward order.
// Over two levels with the twins a host away, G(b), the gather inside the hosts of what the twin
// stepped from the slice S(b) shifted to it, follows the sync after S(b) (or S(b), the last).
// The buffers' broadcast (B, Note [Rank 0's state everywhere]) goes right after the last
// reduction, whatever follows it: R0 .. R(B-1) B [N] S... With find_unused_parameters the all-reduce
// of how many ranks used each parameter (U, Note [Unused parameters]) goes there too, before B;
// no bucket steps before it is in, so no sync goes before it either, as with the norm exchange:
// R0 .. R(B-1) U [B] [N] S0 .. S(B-1).
//
// collective_order() is the order alone, a pure function of the plan's shape and the settings (every
// rank computes the same one). What each entry puts on the link is the bucket's to say
// (runtime/zero/bucket_collectives.hpp): the bucket actor hands its BucketCollectives to the comm stream
// with its readiness, the shard actor the norm exchange with norm_ready, and the comm stream actor
// issues the entries strictly in this order.
#pragma once

#include <cstdint>
#include <vector>

namespace shardflow {

// One step of a rank's collective schedule. Every rank builds the same schedule from the same plan,
// so issuing strictly in schedule order keeps the ranks' collectives in the same order.
struct ScheduledCollective {
  // gather: the all-gather inside the hosts that follows a sync which was the shift to the twin
  // (Note [Syncs from the twin, two levels]).
  enum Kind : std::uint8_t { reduce, norm, sync, buffers, unused, gather };
  Kind kind = reduce;
  std::uint32_t bucket = 0;  // 0 for the norm exchange, the buffers' broadcast and the used counts
  bool operator==(const ScheduledCollective&) const = default;
};

struct ScheduleSpec {
  std::size_t buckets = 0;
  bool syncs = false;       // the runtime's optimizer syncs updated parameters (ZeRO 1 and 2)
  bool norm = false;        // gradient clipping: the norm exchange after every reduction
  bool buffers = false;     // the registered buffers' broadcast, right after the last reduction
  bool unused = false;      // find_unused_parameters: the used counts' all-reduce, right after the last reduction
  bool interleave = false;  // syncs go out between the reductions (Overlap::interleaved, no clipping)
  std::size_t lag = 0;      // interleaved: S(i) after R(i + lag)
  // The order syncs go out in: empty is bucket order; with forward prefetch, the order the next
  // forward needs them in, whose first `interleaved_syncs` interleave with the reductions.
  std::vector<std::uint32_t> sync_order;
  std::size_t interleaved_syncs = ~std::size_t{0};
  // Note [Syncs in batches]: with Config::zero.fuse_syncs_bytes (`fuse_bytes`), the bytes each
  // bucket's sync moves (0: it cannot fuse). Empty or 0: every sync placed alone.
  std::vector<std::size_t> sync_bytes;
  std::size_t fuse_bytes = 0;
  // Note [Syncs from the twin, two levels]: each sync S(b) is the shift to the twin, and its
  // gather inside the hosts G(b) follows the next sync: ... S(a) S(b) G(a) S(c) G(b) ...
  bool twin_gathers = false;
};

std::vector<ScheduledCollective> collective_order(const ScheduleSpec& spec);

}  // namespace shardflow
