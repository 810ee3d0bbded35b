#include "runtime/shard.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "kernels/cpu/elementwise.hpp"
#include "kernels/cpu/optim.hpp"
#include "shardflow/errors.hpp"

namespace shardflow {

std::shared_ptr<std::byte> alloc_zeroed(std::size_t bytes) {
  // 64-byte aligned and zeroed: a bucket is a gradient accumulator from the start, and padding
  // must reduce as zeros.
  const std::size_t rounded = std::max<std::size_t>(64, (bytes + 63) / 64 * 64);
  auto* p = static_cast<std::byte*>(std::aligned_alloc(64, rounded));
  if (!p) throw std::bad_alloc();
  std::memset(p, 0, rounded);
  return std::shared_ptr<std::byte>(p, [](std::byte* q) { std::free(q); });
}

Shard::Shard(int stage, const Config& cfg, std::vector<ParamSpec> params, BucketPlan plan, ShardPlan shard,
             std::shared_ptr<OptimizerGroups> groups)
    : stage_(stage),
      clip_max_(cfg.clip_grad_norm),
      clip_type_(cfg.clip_norm_type),
      params_(std::move(params)),
      plan_(std::move(plan)),
      shard_(std::move(shard)),
      groups_(std::move(groups)) {
  std::size_t base = 0;
  for (const auto& p : params_) {
    param_base_.push_back(base);
    base += std::size_t(numel(p.shape));
  }
  const std::size_t B = plan_.buckets.size(), r = std::size_t(shard_.rank);
  flat_ = !shard_.buckets.empty() && shard_.buckets.front().flat;
  const bool rs = reduce_scatters();
  const std::size_t slots = state_slots();
  for (std::size_t b = 0; b < B; ++b) {
    const auto& s = shard_.buckets[b];
    bucket_.push_back(alloc_zeroed(s.padded * 4));
    grad_shard_.push_back(rs ? alloc_zeroed(s.slice * 4) : nullptr);
    // Note [Bucket as sync staging]: once bucket b is stepped, this rank has consumed every gradient
    // it owns there (stage 2: they live in the shard anyway), so the bucket's own buffer carries
    // the parameter sync — no parameter-sized staging copy per rank.
    staging_.push_back(syncs() ? bucket_.back() : nullptr);
    state_a_.emplace_back(slots >= 1 ? s.packed[r] : 0, 0.0f);
    state_b_.emplace_back(slots >= 2 ? s.packed[r] : 0, 0.0f);
  }
  norm_ = std::shared_ptr<float>(new float[std::size_t(shard_.world)](), std::default_delete<float[]>());
}

float* Shard::grad_ptr(std::size_t b, const ShardPiece& piece) const {
  if (grad_shard_[b]) return reinterpret_cast<float*>(grad_shard_[b].get()) + piece.packed_off;
  return reinterpret_cast<float*>(bucket_[b].get()) + piece.bucket_off;
}

double Shard::partial_norm() const {
  const bool inf = std::isinf(clip_type_);
  double acc = 0.0;
  for (std::size_t b = 0; b < plan_.buckets.size(); ++b)
    for (const auto& piece : shard_.buckets[b].pieces[std::size_t(shard_.rank)]) {
      const float* g = grad_ptr(b, piece);
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
  const auto& pieces = shard_.buckets[b].pieces[std::size_t(shard_.rank)];
  for (const auto& piece : pieces) {
    if (piece.len == 0) continue;
    const OptimizerConfig& h = groups_->groups[groups_->group_of[piece.param]];
    float* p = param_ptr(piece.param) + piece.param_off;
    float* g = grad_ptr(b, piece);
    if (clip_coef < 1.0f) kernels::scale(DType::f32, g, piece.len, clip_coef);
    const float wd = h.effective_weight_decay();
    if (h.kind == OptimizerConfig::Kind::sgd) {
      float* buf = h.momentum != 0.0f ? state_a_[b].data() + piece.packed_off : nullptr;
      kernels::sgd_step(p, g, buf, piece.len, kernels::SgdHyper{h.lr, h.momentum, h.dampening, wd, h.nesterov},
                        steps_ == 0);
    } else {
      kernels::adam_step(p, g, state_a_[b].data() + piece.packed_off, state_b_[b].data() + piece.packed_off, piece.len,
                         kernels::AdamHyper{h.lr, h.beta1, h.beta2, h.eps, wd, h.kind == OptimizerConfig::Kind::adamw},
                         steps_ + 1);
    }
  }
}

void Shard::pack(std::size_t b) {
  const auto& s = shard_.buckets[b];
  const auto r = std::size_t(shard_.rank);
  float* st = reinterpret_cast<float*>(staging_[b].get());
  for (const auto& piece : s.pieces[r]) {
    float* dst = s.flat ? st + piece.bucket_off : st + s.packed_start[r] + piece.packed_off;
    std::memcpy(dst, param_ptr(piece.param) + piece.param_off, piece.len * 4);
  }
}

void Shard::unpack(std::size_t b) {
  const auto& s = shard_.buckets[b];
  const float* st = reinterpret_cast<const float*>(staging_[b].get());
  for (std::size_t k = 0; k < s.pieces.size(); ++k) {
    if (int(k) == shard_.rank) continue;
    for (const auto& piece : s.pieces[k]) {
      const float* src = s.flat ? st + piece.bucket_off : st + s.packed_start[k] + piece.packed_off;
      std::memcpy(param_ptr(piece.param) + piece.param_off, src, piece.len * 4);
    }
  }
}

std::size_t Shard::state_slots() const {
  const auto& h = groups_->groups.front();
  if (h.kind != OptimizerConfig::Kind::sgd) return 2;
  for (const auto& g : groups_->groups)
    if (g.momentum != 0.0f) return 1;
  return 0;
}

std::size_t Shard::state_bytes() const {
  std::size_t n = 0;
  for (std::size_t b = 0; b < state_a_.size(); ++b) n += (state_a_[b].size() + state_b_[b].size()) * 4;
  return n;
}

std::size_t Shard::grad_bytes() const {
  std::size_t n = 0;
  for (std::size_t b = 0; b < bucket_.size(); ++b) {
    n += shard_.buckets[b].padded * 4;
    if (grad_shard_[b]) n += shard_.buckets[b].slice * 4;
  }
  return n;
}

std::size_t Shard::comm_bytes() const {
  return std::size_t(shard_.world) * 4;  // the norm exchange; syncs reuse the buckets
}

std::vector<float> Shard::export_state(std::size_t slot) const {
  std::size_t total = 0;
  for (const auto& p : params_) total += std::size_t(numel(p.shape));
  std::vector<float> full(total, 0.0f);
  const auto& src = slot == 0 ? state_a_ : state_b_;
  for (std::size_t b = 0; b < plan_.buckets.size(); ++b)
    for (const auto& piece : shard_.buckets[b].pieces[std::size_t(shard_.rank)])
      if (!src[b].empty())
        std::memcpy(full.data() + param_base_[piece.param] + piece.param_off, src[b].data() + piece.packed_off, piece.len * 4);
  return full;
}

void Shard::import_state(std::size_t slot, const std::vector<float>& full) {
  auto& dst = slot == 0 ? state_a_ : state_b_;
  for (std::size_t b = 0; b < plan_.buckets.size(); ++b)
    for (const auto& piece : shard_.buckets[b].pieces[std::size_t(shard_.rank)])
      if (!dst[b].empty())
        std::memcpy(dst[b].data() + piece.packed_off, full.data() + param_base_[piece.param] + piece.param_off, piece.len * 4);
}

}  // namespace shardflow
