// The order of one iteration's collectives, alone (Note [Collective schedule]): a pure function of
// the plan's shape and the settings, the same on every rank whatever the timing.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>

#include "runtime/plans/collective_schedule.hpp"
#include "runtime/plans/prefetch_model.hpp"
#include "runtime/plans/sync_fusion.hpp"

using namespace shardflow;

namespace {

// "R0 S0 R1 ..." for reading the scenarios at a glance.
std::string spelled(const std::vector<ScheduledCollective>& order) {
  std::string s;
  for (const auto& c : order) {
    if (!s.empty()) s += ' ';
    s += c.kind == ScheduledCollective::reduce ? "R" + std::to_string(c.bucket)
         : c.kind == ScheduledCollective::norm    ? std::string("N")
         : c.kind == ScheduledCollective::buffers ? std::string("B")
         : c.kind == ScheduledCollective::unused  ? std::string("U")
         : c.kind == ScheduledCollective::gather  ? "G" + std::to_string(c.bucket)
                                                  : "S" + std::to_string(c.bucket);
  }
  return s;
}

ScheduleSpec spec(std::size_t buckets, bool syncs, bool norm = false, bool interleave = false, std::size_t lag = 0) {
  ScheduleSpec s;
  s.buckets = buckets;
  s.syncs = syncs;
  s.norm = norm;
  s.interleave = interleave;
  s.lag = lag;
  return s;
}

}  // namespace

TEST_CASE("DDP (no optimizer in the runtime): the reductions in bucket order, nothing else") {
  CHECK(spelled(collective_order(spec(4, false))) == "R0 R1 R2 R3");
  CHECK(spelled(collective_order(spec(4, false, false, true))) == "R0 R1 R2 R3");  // interleave has nothing to interleave
  CHECK(collective_order(spec(0, true)).empty());
}

TEST_CASE("ZeRO, none / after_backward: every reduction, then every sync") {
  CHECK(spelled(collective_order(spec(3, true))) == "R0 R1 R2 S0 S1 S2");
}

TEST_CASE("ZeRO, interleaved: S(b) right after R(b) at lag 0, after R(b+1) at lag 1") {
  CHECK(spelled(collective_order(spec(4, true, false, true, 0))) == "R0 S0 R1 S1 R2 S2 R3 S3");
  CHECK(spelled(collective_order(spec(4, true, false, true, 1))) == "R0 R1 S0 R2 S1 R3 S2 S3");
  CHECK(spelled(collective_order(spec(2, true, false, true, 5))) == "R0 R1 S0 S1");  // a lag past the end
}

TEST_CASE("clipping: the norm exchange after every reduction, the syncs after it, interleaved or not") {
  CHECK(spelled(collective_order(spec(3, true, true, false))) == "R0 R1 R2 N S0 S1 S2");
  CHECK(spelled(collective_order(spec(3, true, true, true))) == "R0 R1 R2 N S0 S1 S2");
}

TEST_CASE("forward prefetch: K syncs interleave in backward's order, the rest follow in the order forward needs them") {
  auto s = spec(4, true, false, true, 1);
  // Early syncs (backward's order) first, then the late ones in forward order (last layer first
  // would be backward's; forward wants bucket 3 = the first layer first).
  s.sync_order = {0, 1, 3, 2};
  s.interleaved_syncs = 2;
  CHECK(spelled(collective_order(s)) == "R0 R1 S0 R2 S1 R3 S3 S2");
  s.interleaved_syncs = 0;
  s.sync_order = {3, 2, 1, 0};
  CHECK(spelled(collective_order(s)) == "R0 R1 R2 R3 S3 S2 S1 S0");
}

