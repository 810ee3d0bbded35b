#include "runtime/plans/shard_plan.hpp"

#include <algorithm>
#include <numeric>

namespace shardflow {
namespace {

// Greedy balancing: items by size descending (stable: earlier index first on ties), each to the
// least-loaded rank, ties to the lowest rank. Deterministic, so every rank computes the same owners.
std::vector<int> greedy_owners(const std::vector<std::size_t>& sizes, int world) {
  std::vector<std::size_t> idx(sizes.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](std::size_t a, std::size_t b) { return sizes[a] > sizes[b]; });
  std::vector<std::size_t> load(static_cast<std::size_t>(world), 0);
  std::vector<int> owner(sizes.size(), 0);
  for (auto i : idx) {
    const auto r = std::size_t(std::min_element(load.begin(), load.end()) - load.begin());
    owner[i] = int(r);
    load[r] += sizes[i];
  }
  return owner;
}

// Cuts the bucket's entries along [lo, hi) of bucket coordinates into pieces for `rank`.
void add_range(const Bucket& b, std::size_t lo, std::size_t hi, std::vector<ShardPiece>& out, std::size_t& packed) {
  for (const auto& e : b.entries) {
    const std::size_t s = std::max(lo, e.offset), t = std::min(hi, e.offset + e.numel);
    if (s >= t) continue;
    out.push_back(ShardPiece{e.param, s - e.offset, s, t - s, packed + (s - lo)});
  }
  packed += hi - lo;
}

}  // namespace

std::size_t ShardPlan::owned_elements(int r) const {
  std::size_t n = 0;
  for (const auto& b : buckets) n += b.packed[std::size_t(r)];
  return n;
}

ShardPlan make_shard_plan(const BucketPlan& plan, const std::vector<ParamSpec>& params, Partition partition,
                          int world, int rank, bool sharded) {
  ShardPlan sp;
  sp.world = world;
  sp.rank = rank;
  sp.sharded = sharded && world > 1;
  const auto W = std::size_t(world);

  std::vector<int> param_owner, bucket_owner;
  if (sp.sharded && partition == Partition::param) {
    std::vector<std::size_t> sizes;
    for (const auto& p : params) sizes.push_back(p.requires_grad ? std::size_t(numel(p.shape)) : 0);  // frozen: never stepped
    param_owner = greedy_owners(sizes, world);
  }
  if (sp.sharded && partition == Partition::bucket) {
    std::vector<std::size_t> sizes;
    for (const auto& b : plan.buckets) sizes.push_back(b.bytes());
    bucket_owner = greedy_owners(sizes, world);
  }

  for (std::size_t bi = 0; bi < plan.buckets.size(); ++bi) {
    const Bucket& b = plan.buckets[bi];
    BucketShard s;
    s.pieces.resize(W);
    s.packed.assign(W, 0);
    s.padded = b.numel;
    if (!sp.sharded) {
      // Stage 0 (or world 1): every rank owns the whole bucket.
      for (std::size_t r = 0; r < W; ++r) add_range(b, 0, b.numel, s.pieces[r], s.packed[r]);
    } else if (partition == Partition::flat) {
      // Slices rounded up to 16 elements (a cache line of fp32) so no two owners share a line.
      s.flat = true;
      s.slice = ((b.numel + W - 1) / W + 15) / 16 * 16;
      s.padded = s.slice * W;
      for (std::size_t r = 0; r < W; ++r) {
        const std::size_t lo = std::min(b.numel, r * s.slice), hi = std::min(b.numel, (r + 1) * s.slice);
        add_range(b, lo, hi, s.pieces[r], s.packed[r]);
        s.packed[r] = s.slice;  // padding is owned too: the state buffers have the slice's length
      }
    } else if (partition == Partition::bucket) {
      add_range(b, 0, b.numel, s.pieces[std::size_t(bucket_owner[bi])], s.packed[std::size_t(bucket_owner[bi])]);
    } else {
      for (const auto& e : b.entries) {
        const auto r = std::size_t(param_owner[e.param]);
        add_range(b, e.offset, e.offset + e.numel, s.pieces[r], s.packed[r]);
      }
    }
    s.packed_start.assign(W, 0);
    for (std::size_t r = 1; r < W; ++r) s.packed_start[r] = s.packed_start[r - 1] + s.packed[r - 1];
    sp.buckets.push_back(std::move(s));
  }
  return sp;
}

}  // namespace shardflow
