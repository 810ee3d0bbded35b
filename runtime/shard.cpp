#include "runtime/shard.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "kernels/cpu/elementwise.hpp"
#include "shardflow/errors.hpp"

namespace shardflow {

Shard::Shard(int stage, const Config& cfg, std::vector<ParamSpec> params, BucketPlan plan, ShardPlan shard,
             std::shared_ptr<OptimizerGroups> groups, std::shared_ptr<BucketBuffers> buffers)
    : stage_(stage),
      clip_max_(cfg.clip_grad_norm),
      clip_type_(cfg.clip_norm_type),
      params_(std::move(params)),
      plan_(std::move(plan)),
      shard_(std::move(shard)),
      groups_(std::move(groups)),
      buffers_(std::move(buffers)),
      comm_dtype_(cfg.comm_dtype) {
  std::size_t base = 0;
  for (const auto& p : params_) {
    param_base_.push_back(base);
    base += std::size_t(numel(p.shape));
  }
  const std::size_t B = plan_.buckets.size(), r = std::size_t(shard_.rank);
  flat_ = !shard_.buckets.empty() && shard_.buckets.front().flat;
  const std::size_t slots = state_slots();
  for (std::size_t b = 0; b < B; ++b) {
    const auto& s = shard_.buckets[b];
    grad_shard_.push_back(keeps_grad_shard() ? alloc_zeroed(s.packed[r] * esize(b)) : nullptr);
    state_a_.emplace_back(slots >= 1 ? s.packed[r] : 0, 0.0f);
    state_b_.emplace_back(slots >= 2 ? s.packed[r] : 0, 0.0f);
    // Note [Master weights]: 16-bit parameters are stepped in fp32 masters the owner keeps; the
    // trainer's storage gets the rounded result, which is what the sync sends.
    // (fp32 parameters get masters too when they travel as 16 bits: Config::comm_dtype.)
    const bool masters = sync_dtype(b) != DType::f32 || plan_.buckets[b].dtype != DType::f32;
    master_.emplace_back(masters ? s.packed[r] : 0, 0.0f);
    wire_.push_back(plan_.buckets[b].dtype == DType::f32 && comm_dtype_ != DType::f32
                        ? alloc_zeroed((s.padded + s.slice) * dtype_size(comm_dtype_))
                        : nullptr);
    if (!master_.back().empty())
      for (const auto& piece : s.pieces[r]) {
        const void* src[1] = {param_bytes(piece.param) + piece.param_off * esize(b)};
        kernels::convert_to_f32(plan_.buckets[b].dtype, master_.back().data() + piece.packed_off, src[0], piece.len);
      }
  }
  norm_ = std::shared_ptr<float>(new float[std::size_t(shard_.world)](), std::default_delete<float[]>());
}

std::byte* Shard::grad_bytes_at(std::size_t b, const ShardPiece& piece) const {
  if (grad_shard_[b]) return grad_shard_[b].get() + piece.packed_off * esize(b);
  return buffers_->grad(b).get() + piece.bucket_off * esize(b);
}

float* Shard::grad_f32(std::size_t b, const ShardPiece& piece) {
  std::byte* g = grad_bytes_at(b, piece);
  if (plan_.buckets[b].dtype == DType::f32) return reinterpret_cast<float*>(g);
  if (scratch_.size() < piece.len) scratch_.resize(piece.len);
  kernels::convert_to_f32(plan_.buckets[b].dtype, scratch_.data(), g, piece.len);
  return scratch_.data();
}

double Shard::partial_norm() const {
  const bool inf = std::isinf(clip_type_);
  double acc = 0.0;
  std::vector<float> tmp;
  for (std::size_t b = 0; b < plan_.buckets.size(); ++b)
    for (const auto& piece : shard_.buckets[b].pieces[std::size_t(shard_.rank)]) {
      const float* g = reinterpret_cast<const float*>(grad_bytes_at(b, piece));
      if (plan_.buckets[b].dtype != DType::f32) {
        tmp.resize(piece.len);
        kernels::convert_to_f32(plan_.buckets[b].dtype, tmp.data(), grad_bytes_at(b, piece), piece.len);
        g = tmp.data();
      }
      if (inf)
        for (std::size_t i = 0; i < piece.len; ++i) acc = std::max(acc, double(std::fabs(g[i])));
      else
        for (std::size_t i = 0; i < piece.len; ++i) acc += double(g[i]) * double(g[i]);
    }
  return acc;
}

float Shard::finish_norm() {
  const bool inf = std::isinf(clip_type_);
  double total = 0.0;
  if (shard_.sharded) {
    for (int r = 0; r < shard_.world; ++r) total = inf ? std::max(total, double(norm_.get()[r])) : total + double(norm_.get()[r]);
  } else {
    total = partial_norm();
  }
  const double norm = inf ? total : std::sqrt(total);
  last_norm_ = float(norm);
  // torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), applied when below 1.
  const double coef = double(clip_max_) / (norm + 1e-6);
  return coef < 1.0 ? float(coef) : 1.0f;
}

void Shard::step(std::size_t b, float clip_coef) {
  const DType dt = plan_.buckets[b].dtype;
  const auto& pieces = shard_.buckets[b].pieces[std::size_t(shard_.rank)];
  for (const auto& piece : pieces) {
    if (piece.len == 0) continue;
    const OptimizerConfig& h = groups_->groups[groups_->group_of[piece.param]];
    const bool master = !master_[b].empty();
    float* p = master ? master_[b].data() + piece.packed_off
                      : reinterpret_cast<float*>(param_bytes(piece.param)) + piece.param_off;
    float* g = grad_f32(b, piece);
    if (clip_coef < 1.0f) kernels::scale(DType::f32, g, piece.len, clip_coef);
    float* s0 = state_a_[b].empty() ? nullptr : state_a_[b].data() + piece.packed_off;
    float* s1 = state_b_[b].empty() ? nullptr : state_b_[b].data() + piece.packed_off;
    apply_update(h, p, g, s0, s1, piece.len, steps_ == 0, steps_ + 1);
    if (dt != DType::f32) {  // the trainer's 16-bit storage gets the master, rounded once
      kernels::convert_from_f32(dt, param_bytes(piece.param) + piece.param_off * esize(b), p, piece.len);
    } else if (master) {
      // fp32 storage, 16-bit wire: keep exactly what the other ranks will receive.
      kernels::round_to(sync_dtype(b), reinterpret_cast<float*>(param_bytes(piece.param)) + piece.param_off, p,
                        piece.len);
    }
  }
}

void Shard::extract(std::size_t b) {
  if (!keeps_grad_shard() || reduce_scatters()) return;
  const std::byte* g = buffers_->grad(b).get();
  std::byte* dst = grad_shard_[b].get();
  const std::size_t es = esize(b);
  for (const auto& piece : shard_.buckets[b].pieces[std::size_t(shard_.rank)])
    std::memcpy(dst + piece.packed_off * es, g + piece.bucket_off * es, piece.len * es);
}

void Shard::pack(std::size_t b) {
  const auto& s = shard_.buckets[b];
  const auto r = std::size_t(shard_.rank);
  const std::size_t es = esize(b), ws = dtype_size(sync_dtype(b));
  std::byte* st = buffers_->acquire_staging(b).get();
  for (const auto& piece : s.pieces[r]) {
    const std::size_t at = s.flat ? piece.bucket_off : s.packed_start[r] + piece.packed_off;
    const std::byte* src = param_bytes(piece.param) + piece.param_off * es;
    if (ws == es)
      std::memcpy(st + at * ws, src, piece.len * es);
    else  // fp32 storage on a 16-bit wire (the values are already 16-bit exact)
      kernels::convert_from_f32(sync_dtype(b), st + at * ws, reinterpret_cast<const float*>(src), piece.len);
  }
}

void Shard::unpack(std::size_t b) {
  const auto& s = shard_.buckets[b];
  const std::size_t es = esize(b), ws = dtype_size(sync_dtype(b));
  const std::byte* st = buffers_->staging(b).get();
  for (std::size_t k = 0; k < s.pieces.size(); ++k) {
    if (int(k) == shard_.rank) continue;
    for (const auto& piece : s.pieces[k]) {
      const std::size_t at = s.flat ? piece.bucket_off : s.packed_start[k] + piece.packed_off;
      std::byte* dst = param_bytes(piece.param) + piece.param_off * es;
      if (ws == es)
        std::memcpy(dst, st + at * ws, piece.len * es);
      else
        kernels::convert_to_f32(sync_dtype(b), reinterpret_cast<float*>(dst), st + at * ws, piece.len);
    }
  }
  buffers_->release_staging(b);
}

std::size_t Shard::state_slots() const {
  const auto& h = groups_->groups.front();
  if (h.kind != OptimizerConfig::Kind::sgd) return 2;
  for (const auto& g : groups_->groups)
    if (g.momentum != 0.0f) return 1;
  return 0;
}

std::size_t Shard::migrate_slots() const {
  for (const auto& m : master_)
    if (!m.empty()) return state_slots() + 1;
  return state_slots();
}

std::size_t Shard::state_bytes() const {
  std::size_t n = 0;
  for (std::size_t b = 0; b < state_a_.size(); ++b) n += (state_a_[b].size() + state_b_[b].size() + master_[b].size()) * 4;
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
  return n;
}

namespace {

// Slot k of the migrated state: momentum / exp_avg, exp_avg_sq, then the masters.
const std::vector<std::vector<float>>& slot_of(std::size_t slot, std::size_t nstate, const std::vector<std::vector<float>>& a,
                                               const std::vector<std::vector<float>>& b,
                                               const std::vector<std::vector<float>>& m) {
  if (slot == nstate) return m;
  return slot == 0 ? a : b;
}

}  // namespace

std::vector<float> Shard::export_state(std::size_t slot) const {
  std::size_t total = 0;
  for (const auto& p : params_) total += std::size_t(numel(p.shape));
  std::vector<float> full(total, 0.0f);
  const auto& src = slot_of(slot, state_slots(), state_a_, state_b_, master_);
  for (std::size_t b = 0; b < plan_.buckets.size(); ++b)
    for (const auto& piece : shard_.buckets[b].pieces[std::size_t(shard_.rank)])
      if (!src[b].empty())
        std::memcpy(full.data() + param_base_[piece.param] + piece.param_off, src[b].data() + piece.packed_off, piece.len * 4);
  return full;
}

void Shard::import_state(std::size_t slot, const std::vector<float>& full) {
  auto& dst = const_cast<std::vector<std::vector<float>>&>(slot_of(slot, state_slots(), state_a_, state_b_, master_));
  for (std::size_t b = 0; b < plan_.buckets.size(); ++b)
    for (const auto& piece : shard_.buckets[b].pieces[std::size_t(shard_.rank)])
      if (!dst[b].empty())
        std::memcpy(dst[b].data() + piece.packed_off, full.data() + param_base_[piece.param] + piece.param_off, piece.len * 4);
}

}  // namespace shardflow