TEST_CASE("forward prefetch: an early sync goes after its own bucket's reduction (+ lag), whichever K buckets forward needs last") {
  // The case that stopped every rank (1 run in 100 of test_trainer_collective): forward needs
  // buckets 2, 3, 4 last, so they are the early syncs, and S2 went out after R1, before R2.
  auto s = spec(6, true, false, true, 1);
  s.sync_order = prefetch_sync_order({0, 5, 1, 2, 3, 4}, 3);
  REQUIRE(s.sync_order == std::vector<std::uint32_t>{2, 3, 4, 0, 5, 1});
  s.interleaved_syncs = 3;
  CHECK(spelled(collective_order(s)) == "R0 R1 R2 R3 S2 R4 S3 R5 S4 S0 S5 S1");
  // Every forward order of 5 buckets, every K and lag: no sync before its bucket's reduction
  // (its step needs it), the syncs in the order given, each early one as soon as its lag allows.
  std::vector<std::uint32_t> forward{0, 1, 2, 3, 4};
  do {
    for (std::size_t early = 0; early <= forward.size(); ++early)
      for (std::size_t lag : {0, 1, 2})
        for (std::size_t fuse : {0, 1600, 2400}) {  // Note [Syncs in batches]: alone, in twos, in threes
        auto p = spec(forward.size(), true, false, true, lag);
        p.sync_order = prefetch_sync_order(forward, early);
        p.interleaved_syncs = early;
        p.sync_bytes = {800, 800, 800, 0, 800};  // bucket 3 cannot fuse
        p.fuse_bytes = fuse;
        const auto order = collective_order(p);
        CAPTURE(spelled(order));
        std::vector<std::size_t> reduced_at(forward.size(), order.size());
        std::vector<std::uint32_t> syncs;
        for (std::size_t i = 0; i < order.size(); ++i) {
          const auto b = order[i].bucket;
          if (order[i].kind == ScheduledCollective::reduce) reduced_at[b] = i;
          if (order[i].kind != ScheduledCollective::sync) continue;
          CHECK(reduced_at[b] < i);
          const std::size_t after = std::min<std::size_t>(b + lag, forward.size() - 1);
          CHECK(reduced_at[after] < i);  // not before R(b + lag)
          syncs.push_back(b);
        }
        CHECK(syncs == p.sync_order);
      }
  } while (std::next_permutation(forward.begin(), forward.end()));
}

TEST_CASE("twins a host away over two levels: each sync is the shift to the twin and its gather inside the hosts follows the next "
          "sync, wherever the syncs go, so the first layers' shift is not behind every other bucket's") {
  auto s = spec(4, true, false, true, 1);
  s.twin_gathers = true;
  CHECK(spelled(collective_order(s)) == "R0 R1 S0 R2 S1 G0 R3 S2 G1 S3 G2 G3");
  s.sync_order = {0, 1, 3, 2};  // forward prefetch: two early, then forward's order
  s.interleaved_syncs = 2;
  CHECK(spelled(collective_order(s)) == "R0 R1 S0 R2 S1 G0 R3 S3 G1 S2 G3 G2");
  s.interleaved_syncs = 0;
  s.sync_order = {3, 2, 1, 0};
  CHECK(spelled(collective_order(s)) == "R0 R1 R2 R3 S3 S2 G3 S1 G2 S0 G1 G0");
  auto one = spec(1, true, false, true, 0);
  one.twin_gathers = true;
  CHECK(spelled(collective_order(one)) == "R0 S0 G0");
  auto clipped = spec(3, true, true, true, 0);
  clipped.twin_gathers = true;
  CHECK(spelled(collective_order(clipped)) == "R0 R1 R2 N S0 S1 G0 S2 G1 G2");
  clipped.twin_gathers = false;
  CHECK(spelled(collective_order(clipped)) == "R0 R1 R2 N S0 S1 S2");  // no gathers without twins
}

TEST_CASE("every bucket is reduced once and synced once, whatever the settings") {
  for (std::size_t B : {1, 2, 5})
    for (bool norm : {false, true})
      for (bool interleave : {false, true})
        for (std::size_t lag : {0, 1, 3}) {
          const auto order = collective_order(spec(B, true, norm, interleave, lag));
          std::vector<int> reduced(B), synced(B);
          std::size_t last_reduce = 0, first_sync = order.size();
          for (std::size_t i = 0; i < order.size(); ++i) {
            if (order[i].kind == ScheduledCollective::reduce) ++reduced[order[i].bucket], last_reduce = i;
            if (order[i].kind == ScheduledCollective::sync) ++synced[order[i].bucket], first_sync = std::min(first_sync, i);
          }
          CAPTURE(spelled(order));
          for (std::size_t b = 0; b < B; ++b) {
            CHECK(reduced[b] == 1);
            CHECK(synced[b] == 1);
          }
          if (norm || !interleave) CHECK(first_sync > last_reduce);  // no sync before the last reduction
        }
}

TEST_CASE("the buffers' broadcast goes right after the last reduction, before the norm exchange and the syncs that follow it") {
  auto with_buffers = [](ScheduleSpec s) {
    s.buffers = true;
    return spelled(collective_order(s));
  };
  CHECK(with_buffers(spec(3, false)) == "R0 R1 R2 B");
  CHECK(with_buffers(spec(3, true)) == "R0 R1 R2 B S0 S1 S2");
  CHECK(with_buffers(spec(3, true, true)) == "R0 R1 R2 B N S0 S1 S2");
  CHECK(with_buffers(spec(4, true, false, true, 1)) == "R0 R1 S0 R2 S1 R3 B S2 S3");
  CHECK(with_buffers(spec(1, true, false, true, 0)) == "R0 B S0");
}

