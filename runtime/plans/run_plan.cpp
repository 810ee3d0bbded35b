#include "runtime/plans/run_plan.hpp"
#include "runtime/plans/sync_fusion.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>

#include "shardflow/errors.hpp"

namespace shardflow {
namespace {

std::size_t param_bytes(const ParamSpec& p) { return std::size_t(numel(p.shape)) * dtype_size(p.dtype); }

std::string mib(std::size_t bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f MiB", double(bytes) / 1048576.0);
  return b;
}

bool sharded(const PlanSettings& s) { return s.optimizer && s.stage >= ZeroStage::optimizer_state && s.world > 1; }

}  // namespace

PlanSettings PlanSettings::from(const Config& cfg, int world, std::size_t state_slots, bool optimizer) {
  PlanSettings s;
  s.world = world;
  s.stage = cfg.zero.stage;
  s.partition = cfg.zero.partition;
  s.first_cap_bytes = cfg.buckets.first_cap_bytes;
  s.last_cap_bytes = cfg.buckets.last_cap_bytes;
  s.cap_bytes = cfg.buckets.cap_bytes;
  s.min_buckets = cfg.buckets.min_buckets;
  s.max_buckets_in_flight = cfg.zero.max_buckets_in_flight;
  s.state_slots = state_slots;
  s.comm_dtype = cfg.precision.comm_dtype;
  s.optimizer = optimizer;
  s.reduce_scatter = cfg.zero.reduce_scatter;
  s.fuse_syncs_bytes = cfg.zero.fuse_syncs_bytes;
  s.redundancy = cfg.zero.redundancy;
  s.twin_distance = cfg.zero.twin_distance;
  return s;
}

bool plan_syncs_from_twin(const PlanSettings& s) {
  const int d = plan_twin_distance(s);
  if (d == 0 || s.hosts != 2) return false;
  // World 2 (Note [Syncs from the twin]), or two levels with the twin a host away (Note [Syncs
  // from the twin, two levels]), as Shard decides it.
  const int L = s.world / 2;
  return s.world == 2 || (s.two_levels && L >= 2 && d % s.world == L);
}

int plan_twin_distance(const PlanSettings& s) {
  if (s.redundancy != 1 && s.redundancy != 2) throw UsageError("--redundancy must be 1 or 2, got " + std::to_string(s.redundancy));
  if (s.redundancy == 1 || s.world == 1) return 0;  // world 1: no other rank to keep it (the runtime keeps none)
  if (!sharded(s) || s.partition != Partition::flat || !(s.stage == ZeroStage::gradients || s.reduce_scatter))
    throw UsageError("--redundancy 2 needs the runtime's optimizer at ZeRO stage 1 or 2 with the flat partition's reduce-scatter: a twin "
                     "takes its source's reduce-scatter slice");
  const int per_host = s.world / std::max(1, s.hosts);
  const int d = s.twin_distance ? s.twin_distance : (s.hosts > 1 && per_host < s.world ? per_host : 1);
  if (d < 0 || d % s.world == 0)
    throw UsageError("--twin-distance " + std::to_string(d) + " at world " + std::to_string(s.world) +
                     " brings each rank's slices back to itself: its twin would be lost with it");
  return d;
}

namespace {

// The trainable parameters' bytes, and the largest of them (frozen ones have no gradient to reduce).
struct TrainableBytes {
  std::size_t total = 0, largest = 0;
  const ParamSpec* big = nullptr;
};
TrainableBytes trainable_bytes(const std::vector<ParamSpec>& params) {
  TrainableBytes t;
  for (const auto& p : params) {
    if (!p.requires_grad) continue;
    t.total += param_bytes(p);
    if (param_bytes(p) > t.largest) t.largest = param_bytes(p), t.big = &p;
  }
  return t;
}

// Note [Buckets for small models]
// The overlap is a pipeline over buckets: reductions start once a bucket's gradients are in,
// steps once its reduction is, syncs once its step is, and with forward prefetch the next forward
// waits only for the bucket it needs. With one or two buckets every stage waits for nearly all of
// the one before. PyTorch's 25 MiB gives any model under 25 MiB one bucket after the first; below
// min_buckets x cap the cap follows the model instead. Smaller buckets cost a collective's latency
// each, which the first bucket's cap bounds from below. A cap the user set is theirs (as PyTorch's
// bucket_cap_mb): it shrinks only if they also set min_buckets.
//
// ZeRO's chain per bucket is longer than DDP's: a reduction, a step, then a sync, which with
// interleaved overlap waits for later reductions too, and with forward prefetch the next forward
// waits for a whole bucket's sync before its first layer in that bucket. What stands between
// backward's end and the next forward is then a few buckets' collectives, not one; it shrinks with
// the bucket, so sharded stages get 16 buckets at least where DDP gets 4. The GPT of examples/gpt
// (40.9 MiB, world 2 on a simulated 1 Gbit/s link, ZeRO-1 interleaved): 4 gave 6 buckets and
// 110-126 ms of the link exposed an iteration, 16 gave 14 and about half that (bench/RESULTS.md,
// "Buckets for ZeRO"); stage 2's in-flight budget gave it 13 already. A collective's latency a
// bucket more is what it costs (two of them, tens of microseconds each on a network).
std::size_t default_min_buckets(const PlanSettings& s) { return sharded(s) ? kDefaultMinBucketsSharded : kDefaultMinBuckets; }

void apply_min_buckets(BucketCaps& c, std::size_t total, const PlanSettings& s) {
  const bool cap_set = s.cap_bytes != 0;
  const std::size_t min_buckets = s.min_buckets.value_or(cap_set ? 0 : default_min_buckets(s));
  if (min_buckets == 0 || std::max(c.first, total / min_buckets) >= c.cap) return;
  c.cap = std::max(c.first, total / min_buckets);
  c.cap_rule = "min_buckets " + std::to_string(min_buckets) + ": " + mib(total) + " trainable / " + std::to_string(min_buckets) +
               (c.cap == c.first ? ", at least the first cap" : "") + (cap_set ? ", below the cap set, " : ", below the default ") +
               mib(cap_set ? s.cap_bytes : kDefaultBucketCapBytes);
}

// A gradient buffer's bytes: the flat partition pads to W slices of whole cache lines.
std::size_t buffer_bytes(const Bucket& b, const PlanSettings& s) {
  if (s.partition != Partition::flat) return b.bytes();
  const auto W = std::size_t(s.world);
  return ((b.numel + W - 1) / W + 15) / 16 * 16 * W * dtype_size(b.dtype);
}

// The last bucket is small (Note [A small last bucket]); never larger than the others.
void bound_last_cap(BucketCaps& c) {
  if (c.cap >= c.last) return;
  c.last = c.cap;
  c.last_rule = "the cap below it";
}

// Whether every bucket of the plan at `cap` fits `per_slot`.
bool caps_fit(const std::vector<ParamSpec>& params, const std::vector<std::uint32_t>& order, const PlanSettings& s, std::size_t first,
              std::size_t cap, std::size_t per_slot) {
  for (const auto& b : make_bucket_plan(params, order, std::min(first, cap), cap, std::min(s.last_cap_bytes, cap)).buckets)
    if (buffer_bytes(b, s) > per_slot) return false;
  return true;
}

// The largest cap up to `hi` whose buckets all fit `per_slot` (caps_fit at 1 holds: every
// parameter alone fits its slot). A bucket closes once it reaches its cap, so it may pass the cap
// by up to one parameter: try the plan rather than assume the worst case.
std::size_t largest_fitting_cap(const std::vector<ParamSpec>& params, const std::vector<std::uint32_t>& order, const PlanSettings& s,
                                std::size_t first, std::size_t hi, std::size_t per_slot) {
  if (caps_fit(params, order, s, first, hi, per_slot)) return hi;
  std::size_t lo = 1;
  while (lo < hi) {
    const std::size_t mid = lo + (hi - lo + 1) / 2;
    if (caps_fit(params, order, s, first, mid, per_slot))
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Left to the budget (max_buckets_in_flight = 0), the gradient buffers in flight are as many as
// the budget holds beside the overrun and staging buffers: two is the least that overlaps at all,
// and every further bucket in flight lets backward run ahead of a slow link instead of waiting
// (measured: stage 2 at link/compute 1 in bench_overlap, 0.73 with two, 0.80 with four;
// RESULTS.md). The memory stays within the budget either way.
//
// Note [Staging in flight]
// A stepped bucket holds a staging buffer until its sync lands, so the staging buffers are how
// many syncs may be on their way at once. Two keep a link busy when a sync takes longer than the
// hops between a step and the next sync's issue (tens of microseconds); small buckets' syncs do
// not, and with two the syncs went in pairs, each pair waiting for the last one's hops (stage 2
// at 4x DDP's per-bucket cost on bench_overhead's 100 buckets of 10 KiB, where stage 1, whose
// buckets are their own staging, was at 2x). So a quarter of what the budget holds beyond the
// least pool goes to staging and the rest to gradients: a budget of 8 buckets keeps two (bench_
// overlap's 16 x 0.25 MiB, unchanged), one of 50 gets 13 and 36 gradient buffers.
void widen_in_flight(BucketCaps& c, const std::vector<ParamSpec>& params, const std::vector<std::uint32_t>& order, const PlanSettings& s) {
  if (s.max_buckets_in_flight != 0) return;
  std::size_t largest_buffer = 0, buckets = 0;
  for (const auto& b : c.plan(params, order).buckets) {
    largest_buffer = std::max(largest_buffer, buffer_bytes(b, s));
    ++buckets;
  }
  const std::size_t fit = largest_buffer ? c.budget / largest_buffer : 0;
  if (fit <= pool_buffers(c.grads_in_flight)) return;
  const std::size_t spare = fit - pool_buffers(kStage2GradsInFlight);
  c.staging_in_flight = std::min(kStagingInFlight + spare / 4, std::max(buckets, kStagingInFlight));
  c.grads_in_flight = std::min(fit - pool_buffers(0, c.staging_in_flight), std::max(buckets, kStage2GradsInFlight));
}

// Stage 2 holds a bucket's gradients only while it is in flight. The pool (the buckets in flight,
// the overrun and the staging buffers) gets two buckets of the larger of the cap and the default
// cap, or what one bucket per slot of the largest parameter needs; never more than sharding the
// gradients saves, so stage 2 never holds more than stage 1. Sizing it by the savings alone let it
// grow to all of them: stage 2 then held stage 1's gradient memory on every model with more
// buckets than the pool's minimum (Note [Memory at the ZeRO formula]).
void fit_stage2_pool(BucketCaps& c, const std::vector<ParamSpec>& params, const std::vector<std::uint32_t>& order, const PlanSettings& s,
                     const TrainableBytes& t) {
  c.grads_in_flight = s.max_buckets_in_flight ? s.max_buckets_in_flight : kStage2GradsInFlight;
  const std::size_t slots = pool_buffers(c.grads_in_flight);
  const auto W = std::size_t(s.world);
  const std::size_t savings = t.total / W * (W - 1);
  const std::size_t allowance = std::max(2 * std::max(s.cap_bytes, kDefaultBucketCapBytes), slots * (t.largest + W * 64));
  c.budget = std::min(savings, allowance);
  const std::size_t per_slot = c.budget / slots;
  if (t.largest > per_slot || !caps_fit(params, order, s, c.first, 1, per_slot)) {
    // One parameter alone overfills a slot: pooling could hold more than stage 1's whole buckets.
    // Keep whole buckets (stage 1's memory) and reduce-scatter in place instead.
    // Bytes below a MiB: "0.00 MiB is larger than 0.01 MiB" said nothing on a small model.
    auto amount = [](std::size_t bytes) { return bytes < (std::size_t{1} << 20) ? std::to_string(bytes) + " bytes" : mib(bytes); };
    c.warning = "stage 2 keeps whole gradient buckets (as stage 1) for this model: parameter '" + t.big->name + "' (" + amount(t.largest) +
                ", with its bucket's padding) does not fit what the in-flight budget allows a bucket (" + amount(per_slot) + ": " +
                amount(c.budget) + " over " + std::to_string(slots) +
                " buffers in flight), so holding buckets only while in flight could cost more than it saves";
    return;
  }
  c.pooled = true;
  const std::size_t cap = largest_fitting_cap(params, order, s, c.first, std::min(c.cap, per_slot), per_slot);
  if (cap < c.cap) c.cap_rule = "stage 2's in-flight budget, " + mib(c.budget) + " (Note [Memory at the ZeRO formula])";
  c.cap = cap;
  if (c.cap < c.first) c.first_rule = "the cap below it";
  c.first = std::min(c.first, c.cap);
  bound_last_cap(c);
  widen_in_flight(c, params, order, s);
}

}  // namespace

void check_in_flight_honoured(const BucketCaps& caps, std::size_t limit, int stage, const std::string& setting) {
  if (limit == 0 || caps.pooled) return;
  const std::string head = setting + " = " + std::to_string(limit) + " limits ZeRO-2's gradient buffers in flight, but ";
  if (stage != int(ZeroStage::gradients))
    throw UsageError(head + "stage " + std::to_string(stage) + " keeps every bucket's buffer for the whole run: leave it at 0, or use stage 2");
  throw UsageError(head + (caps.warning.empty() ? std::string("at world 1 nothing is sharded, so stage 2 keeps every bucket's buffer")
                                                : caps.warning) +
                   ": leave it at 0 (stage 2 then keeps whole buckets, as stage 1 does)");
}

BucketCaps bucket_caps(const std::vector<ParamSpec>& params, const std::vector<std::uint32_t>& order, const PlanSettings& s) {
  BucketCaps c;
  const bool cap_set = s.cap_bytes != 0;
  c.first = s.first_cap_bytes;
  c.first_rule = s.first_cap_bytes == BucketConfig{}.first_cap_bytes ? "the default" : "as set";
  c.last = s.last_cap_bytes;
  c.last_rule = s.last_cap_bytes == 0 ? "none" : s.last_cap_bytes == BucketConfig{}.last_cap_bytes ? "the default" : "as set";
  c.cap = cap_set ? s.cap_bytes : kDefaultBucketCapBytes;
  c.cap_rule = cap_set ? "as set" : "the default";
  const auto t = trainable_bytes(params);
  apply_min_buckets(c, t.total, s);
  bound_last_cap(c);
  if (sharded(s) && s.stage == ZeroStage::gradients) fit_stage2_pool(c, params, order, s, t);
  return c;
}

BucketPlan BucketCaps::plan(const std::vector<ParamSpec>& params, const std::vector<std::uint32_t>& order) const {
  return make_bucket_plan(params, order, first, cap, last);
}

namespace {

// Note [Mirrored shards]: what rank shard.rank keeps for its twin, as Shard::state_bytes counts it:
// the owner's copy from before the step, the twin's values and state, and its two slices (at world
// 2 across two hosts its values and state one step on as well).
std::size_t twin_state_bytes(const BucketPlan& plan, const ShardPlan& shard, const PlanSettings& s, int distance) {
  // The twin's source, as shift_source has it (the plans library links no communicator).
  const auto r = std::size_t(shard.rank), src = std::size_t(((shard.rank - distance % s.world) % s.world + s.world) % s.world);
  const std::size_t words = 1 + std::min<std::size_t>(s.state_slots, 2);  // the values, then the state
  std::size_t n = 0;
  for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
    const auto& bs = shard.buckets[b];
    const DType wire = plan.buckets[b].dtype == DType::f32 ? s.comm_dtype : plan.buckets[b].dtype;
    n += (bs.packed[r] + bs.packed[src]) * 4 * words + 2 * bs.packed[src] * dtype_size(wire);
    if (plan_syncs_from_twin(s)) n += bs.packed[src] * 4 * words;  // Note [Syncs from the twin]: the step computed ahead, kept
  }
  return n;
}

}  // namespace

RankMemory plan_memory(const std::vector<ParamSpec>& params, const BucketPlan& plan, const ShardPlan& shard,
                       const PlanSettings& s, const BucketCaps& caps) {
  RankMemory m;
  for (const auto& p : params) m.params += param_bytes(p);
  const auto r = std::size_t(shard.rank);
  const bool stage2 = sharded(s) && s.stage == ZeroStage::gradients;
  std::size_t largest = 0;
  for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
    const auto& bk = plan.buckets[b];
    const auto& bs = shard.buckets[b];
    const std::size_t es = dtype_size(bk.dtype);
    const std::size_t buffer = (s.optimizer ? bs.padded : bk.numel) * es;
    largest = std::max(largest, buffer);
    if (!caps.pooled) m.grads += buffer;
    if (stage2 && caps.pooled) m.grads += bs.packed[r] * es;  // the rank's reduced gradient shard
    if (!s.optimizer) continue;
    const DType wire = bk.dtype == DType::f32 ? s.comm_dtype : bk.dtype;
    const bool masters = wire != DType::f32 || bk.dtype != DType::f32;
    m.optimizer_state += bs.packed[r] * 4 * (s.state_slots + (masters ? 1 : 0));
    if (bk.dtype == DType::f32 && s.comm_dtype != DType::f32) m.comm_buffers += (bs.padded + bs.slice) * dtype_size(s.comm_dtype);
  }
  // Pooled (stage 2): at most pool_buffers(...) buffers at once, none larger than the largest
  // bucket (BucketBuffers drops a free buffer too small to reuse).
  if (caps.pooled) m.grads += pool_buffers(caps.grads_in_flight, caps.staging_in_flight) * largest;
  if (s.optimizer) m.comm_buffers += std::size_t(s.world) * 4;  // the norm exchange
  if (const int d = plan_twin_distance(s)) m.optimizer_state += twin_state_bytes(plan, shard, s, d);
  if (s.optimizer) {  // Note [Fused syncs]: the plan's fusion buffer
    std::vector<DType> wire;
    for (const auto& bk : plan.buckets) wire.push_back(bk.dtype == DType::f32 ? s.comm_dtype : bk.dtype);
    m.comm_buffers += fusion_buffer_bytes(shard, wire, s.fuse_syncs_bytes);
  }
  return m;
}

RunPlan make_run_plan(std::vector<ParamSpec> params, const PlanSettings& s) {
  if (s.world < 1) throw UsageError("--world-size must be >= 1, got " + std::to_string(s.world));
  if (params.empty()) throw UsageError("the model has no parameters");
  RunPlan rp;
  rp.settings = s;
  const auto order = reverse_registration_order(params);
  rp.caps = bucket_caps(params, order, s);
  rp.buckets = rp.caps.plan(params, order);
  for (int r = 0; r < s.world; ++r) {
    rp.shards.push_back(make_shard_plan(rp.buckets, params, s.partition, s.world, r, sharded(s)));
    rp.memory.push_back(plan_memory(params, rp.buckets, rp.shards.back(), s, rp.caps));
  }
  // The formula: Psi elements; 16-bit parameters add fp32 masters of the owned 1/N.
  std::size_t p_bytes = 0, psi = 0, masters = 0;
  for (const auto& p : params) {
    p_bytes += param_bytes(p);
    psi += std::size_t(numel(p.shape));
    if (p.dtype != DType::f32 || (s.optimizer && s.comm_dtype != DType::f32)) masters += std::size_t(numel(p.shape)) * 4;
  }
  const std::size_t N = sharded(s) ? std::size_t(s.world) : 1;
  rp.formula.params = p_bytes;
  rp.formula.grads = s.optimizer && s.stage == ZeroStage::gradients ? p_bytes / N : p_bytes;
  rp.formula.optimizer_state = s.optimizer ? (psi * 4 * s.state_slots + masters) / N : 0;
  rp.twin_distance = plan_twin_distance(s);
  rp.network = make_network_plan(rp.buckets, rp.shards.front(), s.world, s.hosts, s.two_levels,
                                 s.optimizer ? s.comm_dtype : DType::f32, sharded(s), s.stage == ZeroStage::gradients, s.reduce_scatter,
                                 rp.twin_distance, plan_syncs_from_twin(s));
  if (rp.twin_distance) {
    rp.twin_state_bytes = twin_state_bytes(rp.buckets, rp.shards.front(), s, rp.twin_distance);
    for (std::size_t b = 0; b < rp.buckets.buckets.size(); ++b) {
      const auto& bk = rp.buckets.buckets[b];
      rp.twin_shift_bytes += rp.shards.front().buckets[b].slice * dtype_size(bk.dtype == DType::f32 ? s.comm_dtype : bk.dtype);
    }
    rp.syncs_from_twin = plan_syncs_from_twin(s);
  }
  rp.params = std::move(params);
  return rp;
}

namespace {

// A rank's pieces of the parameters, one entry per piece: the name when it owns the whole
// parameter, else the name and the element range.
nlohmann::ordered_json owned_json(const RunPlan& rp, int r) {
  auto out = nlohmann::ordered_json::array();
  for (const auto& bs : rp.shards[std::size_t(r)].buckets)
    for (const auto& piece : bs.pieces[std::size_t(r)]) {
      const auto& p = rp.params[piece.param];
      if (piece.param_off == 0 && piece.len == std::size_t(numel(p.shape)))
        out.push_back(p.name);
      else
        out.push_back({{"name", p.name}, {"range", {piece.param_off, piece.param_off + piece.len}}});
    }
  return out;
}

nlohmann::ordered_json memory_json(const RankMemory& m) {
  return {{"params", m.params}, {"grads", m.grads}, {"optimizer_state", m.optimizer_state},
          {"comm_buffers", m.comm_buffers}, {"total", m.total()}};
}

std::string memory_line(const RankMemory& m) {
  return "params " + mib(m.params) + ", grads " + mib(m.grads) + ", optimizer state " + mib(m.optimizer_state) +
         ", comm buffers " + mib(m.comm_buffers) + " = " + mib(m.total());
}

std::string network_title(const NetworkPlan& n) {
  return std::to_string(n.hosts) + " hosts x " + std::to_string(n.per_host) + " ranks, " +
         (n.two_levels ? "two levels (shared memory inside a host, Gloo between hosts)" : "the flat Gloo ring");
}

nlohmann::ordered_json network_json(const NetworkPlan& n) {
  auto buckets = nlohmann::ordered_json::array();
  for (std::size_t b = 0; b < n.buckets.size(); ++b) {
    auto cs = nlohmann::ordered_json::array();
    for (const auto& c : n.buckets[b])
      cs.push_back({{"kind", collective_name(c.kind)}, {"bytes", c.bytes}, {"network_bytes", c.network}, {"flat_ring_network_bytes", c.flat_ring}});
    buckets.push_back({{"bucket", b}, {"collectives", cs}});
  }
  return {{"hosts", n.hosts},
          {"ranks_per_host", n.per_host},
          {"two_levels", n.two_levels},
          {"bytes_per_step", n.per_step},
          {"flat_ring_bytes_per_step", n.flat_ring_per_step},
          {"scratch_per_collective_in_flight", n.scratch_largest},
          {"second_shm_segment_per_rank", n.second_segment},
          {"buckets", buckets}};
}

}  // namespace

// Note [Pooled buckets (ZeRO-2)], Note [Staging in flight], Note [Backpressure in refills]
std::string BucketCaps::pool_line() const {
  return "stage 2's pool: " + std::to_string(grads_in_flight) + " gradient bucket(s) and " + std::to_string(staging_in_flight) +
         " sync(s) in flight within " + mib(budget) + ", refilled " + std::to_string(backpressure_refill(grads_in_flight)) +
         " at a time (backward held for a buffer goes on once that many are free)";
}

std::string RunPlan::to_json() const {
  nlohmann::ordered_json j;
  j["world_size"] = settings.world;
  j["zero_stage"] = int(settings.stage);
  j["partition"] = partition_name(settings.partition);
  j["bucket_caps"] = {{"first", caps.first}, {"first_rule", caps.first_rule}, {"cap", caps.cap}, {"cap_rule", caps.cap_rule},
                      {"last", caps.last},   {"last_rule", caps.last_rule},   {"pooled", caps.pooled}};
  if (caps.pooled)
    j["pool"] = {{"budget", caps.budget},
                 {"grads_in_flight", caps.grads_in_flight},
                 {"staging_in_flight", caps.staging_in_flight},
                 {"refill", backpressure_refill(caps.grads_in_flight)}};
  if (!caps.warning.empty()) j["warning"] = caps.warning;
  auto buckets_j = nlohmann::ordered_json::array();
  for (const auto& b : buckets.buckets) {
    auto names = nlohmann::ordered_json::array();
    for (const auto& e : b.entries) names.push_back(params[e.param].name);
    buckets_j.push_back({{"params", names}, {"bytes", b.bytes()}, {"dtype", dtype_name(b.dtype)}});
  }
  j["buckets"] = buckets_j;
  auto ranks = nlohmann::ordered_json::array();
  for (int r = 0; r < settings.world; ++r)
    ranks.push_back({{"rank", r}, {"params", owned_json(*this, r)}, {"bytes", memory_json(memory[std::size_t(r)])}});
  j["ranks"] = ranks;
  j["formula"] = memory_json(formula);
  if (twin_distance)
    j["twins"] = {{"distance", twin_distance}, {"state_bytes_per_rank", twin_state_bytes}, {"shift_bytes_per_rank_per_step", twin_shift_bytes},
                  {"syncs_from_twin", syncs_from_twin}};
  if (network.hosts > 1) j["network"] = network_json(network);
  return j.dump(2) + "\n";
}

std::string RunPlan::describe() const {
  std::string s = "world " + std::to_string(settings.world) + ", ZeRO stage " + std::to_string(int(settings.stage)) + ", " +
                  partition_name(settings.partition) + " partition, " + std::to_string(params.size()) + " parameters in " +
                  std::to_string(buckets.buckets.size()) + " bucket(s) (caps: first " + mib(caps.first) + ", " + caps.first_rule +
                  "; then " + mib(caps.cap) + ", " + caps.cap_rule + "; last " + (caps.last ? mib(caps.last) + ", " : "") + caps.last_rule + ")\n";
  if (caps.pooled) s += caps.pool_line() + "\n";
  if (!caps.warning.empty()) s += "note: " + caps.warning + "\n";
  s += "\nbuckets, in reduce order:\n";
  for (const auto& b : buckets.buckets) {
    s += "  bucket " + std::to_string(b.index) + ": " + mib(b.bytes()) + " " + dtype_name(b.dtype) + ", " +
         std::to_string(b.entries.size()) + " param(s):";
    for (const auto& e : b.entries) s += " " + params[e.param].name;
    s += "\n";
  }
  s += "\nowners:\n";
  for (int r = 0; r < settings.world; ++r) {
    const auto owned = owned_json(*this, r);
    s += "  rank " + std::to_string(r) + ": " + std::to_string(owned.size()) + " piece(s):";
    for (const auto& o : owned)
      s += " " + (o.is_string() ? o.get<std::string>()
                                : o["name"].get<std::string>() + "[" + std::to_string(o["range"][0].get<std::size_t>()) + ":" +
                                      std::to_string(o["range"][1].get<std::size_t>()) + "]");
    s += "\n";
  }
  s += "\nmemory per rank:\n";
  for (int r = 0; r < settings.world; ++r) s += "  rank " + std::to_string(r) + ": " + memory_line(memory[std::size_t(r)]) + "\n";
  s += "  formula: " + memory_line(formula) + "\n";
  if (twin_distance) {
    s += "\ntwins (redundancy 2; Note [Mirrored shards]): each rank keeps a twin of the shard of the rank " + std::to_string(twin_distance) +
         " back: " + mib(twin_state_bytes) + " more per rank (rank 0; in its optimizer state above), and shifts " + mib(twin_shift_bytes) +
         " of reduced slices to it per step, ";
    s += !syncs_from_twin ? "beside the reduce-scatter and the all-gather\n"
         : settings.world == 2
             ? "in place of the parameters' all-gather (at world 2 across two hosts the twin gives them: Note [Syncs from the twin]), so no bytes more\n"
             : "in place of the all-gather's stage between the hosts (over two levels at two hosts the twin gives the other host's block, and the "
               "sync gathers inside each host: Note [Syncs from the twin, two levels]), so no bytes more between the hosts\n";
  }
  if (network.hosts > 1) {
    s += "\nleaving the hosts per step, " + network_title(network) + " (Note [Bytes on the network]):\n";
    for (std::size_t b = 0; b < network.buckets.size(); ++b) {
      s += "  bucket " + std::to_string(b) + ":";
      for (const auto& c : network.buckets[b])
        s += std::string(" ") + collective_name(c.kind) + " of " + mib(c.bytes) + " -> " + mib(c.network) +
             (network.two_levels ? " (flat ring " + mib(c.flat_ring) + ")" : "") + ";";
      s.back() = '\n';
    }
    char ratio[64];
    std::snprintf(ratio, sizeof ratio, "%.2f", network.flat_ring_per_step ? double(network.per_step) / double(network.flat_ring_per_step) : 0.0);
    s += "  in all: " + mib(network.per_step) + " per step" +
         (network.two_levels ? ", " + std::string(ratio) + "x the flat ring's " + mib(network.flat_ring_per_step) : std::string()) + "\n";
    if (network.two_levels)
      s += "  per rank, besides the memory above: up to " + mib(network.scratch_largest) +
           " between the levels for each collective in flight (1/" + std::to_string(network.per_host) +
           " of its bucket), and a second shared-memory segment of " + mib(network.second_segment) + " for the gathers\n";
  }
  return s;
}

}  // namespace shardflow
