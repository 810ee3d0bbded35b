#include "runtime/plans/collective_schedule.hpp"

namespace shardflow {
namespace {

// The kinds in order; the buckets are assigned by collective_order.
// `hold`: every step waits for an exchange after the last reduction (the norm, the used counts).
std::vector<ScheduledCollective::Kind> shape(std::size_t B, bool syncs, bool hold, bool interleave, std::size_t lag,
                                             std::size_t interleaved) {
  std::vector<ScheduledCollective::Kind> k;
  if (syncs && interleave && !hold) {
    std::size_t synced = 0;
    for (std::size_t b = 0; b < B; ++b) {
      k.push_back(ScheduledCollective::reduce);
      if (b >= lag && synced < interleaved) {
        k.push_back(ScheduledCollective::sync);  // S(b - lag)
        ++synced;
      }
    }
    for (; synced < B; ++synced) k.push_back(ScheduledCollective::sync);
    return k;
  }
  for (std::size_t b = 0; b < B; ++b) k.push_back(ScheduledCollective::reduce);
  if (syncs)
    for (std::size_t b = 0; b < B; ++b) k.push_back(ScheduledCollective::sync);
  return k;
}

}  // namespace

std::vector<ScheduledCollective> collective_order(const ScheduleSpec& s) {
  std::vector<ScheduledCollective> out;
  std::uint32_t reduced = 0, synced = 0;
  for (auto kind : shape(s.buckets, s.syncs, s.norm || s.unused, s.interleave, s.lag, s.interleaved_syncs)) {
    std::uint32_t bucket = 0;
    if (kind == ScheduledCollective::reduce) bucket = reduced++;
    if (kind == ScheduledCollective::sync) {
      bucket = s.sync_order.empty() ? synced : s.sync_order[synced];
      ++synced;
    }
    out.push_back({kind, bucket});
    if (kind == ScheduledCollective::reduce && reduced == s.buckets) {  // the last reduction
      if (s.unused) out.push_back({ScheduledCollective::unused, 0});
      if (s.buffers) out.push_back({ScheduledCollective::buffers, 0});
      if (s.norm) out.push_back({ScheduledCollective::norm, 0});
    }
  }
  return out;
}

}  // namespace shardflow