TEST_CASE("find_unused_parameters: the used counts go right after the last reduction and every sync after them, even when interleaved") {
  auto with_unused = [](ScheduleSpec s, bool buffers = false) {
    s.unused = true;
    s.buffers = buffers;
    return spelled(collective_order(s));
  };
  CHECK(with_unused(spec(3, false)) == "R0 R1 R2 U");
  CHECK(with_unused(spec(3, true, false, true, 1)) == "R0 R1 R2 U S0 S1 S2");
  CHECK(with_unused(spec(2, true, true, true, 0), true) == "R0 R1 U B N S0 S1");
}

namespace {

// World 2, flat buckets of `slice` elements a rank each (0: an empty bucket), owned by both ranks.
ShardPlan flat_shards(const std::vector<std::size_t>& slices) {
  ShardPlan p;
  p.world = 2;
  p.sharded = true;
  for (const auto n : slices) {
    BucketShard b;
    b.flat = true;
    b.slice = n;
    b.padded = 2 * n;
    p.buckets.push_back(b);
  }
  return p;
}

std::string groups_of(const SyncFusion& f) {
  std::string s;
  for (const auto& g : f.groups) {
    s += s.empty() ? "{" : " {";
    for (std::size_t m = 0; m < g.members.size(); ++m) s += (m ? "," : "") + std::to_string(g.members[m]);
    s += "}";
  }
  return s;
}

}  // namespace

TEST_CASE("fused syncs: only syncs with nothing between them fuse, in schedule order, up to the cap, the same for every rank") {
  const std::vector<DType> f32(6, DType::f32);
  const auto shards = flat_shards({100, 100, 100, 100, 100, 100});  // 800 bytes a bucket's all-gather
  // Every sync after every reduction: one run of six; the cap makes groups of two.
  auto f = fuse_syncs(collective_order(spec(6, true)), shards, f32, 2000);
  CHECK(groups_of(f) == "{0,1} {2,3} {4,5}");
  CHECK(f.groups[0].slice == 200);
  CHECK(f.groups[0].offset == std::vector<std::size_t>{0, 100});
  CHECK(f.groups[0].bytes(2) == 1600);
  CHECK(f.position[3] == 1);
  CHECK(f.fused_buckets() == 6);
  CHECK(groups_of(fuse_syncs(collective_order(spec(6, true)), shards, f32, 1 << 20)) == "{0,1,2,3,4,5}");
  // Interleaved at lag 1: R0 R1 S0 R2 S1 R3 S2 R4 S3 R5 S4 S5: a reduction between two syncs ends
  // a group, so only the tail's S4 S5 fuse.
  f = fuse_syncs(collective_order(spec(6, true, false, true, 1)), shards, f32, 1 << 20);
  CHECK(groups_of(f) == "{4,5}");
  CHECK(!f.fused(0));
  // Forward prefetch's order: the tail goes in forward order, and so do its groups.
  auto s = spec(6, true, false, true, 1);
  s.sync_order = {5, 4, 3, 2, 1, 0};
  s.interleaved_syncs = 2;
  f = fuse_syncs(collective_order(s), shards, f32, 1 << 20);
  CHECK(spelled(collective_order(s)) == "R0 R1 R2 R3 R4 R5 S5 S4 S3 S2 S1 S0");
  CHECK(groups_of(f) == "{5,4,3,2,1,0}");
  CHECK(f.groups[0].offset == std::vector<std::size_t>{0, 100, 200, 300, 400, 500});
}

