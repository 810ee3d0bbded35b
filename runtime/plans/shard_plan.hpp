// Which rank owns (keeps optimizer state for, and updates) which elements of each bucket.
//
// Note [Owned pieces]
// Ownership is described per bucket as "pieces": the intersection of a rank's owned element
// ranges with the parameters in the bucket. A piece knows where it sits in its parameter, in the
// bucket, and in the rank's packed shard (optimizer state and, for broadcast syncs, the staging
// region). The three partitions differ only in how the ranges are chosen; stepping, clipping,
// syncing and state migration all work on pieces.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "runtime/plans/bucket_plan.hpp"
#include "shardflow/config.hpp"

namespace shardflow {

struct ShardPiece {
  std::uint32_t param = 0;
  std::size_t param_off = 0;   // elements into the parameter
  std::size_t bucket_off = 0;  // elements into the bucket
  std::size_t len = 0;
  std::size_t packed_off = 0;  // elements into the owner's packed shard of this bucket
};

struct BucketShard {
  // flat: every rank owns [r * slice, (r + 1) * slice) of a bucket padded to world * slice.
  bool flat = false;
  std::size_t slice = 0;
  std::size_t padded = 0;                         // bucket buffer length (numel, or world * slice)
  std::vector<std::vector<ShardPiece>> pieces;    // [rank]
  std::vector<std::size_t> packed;                // [rank] owned elements (flat: slice, padding included)
  std::vector<std::size_t> packed_start;          // [rank] prefix sums of `packed` (broadcast staging)
};

struct ShardPlan {
  int world = 1, rank = 0;
  bool sharded = false;  // stage >= 1: ownership is split; stage 0: everyone owns everything
  std::vector<BucketShard> buckets;
  std::size_t owned_elements(int rank) const;  // optimizer-state elements rank keeps
};

// Each of `rank`'s pieces of bucket b that overlaps the window [begin, begin + n) of parameter
// coordinates (`param_base`: where each parameter starts there), as (element in the rank's packed
// bucket buffer, element in the window, length), and the piece itself where `fn` takes it.
template <class Fn>
void for_window(const ShardPlan& sp, const std::vector<std::size_t>& param_base, int rank, std::size_t b, std::size_t begin,
                std::size_t n, Fn fn) {
  for (const auto& piece : sp.buckets[b].pieces[std::size_t(rank)]) {
    const std::size_t at = param_base[piece.param] + piece.param_off;
    const std::size_t lo = std::max(at, begin), hi = std::min(at + piece.len, begin + n);
    if (lo >= hi) continue;
    if constexpr (std::is_invocable_v<Fn, std::size_t, std::size_t, std::size_t, const ShardPiece&>)
      fn(piece.packed_off + (lo - at), lo - begin, hi - lo, piece);
    else
      fn(piece.packed_off + (lo - at), lo - begin, hi - lo);
  }
}

ShardPlan make_shard_plan(const BucketPlan& plan, const std::vector<ParamSpec>& params, Partition partition,
                          int world, int rank, bool sharded);

}  // namespace shardflow
