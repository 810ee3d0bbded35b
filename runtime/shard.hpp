// One rank's ZeRO shard: the optimizer state of the pieces it owns, and the work on them — the
// step, its share of the gradient norm, and packing / unpacking parameters for the sync. The shard
// actor (actors/shard_actor.cpp) decides *when*; this decides *what*. Buffers are shared_ptrs so
// that collectives in flight keep them alive (CollectiveOp::keep_alive).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "runtime/bucket_buffers.hpp"
#include "runtime/bucket_plan.hpp"
#include "runtime/shard_plan.hpp"
#include "shardflow/config.hpp"
#include "shardflow/optimizer.hpp"
#include "shardflow/types.hpp"

namespace shardflow {

struct OptimizerGroups {
  std::vector<OptimizerConfig> groups;
  std::vector<std::uint32_t> group_of;  // by parameter
};

class Shard {
 public:
  Shard(int stage, const Config& cfg, std::vector<ParamSpec> params, BucketPlan plan, ShardPlan shard,
        std::shared_ptr<OptimizerGroups> groups, std::shared_ptr<BucketBuffers> buffers);

  const BucketPlan& plan() const { return plan_; }
  const ShardPlan& shard_plan() const { return shard_; }
  int stage() const { return stage_; }
  // Stage 2 keeps only its shard of the reduced gradients (Note [Pooled buckets (ZeRO-2)]): flat
  // slices arrive by reduce-scatter, other partitions are extracted from the all-reduced bucket.
  bool keeps_grad_shard() const { return stage_ == 2 && shard_.sharded; }
  bool reduce_scatters() const { return keeps_grad_shard() && flat_; }
  bool syncs() const { return shard_.sharded; }
  bool clips() const { return clip_max_ > 0.0f; }

  BucketBuffers& buffers() const { return *buffers_; }
  // What bucket b's reduction and sync travel as: its dtype, or Config::comm_dtype for fp32.
  DType sync_dtype(std::size_t b) const { return plan_.buckets[b].dtype == DType::f32 ? comm_dtype_ : plan_.buckets[b].dtype; }
  // 16-bit staging of an fp32 bucket's reduction: the padded bucket, then (stage 2) the received slice.
  std::shared_ptr<std::byte> wire_buffer(std::size_t b) const { return wire_[b]; }
  std::shared_ptr<std::byte> grad_shard(std::size_t b) const { return grad_shard_[b]; }  // stage 2
  std::shared_ptr<float> norm_buffer() const { return norm_; }
  // Stage 2, non-flat partitions: copies this rank's pieces of the all-reduced bucket into its shard.
  void extract(std::size_t b);

  // This rank's share of the squared 2-norm (or the max for inf) over its owned reduced gradients.
  double partial_norm() const;
  // Combines the ranks' partials (norm_buffer after the exchange, or this rank's alone in stage 0),
  // records the norm and returns the clip coefficient (1: no clipping needed).
  float finish_norm();
  float last_norm() const { return last_norm_; }

  void step(std::size_t b, float clip_coef);  // updates the owned pieces of bucket b in place
  void end_step() { ++steps_; }
  // The hyper-parameters this iteration steps with (set_lr snapshots; Note [Hyper-parameter snapshots]).
  void set_groups(std::shared_ptr<const OptimizerGroups> g) { groups_ = std::move(g); }
  void pack(std::size_t b);    // owned updated parameters -> staging (acquired here)
  void unpack(std::size_t b);  // other ranks' parameters: staging -> the trainer's storage (released)

  std::size_t state_bytes() const;
  std::size_t grad_bytes() const;
  std::size_t comm_bytes() const;

  // Optimizer state in parameter coordinates (all parameters concatenated in registration order),
  // zeros where this rank owns nothing: summing every rank's export gives the full state, from
  // which a new partition imports its pieces (Note [State migration] in runtime.cpp).
  std::size_t state_slots() const;      // 0 (plain SGD), 1 (momentum), 2 (Adam)
  std::size_t migrate_slots() const;    // state slots, plus the fp32 master weights of 16-bit params
  std::vector<float> export_state(std::size_t slot) const;
  void import_state(std::size_t slot, const std::vector<float>& full);
  std::int64_t steps() const { return steps_; }
  void set_steps(std::int64_t s) { steps_ = s; }

 private:
  std::byte* param_bytes(std::uint32_t p) const { return static_cast<std::byte*>(params_[p].data); }
  std::size_t esize(std::size_t b) const { return dtype_size(plan_.buckets[b].dtype); }
  std::byte* grad_bytes_at(std::size_t b, const ShardPiece& piece) const;
  // The piece's reduced gradient as fp32: in place for fp32 buckets, converted into scratch_
  // otherwise (Note [Master weights]).
  float* grad_f32(std::size_t b, const ShardPiece& piece);

  int stage_;
  bool flat_ = false;
  float clip_max_, clip_type_;
  std::vector<ParamSpec> params_;
  std::vector<std::size_t> param_base_;  // offset of each parameter in parameter coordinates
  BucketPlan plan_;
  ShardPlan shard_;
  std::shared_ptr<const OptimizerGroups> groups_;
  std::shared_ptr<BucketBuffers> buffers_;
  std::vector<std::shared_ptr<std::byte>> grad_shard_;
  std::vector<std::vector<float>> state_a_, state_b_;  // [bucket] packed owned elements
  std::vector<std::vector<float>> master_;             // [bucket] fp32 masters of 16-bit buckets
  std::vector<float> scratch_;
  DType comm_dtype_ = DType::f32;
  std::vector<std::shared_ptr<std::byte>> wire_;
  std::shared_ptr<float> norm_;
  std::int64_t steps_ = 0;
  float last_norm_ = 0.0f;
};

}  // namespace shardflow