TEST_CASE("fused syncs: a bucket over the cap, an empty one, another wire dtype or a non-flat partition syncs alone and ends the group") {
  const auto order = collective_order(spec(6, true));
  auto shards = flat_shards({100, 100, 1000, 100, 0, 100});
  std::vector<DType> wire(6, DType::f32);
  CHECK(groups_of(fuse_syncs(order, shards, wire, 4000)) == "{0,1}");  // 2's 8000 bytes and 4's none split the rest
  shards = flat_shards({100, 100, 100, 100, 100, 100});
  wire[2] = DType::bf16;
  CHECK(groups_of(fuse_syncs(order, shards, wire, 1 << 20)) == "{0,1} {3,4,5}");  // a group of one is no group
  wire[2] = DType::f32;
  shards.buckets[3].flat = false;
  CHECK(groups_of(fuse_syncs(order, shards, wire, 1 << 20)) == "{0,1,2} {4,5}");
  CHECK(fuse_syncs(order, shards, wire, 0).groups.empty());  // Config::zero.fuse_syncs_bytes 0: nothing fuses
  // The groups' buffers hold at most kFusedGroups caps: 12 buckets would make 6 groups of two at
  // 1600 bytes a cap; the fifth and sixth sync alone.
  const auto many = collective_order(spec(12, true));
  const auto f = fuse_syncs(many, flat_shards(std::vector<std::size_t>(12, 100)), std::vector<DType>(12, DType::f32), 1600);
  CHECK(groups_of(f) == "{0,1} {2,3} {4,5} {6,7}");
  CHECK(!f.fused(8));
  CHECK(f.groups[3].at == 3 * 1600);
  shards.sharded = false;
  CHECK(fuse_syncs(order, shards, wire, 1 << 20).groups.empty());  // stage 0: no syncs to fuse
}

TEST_CASE("the fusion buffer: every bucket that could share a group, at most 4 caps, none when no group can form") {
  const std::vector<DType> f32(6, DType::f32);
  CHECK(fusion_buffer_bytes(flat_shards({100, 100, 100, 100, 100, 100}), f32, 1600) == 4800);
  CHECK(fusion_buffer_bytes(flat_shards({100, 100, 100, 100, 100, 100}), f32, 1000) == 0);  // 800 bytes > half the cap: alone
  CHECK(fusion_buffer_bytes(flat_shards({100, 5000, 5000, 5000, 5000, 5000}), f32, 1600) == 0);  // one could, alone
  CHECK(fusion_buffer_bytes(flat_shards(std::vector<std::size_t>(20, 100)), std::vector<DType>(20, DType::f32), 1600) == 4 * 1600);
  // Every group fuse_syncs forms, in any schedule, lies inside it.
  const auto shards = flat_shards(std::vector<std::size_t>(20, 100));
  const std::vector<DType> wire(20, DType::f32);
  for (std::size_t lag : {0, 1, 5}) {
    auto s = spec(20, true, false, true, lag);
    s.sync_bytes.assign(20, 800);
    s.fuse_bytes = 1600;
    const auto f = fuse_syncs(collective_order(s), shards, wire, 1600);
    CHECK(!f.groups.empty());
    for (const auto& g : f.groups) CHECK(g.at + g.bytes(2) <= fusion_buffer_bytes(shards, wire, 1600));
  }
}

TEST_CASE("syncs in batches: interleaved small buckets' syncs go together after the reduction their last one waits for, so they fuse") {
  auto batched = [](std::size_t lag, std::size_t fuse, std::vector<std::size_t> bytes) {
    auto s = spec(6, true, false, true, lag);
    s.sync_bytes = std::move(bytes);
    s.fuse_bytes = fuse;
    return s;
  };
  const std::vector<std::size_t> small(6, 800);
  CHECK(spelled(collective_order(batched(0, 1600, small))) == "R0 R1 S0 S1 R2 R3 S2 S3 R4 R5 S4 S5");
  CHECK(spelled(collective_order(batched(1, 1600, small))) == "R0 R1 R2 S0 S1 R3 R4 S2 S3 R5 S4 S5");
  CHECK(spelled(collective_order(batched(0, 0, small))) == "R0 S0 R1 S1 R2 S2 R3 S3 R4 S4 R5 S5");  // fusing off: alone
  // A bucket too large to fuse (or 0: not flat) goes alone and ends the batch before it.
  CHECK(spelled(collective_order(batched(0, 1600, {800, 800, 5000, 800, 0, 800}))) == "R0 R1 S0 S1 R2 S2 R3 S3 R4 S4 R5 S5");
  // The batches are those fuse_syncs groups: each batch one group, here every sync fused.
  const auto order = collective_order(batched(1, 1600, small));
  CHECK(groups_of(fuse_syncs(order, flat_shards({100, 100, 100, 100, 100, 100}), std::vector<DType>(6, DType::f32), 1600)) ==
        "{0,1} {2,3} {4,5}");
  // Forward prefetch's early syncs batch the same way, each batch after its members' reductions.
  auto s = batched(1, 1600, small);
  s.sync_order = {1, 0, 3, 2, 5, 4};
  s.interleaved_syncs = 4;
  CHECK(spelled(collective_order(s)) == "R0 R1 R2 S1 S0 R3 R4 S3 S2 R5 S5 S4");
}
