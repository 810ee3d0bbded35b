#include "runtime/zero/shard.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "shardflow/communicator.hpp"
#include "shardflow/errors.hpp"

namespace shardflow {

Shard::Shard(int stage, const Config& cfg, std::vector<ParamSpec> params, BucketPlan plan, ShardPlan shard,
             std::shared_ptr<OptimizerGroups> groups, std::shared_ptr<BucketBuffers> buffers,
             std::shared_ptr<const MemoryOps> mem, bool migrating, int in_host_ranks)
    : stage_(stage),
      clip_max_(cfg.zero.clip_grad_norm),
      clip_type_(cfg.zero.clip_norm_type),
      params_(std::move(params)),
      plan_(std::move(plan)),
      shard_(std::move(shard)),
      groups_(std::move(groups)),
      buffers_(std::move(buffers)),
      ops_(make_shard_ops(std::move(mem))),
      comm_dtype_(cfg.precision.comm_dtype) {
  reduce_scatter_ = cfg.zero.reduce_scatter;
  std::size_t base = 0;
  for (const auto& p : params_) {
    param_base_.push_back(base);
    base += std::size_t(numel(p.shape));
  }
  total_elements_ = base;
  skipped_.assign(params_.size(), 0);
  skip_.assign(params_.size(), 0);
  fixed_skip_.assign(params_.size(), 0);
  // A migrating shard gets its state slot by slot from the shard it replaces.
  auto state = [&](std::size_t n) { return migrating ? Floats{nullptr, n} : floats(n); };
  const std::size_t B = plan_.buckets.size(), r = std::size_t(shard_.rank);
  ops_->make_events(per_bucket * B + 3);
  flat_ = !shard_.buckets.empty() && shard_.buckets.front().flat;
  const std::size_t slots = state_slots();
  for (std::size_t b = 0; b < B; ++b) {
    const auto& s = shard_.buckets[b];
    grad_shard_.push_back(keeps_grad_shard() ? ops_->alloc(s.packed[r] * esize(b)) : nullptr);
    state_a_.push_back(state(slots >= 1 ? s.packed[r] : 0));
    state_b_.push_back(state(slots >= 2 ? s.packed[r] : 0));
    // Note [Master weights]: 16-bit parameters are stepped in fp32 masters the owner keeps; the
    // trainer's storage gets the rounded result, which is what the sync sends.
    // (fp32 parameters get masters too when they travel as 16 bits: Config::precision.comm_dtype.)
    const bool masters = sync_dtype(b) != DType::f32 || plan_.buckets[b].dtype != DType::f32;
    master_.push_back(state(masters ? s.packed[r] : 0));
    wire_.push_back(plan_.buckets[b].dtype == DType::f32 && comm_dtype_ != DType::f32
                        ? ops_->alloc((s.padded + s.slice) * dtype_size(comm_dtype_))
                        : nullptr);
  }
  if (cfg.zero.redundancy == 2 && shard_.sharded && shard_.world > 1) {
    const int distance = twin_distance(cfg, shard_.world);
    if (ops_->on_gpu()) throw UsageError(cfg.name_of("zero.redundancy") + " = 2: device shards do not keep a twin yet");
    if (!reduce_scatters())
      throw UsageError(cfg.name_of("zero.redundancy") + " = 2: a twin takes its source's reduce-scatter slice; this plan's buckets are "
                       "all-reduced (the flat partition and " + cfg.name_of("zero.reduce_scatter") + " at stage 1, or stage 2, are needed)");
    std::vector<DType> wire;
    for (std::size_t b = 0; b < B; ++b) wire.push_back(sync_dtype(b));
    mirror_ = std::make_unique<MirrorShard>(distance, shift_source(shard_.rank, shard_.world, distance), plan_, shard_, params_,
                                            param_base_, std::move(wire), slots, *ops_);
    for (std::size_t b = 0; b < B; ++b) {
      const std::size_t n = shard_.buckets[b].packed[r];
      undo_values_.push_back(floats(n));
      undo_a_.push_back(floats(slots >= 1 ? n : 0));
      undo_b_.push_back(floats(slots >= 2 ? n : 0));
    }
    undo_step_.assign(B, -1);
    syncs_from_twin_ = twins_give_syncs(shard_.world);
    const int W = shard_.world;
    twin_in_host_ = !syncs_from_twin_ && in_host_ranks >= 2 && W == 2 * in_host_ranks && ((distance % W) + W) % W == in_host_ranks;
    if (shifts_in_sync()) mirror_->feeds_syncs(/*after_step=*/true);
  }
  if (!migrating) masters_from_params();
  if (ops_->on_gpu() && groups_ && groups_->groups.front().kind == OptimizerConfig::Kind::custom)
    throw UsageError("optimizer: step rule '" + groups_->groups.front().rule->name() + "' runs on the host; device shards step with SGD or Adam(W)");
  if (cfg.precision.dynamic_loss_scale) {
    if (ops_->on_gpu())
      throw UsageError(cfg.name_of("precision.dynamic_loss_scale") +
                       ": dynamic loss scaling decides on the host whether to skip a step; device shards do not support it yet");
    scaler_ = Scaler{true, cfg.precision.init_scale, cfg.precision.growth_factor, cfg.precision.backoff_factor, cfg.precision.growth_interval, 0};
  }
  auto norm = ops_->alloc(std::size_t(shard_.world) * sizeof(float));
  norm_ = std::shared_ptr<float>(norm, reinterpret_cast<float*>(norm.get()));
}

void Shard::masters_from_params() {
  if (mirror_) mirror_->masters_from_params();
  const std::size_t r = std::size_t(shard_.rank);
  for (std::size_t b = 0; b < plan_.buckets.size(); ++b)
    if (!master_[b].empty())
      for (const auto& piece : shard_.buckets[b].pieces[r])
        ops_->cast(DType::f32, master_[b].data() + piece.packed_off, plan_.buckets[b].dtype,
                   param_bytes(piece.param) + piece.param_off * esize(b), piece.len);
}

Shard::Floats Shard::floats(std::size_t n) { return Floats{n ? ops_->alloc(n * sizeof(float)) : nullptr, n}; }

std::byte* Shard::grad_bytes_at(std::size_t b, const ShardPiece& piece) const {
  if (grad_shard_[b]) return grad_shard_[b].get() + piece.packed_off * esize(b);
  return buffers_->grad(b).get() + piece.bucket_off * esize(b);
}

cuda::Event Shard::to_wire(std::size_t b, cuda::Event bucket_ready) {
  ops_->after(bucket_ready);
  const std::size_t n = shard_.buckets[b].padded;  // the whole padded bucket
  ops_->cast(sync_dtype(b), wire_[b].get(), DType::f32, buffers_->grad(b).get(), n);
  return ops_->record(slot(wire_slot, b));
}

void Shard::from_wire(std::size_t b, float* dst, const std::byte* from, std::size_t n) {
  ops_->cast(DType::f32, dst, sync_dtype(b), from, n);
}

void Shard::partial_norm() {
  std::vector<ShardOps::NormPart> parts;
  for (std::size_t b = 0; b < plan_.buckets.size(); ++b)
    for (const auto& piece : shard_.buckets[b].pieces[std::size_t(shard_.rank)])
      parts.push_back({plan_.buckets[b].dtype, grad_bytes_at(b, piece), piece.len});
  ops_->partial_norm(parts, std::isinf(clip_type_), norm_.get() + shard_.rank);
  ops_->record(norm_slot());
}

// Note [Loss scaling]
// fp16 gradients underflow unless the loss is scaled up; GradScaler's recipe, kept inside the
// runtime's step: the trainer multiplies its loss by loss_scale(), the reduced gradients are
// unscaled through the step's gradient coefficient (1/scale, times the clip coefficient when
// clipping, computed on the unscaled norm as torch does after unscale_), and the global norm that
// clipping already exchanges (Note [Collective schedule]: N) tells every rank at once whether any
// rank's gradients hold an inf or a NaN: then no rank steps (the syncs still go out, carrying
// the unchanged parameters, so the collectives stay in order), no parameter's step count
// advances, and the scale backs off; after growth_interval clean steps it grows. The scale and the
// tracker are the same on every rank, since every rank sees the same norm, and checkpoints carry
// them. Host shards only: the decision to skip is made on the host.
ClipCoef Shard::finish_norm() {
  // Sharded, the exchange filled every rank's slot; otherwise every rank saw every gradient.
  const float* partials = shard_.sharded ? norm_.get() : norm_.get() + shard_.rank;
  if (!scaler_.on) return ops_->clip_coef(partials, shard_.sharded ? shard_.world : 1, std::isinf(clip_type_), clip_max_);
  // Note [Loss scaling]: the norm of the scaled gradients, the same on every rank; unscaled, then
  // clipped as torch does after GradScaler.unscale_ (max / (norm + 1e-6) against unscaled values).
  ops_->clip_coef(partials, shard_.sharded ? shard_.world : 1, std::isinf(clip_type_), 0.0f);
  const double scaled = ops_->last_norm();
  skipping_ = !std::isfinite(scaled);
  if (skipping_) return ClipCoef{0.0f, nullptr};
  const double norm = scaled / double(scaler_.scale);
  ops_->set_last_norm(float(norm));
  const double clip = clip_max_ > 0.0f ? std::min(1.0, double(clip_max_) / (norm + 1e-6)) : 1.0;
  return ClipCoef{float(clip / double(scaler_.scale)), nullptr};
}

void Shard::step(std::size_t b, ClipCoef clip) {
  step_clip_ = clip.host;
  const DType dt = plan_.buckets[b].dtype;
  const bool master = !master_[b].empty();
  const auto& pieces = shard_.buckets[b].pieces[std::size_t(shard_.rank)];
  const auto stepped = [&](const ShardPiece& piece) { return piece.len != 0 && !skip_[piece.param] && !fixed_skip_[piece.param]; };
  // Note [Going on from the twins]: the pieces as they were before this step are kept. The step
  // reads them and writes the new ones into the other buffer of each pair, which then swap: no
  // copy of the state beside the step (it took more of a step's time than the update itself).
  // Parameters stepped where they are (no master) are copied, and the step reads that copy.
  const bool keep = mirror_ != nullptr;
  if (keep) {
    for (const auto& piece : pieces) {
      const std::size_t at = piece.packed_off, n = piece.len;
      if (!master)
        ops_->cast(DType::f32, undo_values_[b].data() + at, dt, param_bytes(piece.param) + piece.param_off * esize(b), n);
      if (stepped(piece)) continue;
      if (master) ops_->copy(undo_values_[b].data() + at, master_[b].data() + at, n * 4);  // not stepped: as it stands
      if (!state_a_[b].empty()) ops_->copy(undo_a_[b].data() + at, state_a_[b].data() + at, n * 4);
      if (!state_b_[b].empty()) ops_->copy(undo_b_[b].data() + at, state_b_[b].data() + at, n * 4);
    }
    undo_step_[b] = steps_;
  }
  for (const auto& piece : pieces) {
    if (!stepped(piece)) continue;
    ShardOps::Update u;
    const std::size_t at = piece.packed_off;
    std::byte* param = param_bytes(piece.param) + piece.param_off * esize(b);
    if (master) {
      u.master = (keep ? undo_values_[b] : master_[b]).data() + at;
      if (keep) u.from_master = master_[b].data() + at;
      u.param = param;  // refreshed from the master: 16-bit storage, or a 16-bit wire
    } else {
      u.master = reinterpret_cast<float*>(param);
      if (keep) u.from_master = undo_values_[b].data() + at;
    }
    u.param_dtype = dt;
    u.round_as = sync_dtype(b);
    u.grad = grad_bytes_at(b, piece);
    u.grad_dtype = dt;
    u.clip = clip;
    if (!state_a_[b].empty()) {
      u.state_a = (keep ? undo_a_[b] : state_a_[b]).data() + at;
      if (keep) u.from_a = state_a_[b].data() + at;
    }
    if (!state_b_[b].empty()) {
      u.state_b = (keep ? undo_b_[b] : state_b_[b]).data() + at;
      if (keep) u.from_b = state_b_[b].data() + at;
    }
    u.n = piece.len;
    const std::int64_t own = steps_ - skipped_[piece.param];  // the parameter's own count, as torch.optim keeps it
    u.first = own == 0;
    u.step = own + 1;
    u.param_name = &params_[piece.param].name;
    u.offset = piece.param_off;
    ops_->update(groups_->groups[groups_->group_of[piece.param]], u);
  }
  if (keep) {  // the new pieces become the state, the old ones what is kept
    if (master) std::swap(master_[b], undo_values_[b]);
    std::swap(state_a_[b], undo_a_[b]);
    std::swap(state_b_[b], undo_b_[b]);
  }
}

void Shard::skip_unused(const std::vector<float>& used) {
  for (std::size_t p = 0; p < params_.size(); ++p) skip_[p] = used[p] == 0.0f;
}

void Shard::set_fixed_skip(const std::vector<float>& used) {
  for (std::size_t p = 0; p < params_.size(); ++p) fixed_skip_[p] = used[p] == 0.0f;
}

void Shard::end_step() {
  if (mirror_) {  // what the twins of this shard, on other ranks, take the same from theirs
    mirror_->stepped(step_inputs());
    before_ = Before{skipped_, scaler_.scale, scaler_.tracker};
  }
  ++steps_;
  for (std::size_t p = 0; p < params_.size(); ++p) {
    skipped_[p] += skip_[p] || fixed_skip_[p] || skipping_;  // a skipped step counts for no parameter (GradScaler skips optimizer.step)
    skip_[p] = 0;
  }
  skipped_last_ = skipping_;
  if (scaler_.on) {
    if (skipping_) {
      scaler_.scale *= scaler_.backoff;
      scaler_.tracker = 0;
    } else if (++scaler_.tracker == scaler_.interval) {
      scaler_.scale *= scaler_.growth;
      scaler_.tracker = 0;
    }
  }
  skipping_ = false;
  if (mirror_) observe_mirror_for_tests(*this);
}

MirrorShard::StepInputs Shard::step_inputs() const {
  MirrorShard::StepInputs in;
  in.groups = groups_;
  in.clip = step_clip_;
  in.skipped = skipping_;
  in.steps = steps_;
  in.sat_out = skipped_;
  in.unused.resize(params_.size());
  for (std::size_t p = 0; p < params_.size(); ++p) in.unused[p] = skip_[p] || fixed_skip_[p];
  return in;
}

void Shard::twin_values(std::size_t b, const std::function<void(const ShardPiece&, const float*)>& put) {
  // The step of the slice the twin holds. Before end_step its inputs are this shard's own as they
  // stand; after it, what it handed over.
  const std::int64_t step = mirror_->held_step(b);
  mirror_->values_after(b, step == steps_ ? step_inputs() : mirror_->inputs_of(step), put);
}

void Shard::twin_synced(std::size_t b, std::int64_t step) {
  mirror_->arrived(b, step);
  const DType dt = plan_.buckets[b].dtype, wire = sync_dtype(b);
  twin_values(b, [&](const ShardPiece& piece, const float* values) {
    std::byte* param = param_bytes(piece.param) + piece.param_off * esize(b);
    if (wire == dt) return ops_->cast(dt, param, DType::f32, values, piece.len);
    // fp32 storage on a 16-bit wire: the value the sync would have brought, as the source's
    // step rounded it (Note [Master weights]).
    if (twin_wire_.size() < piece.len * dtype_size(wire)) twin_wire_.resize(piece.len * dtype_size(wire));
    ops_->cast(wire, twin_wire_.data(), DType::f32, values, piece.len);
    ops_->cast(dt, param, wire, twin_wire_.data(), piece.len);
  });
}

void Shard::take_grad_shard(std::size_t b) {
  if (!keeps_grad_shard()) return;
  if (!reduce_scatters()) {
    const std::byte* g = buffers_->grad(b).get();
    std::byte* dst = grad_shard_[b].get();
    const std::size_t es = esize(b);
    for (const auto& piece : shard_.buckets[b].pieces[std::size_t(shard_.rank)])
      ops_->copy(dst + piece.packed_off * es, g + piece.bucket_off * es, piece.len * es);
    // The trainer may write its next gradients into this buffer as soon as the pool has it back.
    ops_->fence_compute(actor_fence());
  }
  // Note [Zeroed on the way back]: on the CPU cleared here, not by the trainer that takes it next.
  // On a GPU the taker's clearing is an async memset on the compute stream that costs it next to
  // nothing, and clearing it here would make the compute stream wait for the shard's stream (the
  // steps enqueued on it) at every bucket.
  if (ops_->on_gpu()) return buffers_->release_grad(b);
  buffers_->release_grad(b, [this](std::byte* buf, std::size_t bytes) { ops_->zero(buf, bytes); });
}

void Shard::zero_bucket(std::size_t b) { ops_->zero(buffers_->grad(b).get(), buffers_->bytes(b)); }

std::size_t Shard::sync_at(std::size_t b, std::size_t k, const ShardPiece& piece, std::byte*& base) const {
  const auto& s = shard_.buckets[b];
  if (fused(b)) {  // k's region of the group buffer, this member's place in it (flat only)
    const auto g = fused_->fusion.group_of[b];
    const auto& group = fused_->fusion.groups[g];
    base = fused_->buffers[g].get();
    return k * group.slice + group.offset[fused_->fusion.position[b]] + (piece.bucket_off - k * s.slice);
  }
  return s.flat ? piece.bucket_off : s.packed_start[k] + piece.packed_off;  // base: the bucket's staging
}

void Shard::pack(std::size_t b) {
  pack_own(b);
  ops_->record(slot(pack_slot, b));
}

std::byte* Shard::pack_own(std::size_t b) {
  const auto& s = shard_.buckets[b];
  const auto r = std::size_t(shard_.rank);
  const std::size_t es = esize(b);
  std::byte* const staging = fused(b) ? nullptr : buffers_->acquire_staging(b).get();
  for (const auto& piece : s.pieces[r]) {
    std::byte* st = staging;
    const std::size_t at = sync_at(b, r, piece, st);
    // fp32 storage on a 16-bit wire: the values are already 16-bit exact (step rounded them).
    ops_->cast(sync_dtype(b), st + at * dtype_size(sync_dtype(b)), plan_.buckets[b].dtype,
               param_bytes(piece.param) + piece.param_off * es, piece.len);
  }
  return staging;
}

// Note [Syncs from the twin, two levels]
// Over two levels at two hosts of L ranks, with the twin a host away (distance L, the default
// under a launcher), rank (h, l)'s twin mirrors (1 - h, l): the one rank whose block the
// all-gather's stage between the hosts would bring it. So the bucket's sync is the shift of the
// reduced slice to the twin, as at world 2 (Note [Syncs from the twin]); once it landed the twin
// steps once more into the buffers it keeps ahead (MirrorShard::values_after) and its values go
// into the staging where the source's block goes, beside the owner's own block (pack), rounded
// as the source's pack rounds them. Then the gather inside each host alone (CollectiveOp::in_host;
// the schedule's G(b), one sync after S(b): Note [Collective schedule]). The network carries the
// reduce-scatter and the shift, ZeRO's own bytes between the hosts, where the twins used to add
// the shift to them (1.45-1.47x the step without twins, the 1024x8 MLP at 2 x 2 over 1 Gbit/s).
// The shift went with the reduction until 2026-12-05. Then the last bucket's shift, the one the
// next forward needs first, was the last of every bucket's reduce-scatter and shift on the link:
// forward waited for all of them, where without twins it waits for the reduce-scatters and the
// first all-gathers and computes under the rest. In its sync's place: 0.98x (ZeRO-1) and 1.02x
// (ZeRO-2) the step without twins, from 1.12x and 1.14x (bench/RESULTS.md, "The twins' shifts in
// the syncs' place").
// The rank's own block is packed here too, not after its step: without pooling the staging is the
// bucket itself, whose slice the shift has just sent.
void Shard::twin_shifted(std::size_t b, std::int64_t step) {
  mirror_->arrived(b, step);
  pack_twin(b, pack_own(b));
  ops_->record(slot(pack_slot, b));
}

void Shard::pack_twin(std::size_t b, std::byte* staging) {
  const DType wire = sync_dtype(b);
  const auto source = std::size_t(mirror_->source());
  twin_values(b, [&](const ShardPiece& piece, const float* values) {
    std::byte* st = staging;
    const std::size_t at = sync_at(b, source, piece, st);
    ops_->cast(wire, st + at * dtype_size(wire), DType::f32, values, piece.len);
  });
}

void Shard::unpack(std::size_t b) {
  const auto& s = shard_.buckets[b];
  const std::size_t es = esize(b), ws = dtype_size(sync_dtype(b));
  std::byte* const staging = fused(b) ? nullptr : buffers_->staging(b).get();
  for (std::size_t k = 0; k < s.pieces.size(); ++k) {
    if (int(k) == shard_.rank) continue;
    for (const auto& piece : s.pieces[k]) {
      std::byte* st = staging;
      const std::size_t at = sync_at(b, k, piece, st);
      ops_->cast(plan_.buckets[b].dtype, param_bytes(piece.param) + piece.param_off * es, sync_dtype(b), st + at * ws,
                 piece.len);
    }
  }
  if (fused(b)) return;  // the group buffer is the shard's for the plan's life: nothing goes back
  if (buffers_->pooled()) ops_->fence_compute(actor_fence());  // as in take_grad_shard
  buffers_->release_staging(b);
}

void Shard::mark_done(std::size_t b) { ops_->record(slot(done_slot, b)); }
void Shard::join_compute() { ops_->fence_compute(trainer_fence()); }
void Shard::join_bucket(std::size_t b) { ops_->compute_after(slot(done_slot, b)); }

std::size_t OptimizerGroups::state_slots() const {
  if (groups.front().kind == OptimizerConfig::Kind::custom) return groups.front().rule->state_names().size();
  if (groups.front().kind != OptimizerConfig::Kind::sgd) return 2;
  for (const auto& g : groups)
    if (g.momentum != 0.0f) return 1;
  return 0;
}

std::size_t Shard::state_slots() const { return groups_->state_slots(); }

std::size_t Shard::migrate_slots() const {
  for (const auto& m : master_)
    if (!m.empty()) return state_slots() + 1;
  return state_slots();
}

std::size_t Shard::state_bytes() const {
  std::size_t n = 0;
  for (std::size_t b = 0; b < state_a_.size(); ++b) n += (state_a_[b].n + state_b_[b].n + master_[b].n) * 4;
  // Note [Mirrored shards]: the twin (its state, values and slices) and the owner's copy from before the step.
  for (std::size_t b = 0; b < undo_values_.size(); ++b) n += (undo_values_[b].n + undo_a_[b].n + undo_b_[b].n) * 4;
  if (mirror_) n += mirror_->bytes();
  return n;
}

std::size_t Shard::grad_bytes() const {
  std::size_t n = buffers_->allocated_bytes();
  for (std::size_t b = 0; b < grad_shard_.size(); ++b)
    if (grad_shard_[b]) n += shard_.buckets[b].packed[std::size_t(shard_.rank)] * esize(b);
  return n;
}

std::size_t Shard::comm_bytes() const {
  std::size_t n = std::size_t(shard_.world) * 4;  // the norm exchange; syncs reuse the buckets
  for (std::size_t b = 0; b < wire_.size(); ++b)
    if (wire_[b]) n += (shard_.buckets[b].padded + shard_.buckets[b].slice) * dtype_size(comm_dtype_);
  return n + fusion_buffer_bytes_;  // Note [Fused syncs]
}

const std::vector<Shard::Floats>& Shard::slot_buffers(std::size_t slot) const {
  // Slot k of the migrated state: momentum / exp_avg, exp_avg_sq, then the masters.
  if (slot == state_slots()) return master_;
  return slot == 0 ? state_a_ : state_b_;
}

void Shard::allocate_slot(std::size_t slot) {
  for (auto& f : slot_buffers(slot))
    if (f.n && !f.mem) f = floats(f.n);
}

void Shard::release_slot(std::size_t slot) {
  for (auto& f : slot_buffers(slot)) f.mem.reset();
}

void Shard::export_state(std::size_t slot, std::size_t begin, float* out, std::size_t n) const {
  std::fill(out, out + n, 0.0f);
  const auto& src = slot_buffers(slot);
  for (std::size_t b = 0; b < plan_.buckets.size(); ++b) {
    if (src[b].empty()) continue;
    for_window(shard_, param_base_, shard_.rank, b, begin, n, [&](std::size_t packed, std::size_t window, std::size_t len) {
      ops_->download(out + window, src[b].data() + packed, len * sizeof(float));
    });
  }
}

void Shard::discard_state(std::size_t slot, std::size_t begin, std::size_t n) {
  const auto& src = slot_buffers(slot);
  for (std::size_t b = 0; b < plan_.buckets.size(); ++b) {
    if (src[b].empty()) continue;
    for_window(shard_, param_base_, shard_.rank, b, begin, n, [&](std::size_t packed, std::size_t, std::size_t len) {
      ops_->discard(src[b].data() + packed, len * sizeof(float));
    });
  }
}

void Shard::loaded() {
  if (!mirror_) return;
  if (migrate_slots() == state_slots()) mirror_->masters_from_params();
  mirror_->standing_at(steps_);
  std::fill(undo_step_.begin(), undo_step_.end(), -1);
}

bool Shard::export_at(std::int64_t steps, std::size_t slot, std::size_t begin, float* out, std::size_t n) const {
  // Without a twin no undo is kept: only the state as it stands (Note [A join from memory]).
  if (steps != steps_ && (!mirror_ || steps != steps_ - 1)) return false;
  std::fill(out, out + n, 0.0f);
  const bool values = slot == state_slots();
  for (std::size_t b = 0; b < plan_.buckets.size(); ++b) {
    // Stepped in the step after `steps` (this one's undo holds the pieces before it), or not yet.
    const bool undo = mirror_ && undo_step_[b] == steps;
    // Stepped since, and nothing kept from before (unless that step was skipped: nothing moved).
    if (!undo && steps != steps_ && !skipped_last_) return false;
    const bool master = !master_[b].empty();
    const Floats& from = undo ? (values ? undo_values_[b] : slot == 0 ? undo_a_[b] : undo_b_[b])
                              : (values ? master_[b] : slot == 0 ? state_a_[b] : state_b_[b]);
    for_window(shard_, param_base_, shard_.rank, b, begin, n,
               [&](std::size_t packed, std::size_t window, std::size_t len, const ShardPiece& piece) {
      if (values && !undo && !master) {  // stepped in place: the parameters are the values
        ops_->cast(DType::f32, out + window, plan_.buckets[b].dtype,
                   param_bytes(piece.param) + (piece.param_off + packed - piece.packed_off) * esize(b), len);
      } else if (!from.empty()) {
        ops_->download(out + window, from.data() + packed, len * sizeof(float));
      }
    });
  }
  return true;
}

void Shard::import_state(std::size_t slot, std::size_t begin, const std::vector<float>& in) {
  if (mirror_ && slot <= mirror_->state_slots()) mirror_->import_state(slot, begin, in);
  const auto& dst = slot_buffers(slot);
  for (std::size_t b = 0; b < plan_.buckets.size(); ++b) {
    if (dst[b].empty()) continue;
    for_window(shard_, param_base_, shard_.rank, b, begin, in.size(), [&](std::size_t packed, std::size_t window, std::size_t len) {
      ops_->upload(dst[b].data() + packed, in.data() + window, len * sizeof(float));
    });
  }
}

}  // namespace shardflow
