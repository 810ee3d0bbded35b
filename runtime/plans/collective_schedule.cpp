#include "runtime/plans/collective_schedule.hpp"

#include <algorithm>
#include <optional>

namespace shardflow {
namespace {

// The bucket of the k-th sync: bucket order unless the spec names one.
std::uint32_t sync_bucket(const ScheduleSpec& s, std::size_t k) {
  return s.sync_order.empty() ? std::uint32_t(k) : s.sync_order[k];
}

// What goes right after the last reduction (Note [Collective schedule]).
void after_last_reduction(const ScheduleSpec& s, std::vector<ScheduledCollective>& out) {
  if (s.unused) out.push_back({ScheduledCollective::unused, 0});
  if (s.buffers) out.push_back({ScheduledCollective::buffers, 0});
  if (s.norm) out.push_back({ScheduledCollective::norm, 0});
}

// Note [Syncs in batches]: the last sync (its index in the sync order, below `limit`) of the batch
// that starts at the k-th.
std::size_t batch_end(const ScheduleSpec& s, std::size_t k, std::size_t limit) {
  if (s.fuse_bytes == 0 || s.sync_bytes.empty()) return k;
  auto bytes = [&](std::size_t j) { return s.sync_bytes[sync_bucket(s, j)]; };
  if (bytes(k) == 0 || bytes(k) > s.fuse_bytes) return k;
  std::size_t total = bytes(k), e = k;
  while (e + 1 < limit && bytes(e + 1) != 0 && total + bytes(e + 1) <= s.fuse_bytes) total += bytes(++e);
  return e;
}

// S(b), and where the syncs are shifts to the twins, the gather of the sync before it (`gather`,
// then b's): G(b) can go only once b's shift landed and the twin stepped, and the next shift
// keeps the link busy meanwhile (right after S(b) the link idled 1.5-2.5 ms a bucket on 2 cores).
// A gather holds its staging buffer one sync longer; stage 2 allows two in flight at least
// (kStagingInFlight), so the next bucket can still step and its shift go out.
void push_sync(const ScheduleSpec& s, std::uint32_t b, std::vector<ScheduledCollective>& out, std::optional<std::uint32_t>& gather) {
  out.push_back({ScheduledCollective::sync, b});
  if (!s.twin_gathers) return;
  if (gather) out.push_back({ScheduledCollective::gather, *gather});
  gather = b;
}

}  // namespace

std::vector<ScheduledCollective> collective_order(const ScheduleSpec& s) {
  std::vector<ScheduledCollective> out;
  const std::size_t B = s.buckets;
  // Every step waits for an exchange after the last reduction (the norm, the used counts): no sync
  // can go out before it.
  const bool hold = s.norm || s.unused;
  const bool interleave = s.syncs && s.interleave && !hold;
  const std::size_t interleaved = interleave ? std::min(s.interleaved_syncs, B) : 0;
  std::size_t synced = 0;
  std::optional<std::uint32_t> gather;  // the sync whose gather is still to place
  for (std::uint32_t b = 0; b < B; ++b) {
    out.push_back({ScheduledCollective::reduce, b});
    if (b + 1 == B) after_last_reduction(s, out);
    // Note [An early sync after its own reduction]
    // S(x) goes after R(x + lag) (or the last reduction), x being the bucket of the next sync
    // in the order, not the next bucket: with forward prefetch the early syncs are the buckets
    // forward needs last, any K of them, and placing the k-th sync after R(k + lag) put S(2)
    // before R(2) when they were {2, 3, 4}. S(2) waits for bucket 2's step, the step for R(2),
    // and R(2) for S(2) to go out: every rank's comm stream stopped for good (1 run in 100 of a
    // world-3 test, whichever K the timing chose; a schedule test now covers every early set).
    // A batch goes once every member's place is reached (Note [Syncs in batches]).
    while (synced < interleaved) {
      const std::size_t last = batch_end(s, synced, interleaved);
      std::size_t place = 0;
      for (std::size_t j = synced; j <= last; ++j) place = std::max<std::size_t>(place, std::min<std::size_t>(sync_bucket(s, j) + s.lag, B - 1));
      if (place > b) break;
      for (; synced <= last; ++synced) push_sync(s, sync_bucket(s, synced), out, gather);
    }
  }
  if (s.syncs)
    for (; synced < B; ++synced) push_sync(s, sync_bucket(s, synced), out, gather);
  if (gather) out.push_back({ScheduledCollective::gather, *gather});
  return out;
}

}  // namespace shardflow
