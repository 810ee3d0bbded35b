#include "runtime/zero/mirror_shard.hpp"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>

#include "runtime/zero/shard.hpp"
#include "shardflow/errors.hpp"
#include "shardflow/launch.hpp"

namespace shardflow {

MirrorShard::MirrorShard(int distance, int source, const BucketPlan& plan, const ShardPlan& shard, const std::vector<ParamSpec>& params,
                         const std::vector<std::size_t>& param_base, std::vector<DType> wire, std::size_t state_slots, ShardOps& ops)
    : distance_(distance), source_(source), plan_(plan), shard_(shard), params_(params), param_base_(param_base), wire_(std::move(wire)), slots_(state_slots), ops_(ops) {
  const auto src = std::size_t(source_);
  for (std::size_t b = 0; b < plan_.buckets.size(); ++b) {
    const std::size_t n = shard_.buckets[b].packed[src];
    auto floats = [&](bool keep) { return Floats{keep && n ? ops_.alloc(n * sizeof(float)) : nullptr}; };
    master_.push_back(floats(true));
    state_a_.push_back(floats(slots_ >= 1));
    state_b_.push_back(floats(slots_ >= 2));
    const std::size_t slice = n * dtype_size(wire_[b]);
    landing_.push_back(slice ? ops_.alloc(slice) : nullptr);
    held_slice_.push_back(slice ? ops_.alloc(slice) : nullptr);
  }
  held_.assign(plan_.buckets.size(), -1);
  clipped_.assign(plan_.buckets.size(), 0);
  masters_from_params();
}

void MirrorShard::masters_from_params() {
  std::fill(ahead_step_.begin(), ahead_step_.end(), -1);  // computed from other values
  for (std::size_t b = 0; b < plan_.buckets.size(); ++b)
    for (const auto& piece : shard_.buckets[b].pieces[std::size_t(source_)])
      ops_.cast(DType::f32, master_[b].data() + piece.packed_off, plan_.buckets[b].dtype,
                static_cast<const std::byte*>(params_[piece.param].data) + piece.param_off * dtype_size(plan_.buckets[b].dtype), piece.len);
}

void MirrorShard::arrived(std::size_t b, std::int64_t step) {
  if (held_[b] >= 0) {
    if (held_[b] >= step)
      throw Error("mirror of rank " + std::to_string(source_) + "'s shard: bucket " + std::to_string(b) + "'s slice of step " +
                  std::to_string(step) + " arrived while step " + std::to_string(held_[b]) + "'s is held");
    const auto in = inputs_.find(held_[b]);
    if (in == inputs_.end())
      throw Error("mirror of rank " + std::to_string(source_) + "'s shard: bucket " + std::to_string(b) + " holds step " +
                  std::to_string(held_[b]) + ", whose inputs this rank's shard never handed over");
    apply(b, in->second);
  }
  std::swap(landing_[b], held_slice_[b]);  // the next shift lands in the buffer just applied
  held_[b] = step;
  // Inputs of steps older than every held slice go.
  std::int64_t oldest = step;
  for (const auto h : held_)
    if (h >= 0) oldest = std::min(oldest, h);
  inputs_.erase(inputs_.begin(), inputs_.lower_bound(oldest));
}

void MirrorShard::stepped(StepInputs in) {
  const std::int64_t step = in.steps;
  inputs_.insert_or_assign(step, std::move(in));
}

void MirrorShard::feeds_syncs(bool after_step) {
  // The step scales in place what it steps from: the reduced fp32 slice itself, not a 16-bit
  // wire's slice (cast to fp32 first) nor a 16-bit gradient (stepped from an fp32 copy).
  for (std::size_t b = 0; b < plan_.buckets.size(); ++b) {
    clipped_[b] = after_step && wire_[b] == DType::f32 && plan_.buckets[b].dtype == DType::f32;
    const std::size_t n = shard_.buckets[b].packed[std::size_t(source_)];
    auto floats = [&](bool keep) { return Floats{keep && n ? ops_.alloc(n * sizeof(float)) : nullptr}; };
    ahead_values_.push_back(floats(true));
    ahead_a_.push_back(floats(slots_ >= 1));
    ahead_b_.push_back(floats(slots_ >= 2));
  }
  ahead_step_.assign(plan_.buckets.size(), -1);
}

const MirrorShard::StepInputs& MirrorShard::inputs_of(std::int64_t step) const {
  const auto in = inputs_.find(step);
  if (in == inputs_.end())
    throw Error("mirror of rank " + std::to_string(source_) + "'s shard: the inputs of step " + std::to_string(step) +
                " were asked for, and this rank's shard holds none for it");
  return in->second;
}

bool MirrorShard::reachable(std::int64_t steps) const {
  for (std::size_t b = 0; b < held_.size(); ++b) {
    const std::int64_t at = held_[b] >= 0 ? held_[b] : standing_;
    if (at == steps) continue;
    if (at + 1 != steps || held_[b] < 0 || inputs_.count(held_[b]) == 0) return false;
  }
  return true;
}

bool MirrorShard::reach(std::int64_t steps) {
  if (!reachable(steps)) return false;  // all or nothing: a twin half brought to a step could go to no other
  for (std::size_t b = 0; b < held_.size(); ++b) {
    const std::int64_t at = held_[b] >= 0 ? held_[b] : standing_;  // a held slice's step is not applied yet
    if (at == steps) continue;
    if (at + 1 != steps || held_[b] < 0) return false;
    const auto in = inputs_.find(held_[b]);
    if (in == inputs_.end()) return false;
    apply(b, in->second);
    held_[b] = -1;
  }
  standing_ = steps;
  return true;
}

// The source's Shard::step on the held slice, with the step's inputs as they were on the source.
void MirrorShard::apply(std::size_t b, const StepInputs& in) {
  if (!ahead_step_.empty()) {
    // Note [Syncs from the twin]: values_after ran this very step (the same state, slice and
    // inputs) and kept the result: it becomes the state, and the buffers left go to the next one.
    const bool ahead = ahead_step_[b] == in.steps;
    ahead_step_[b] = -1;
    if (ahead) {
      std::swap(master_[b], ahead_values_[b]);
      std::swap(state_a_[b], ahead_a_[b]);
      std::swap(state_b_[b], ahead_b_[b]);
      return;
    }
  }
  if (in.skipped) return;
  const DType dt = plan_.buckets[b].dtype;
  const auto& pieces = shard_.buckets[b].pieces[std::size_t(source_)];
  const std::byte* slice = held_slice_[b].get();
  DType grad_dtype = dt;
  if (wire_[b] != dt) {  // an fp32 bucket on a 16-bit wire: the source stepped the slice cast back
    const std::size_t n = shard_.buckets[b].packed[std::size_t(source_)];
    if (scratch_.size() < n) scratch_.resize(n);
    ops_.cast(DType::f32, scratch_.data(), wire_[b], slice, n);
    slice = reinterpret_cast<const std::byte*>(scratch_.data());
    grad_dtype = DType::f32;
  }
  for (const auto& piece : pieces) {
    if (piece.len == 0 || in.unused[piece.param]) continue;
    ShardOps::Update u;
    const auto at = piece.packed_off;
    update_piece(b, piece, in, master_[b].data() + at, state_a_[b].mem ? state_a_[b].data() + at : nullptr,
                 state_b_[b].mem ? state_b_[b].data() + at : nullptr, const_cast<std::byte*>(slice) + at * dtype_size(grad_dtype), grad_dtype);
  }
}

// The source's Shard::step of one piece: `values` and the state (null: none) at the piece's place,
// from its reduced gradient `grad`, with the step's inputs as they were on the source.
void MirrorShard::update_piece(std::size_t b, const ShardPiece& piece, const StepInputs& in, float* values, float* a, float* s, void* grad,
                               DType grad_dtype, const float* from_values, const float* from_a, const float* from_s) {
  ShardOps::Update u;
  u.master = values;
  u.param_dtype = plan_.buckets[b].dtype;
  u.round_as = wire_[b];
  u.grad = grad;
  u.grad_dtype = grad_dtype;
  u.clip = ClipCoef{clipped_[b] ? 1.0f : in.clip, nullptr};
  u.state_a = a;
  u.state_b = s;
  u.from_master = from_values;
  u.from_a = from_a;
  u.from_b = from_s;
  u.n = piece.len;
  const std::int64_t own = in.steps - in.sat_out[piece.param];
  u.first = own == 0;
  u.step = own + 1;
  u.param_name = &params_[piece.param].name;
  u.offset = piece.param_off;
  ops_.update(in.groups->groups[in.groups->group_of[piece.param]], u);
}

// Note [Syncs from the twin]
// At world 2 a rank's twin mirrors the only other rank, so the twin, stepped one step further,
// gives every value the parameter sync would bring: the all-gather stays off the wire, and the
// shift that feeds the twin goes in the sync's place in the schedule instead of right after the
// reduce-scatter (the bucket's owner steps without it; forward with prefetch waits for it as it
// waited for the sync, and the shifts of the buckets forward needs later go while it computes).
// The link then carries a reduce-scatter and a shift a bucket: as many bytes as the reduce-
// scatter and the all-gather without twins, where the twins used to cost half again (1.50x the
// step on a link-bound job across two hosts). The twin must stay one step behind (Note
// [Mirrored shards]), so the step reads the twin's values and state and writes buffers kept
// beside them (no copies: kernels::adam_step's *_in), from a copy of the slice, piece by piece;
// the apply a step later takes those buffers as the state. The source's step inputs are this rank's own for
// the same step (the clip coefficient, the skipped and unused parameters and the counts are the
// same on every rank). The same code on the same bytes as the source's Shard::step, so the
// values are the source's bit for bit; they reach the parameters rounded as the sync would have
// rounded them (Shard::twin_synced).
// Only where the two ranks sit on two hosts (twins_give_syncs): there the all-gather crosses the
// network. On one host it is a copy in memory, and the twin's step ahead on the same cores costs
// more (in-process world 2, compute-bound: 1.73x the step without twins, against 1.41x with the
// all-gather, 3 alternated rounds).
void MirrorShard::values_after(std::size_t b, const StepInputs& in, const std::function<void(const ShardPiece&, const float*)>& put) {
  if (held_[b] != in.steps)
    throw Error("mirror of rank " + std::to_string(source_) + "'s shard: bucket " + std::to_string(b) + "'s values after step " +
                std::to_string(in.steps) + " were asked for while it holds the slice of step " + std::to_string(held_[b]));
  if (ahead_step_.empty()) throw Error("mirror of rank " + std::to_string(source_) + "'s shard: values_after without feeds_syncs");
  const std::size_t ws = dtype_size(wire_[b]);
  float* const values = ahead_values_[b].data();
  float* const a = ahead_a_[b].mem ? ahead_a_[b].data() : nullptr;
  float* const s = ahead_b_[b].mem ? ahead_b_[b].data() : nullptr;
  const float* const from_a = state_a_[b].mem ? state_a_[b].data() : nullptr;
  const float* const from_s = state_b_[b].mem ? state_b_[b].data() : nullptr;
  // The pieces tile the source's packed range: each is stepped from the twin's values and state
  // into the buffers kept ahead, or (not stepped) copied there as it stands.
  for (const auto& piece : shard_.buckets[b].pieces[std::size_t(source_)]) {
    const std::size_t n = piece.len, at = piece.packed_off;
    if (n == 0) continue;
    if (!in.skipped && !in.unused[piece.param]) {
      if (grad_copy_.size() < n) grad_copy_.resize(n);
      float* grad = grad_copy_.data();  // a copy: the step scales its gradient in place, and the held slice stays as it landed
      ops_.cast(DType::f32, grad, wire_[b], held_slice_[b].get() + at * ws, n);
      update_piece(b, piece, in, values + at, a ? a + at : nullptr, s ? s + at : nullptr, grad, DType::f32, master_[b].data() + at,
                   from_a ? from_a + at : nullptr, from_s ? from_s + at : nullptr);
    } else {
      ops_.copy(values + at, master_[b].data() + at, n * sizeof(float));
      if (a) ops_.copy(a + at, from_a + at, n * sizeof(float));
      if (s) ops_.copy(s + at, from_s + at, n * sizeof(float));
    }
    put(piece, values + at);
  }
  ahead_step_[b] = in.steps;
}

void MirrorShard::export_state(std::size_t s, std::size_t begin, float* out, std::size_t n) const {
  std::fill(out, out + n, 0.0f);
  const auto& from = slot(s);
  for (std::size_t b = 0; b < plan_.buckets.size(); ++b) {
    if (!from[b].mem) continue;
    for_window(shard_, param_base_, source_, b, begin, n, [&](std::size_t packed, std::size_t window, std::size_t len) {
      ops_.download(out + window, from[b].data() + packed, len * sizeof(float));
    });
  }
}

void MirrorShard::import_state(std::size_t s, std::size_t begin, const std::vector<float>& in) {
  auto& to = slot(s);
  for (std::size_t b = 0; b < plan_.buckets.size(); ++b) {
    if (!to[b].mem) continue;
    for_window(shard_, param_base_, source_, b, begin, in.size(), [&](std::size_t packed, std::size_t window, std::size_t len) {
      ops_.upload(to[b].data() + packed, in.data() + window, len * sizeof(float));
    });
  }
  std::fill(held_.begin(), held_.end(), -1);  // a loaded state: nothing held belongs to it (Shard::loaded says where it stands)
  std::fill(ahead_step_.begin(), ahead_step_.end(), -1);
  inputs_.clear();
}

std::size_t MirrorShard::bytes() const {
  std::size_t n = 0;
  for (std::size_t b = 0; b < plan_.buckets.size(); ++b) {
    const std::size_t packed = shard_.buckets[b].packed[std::size_t(source_)];
    n += packed * sizeof(float) * (1 + std::min<std::size_t>(slots_, 2)) * (ahead_step_.empty() ? 1 : 2) + 2 * packed * dtype_size(wire_[b]);
  }
  return n;
}

int ranks_per_host(int world, const std::function<const char*(const char*)>& getenv) {
  const char* local = getenv ? getenv("LOCAL_WORLD_SIZE") : std::getenv("LOCAL_WORLD_SIZE");
  int L = 0;
  if (local && *local) {
    L = std::atoi(local);
  } else {
    // srun and mpirun say it in variables of their own (SLURM_TASKS_PER_NODE, OMPI_COMM_WORLD_LOCAL_SIZE).
    // Reading only LOCAL_WORLD_SIZE put a twin on its own rank's host under them (distance 1),
    // where the loss of that host takes both.
    const auto env = LaunchEnv::detect(getenv);
    if (env.source == "slurm" || env.source == "openmpi") L = env.local_world_size;
  }
  return L > 0 && world % L == 0 ? L : 0;
}

bool twins_give_syncs(int world) { return world == 2 && ranks_per_host(world) == 1; }

int twin_distance(const Config& cfg, int world) {
  int d = cfg.zero.twin_distance;
  if (d == 0) {
    // Under a launcher the node's ranks are consecutive: the next node's same local rank is L on.
    const int L = ranks_per_host(world);
    d = L > 0 && L < world ? L : 1;
  }
  if (world > 1 && d % world == 0)
    throw UsageError(cfg.name_of("zero.twin_distance") + " = " + std::to_string(d) + " at world " + std::to_string(world) +
                     " brings each rank's slices back to itself: its twin would be lost with it");
  return d;
}

namespace {
std::mutex observer_mu;
std::function<void(const Shard&)> observer;
}  // namespace

void set_mirror_observer_for_tests(std::function<void(const Shard&)> observe) {
  std::lock_guard lock(observer_mu);
  observer = std::move(observe);
}

void observe_mirror_for_tests(const Shard& shard) {
  std::function<void(const Shard&)> f;
  {
    std::lock_guard lock(observer_mu);
    f = observer;
  }
  if (f) f(shard);
}

}  // namespace shardflow
