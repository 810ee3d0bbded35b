// One rank's ZeRO shard: the optimizer state of the pieces it owns, and the work on them — the
// step, its share of the gradient norm, and packing / unpacking parameters for the sync. The shard
// actor (actors/shard_actor.cpp) decides *when*; this decides *what*, and its ShardOps *how*
// (host loops, or kernels on the shard's CUDA stream: Note [Shard streams]). Buffers are
// shared_ptrs so that collectives in flight keep them alive (CollectiveOp::keep_alive).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "runtime/core/bucket_buffers.hpp"
#include "runtime/plans/bucket_plan.hpp"
#include "runtime/core/device_memory.hpp"
#include "runtime/zero/mirror_shard.hpp"
#include "runtime/zero/shard_ops.hpp"
#include "runtime/plans/shard_plan.hpp"
#include "runtime/plans/sync_fusion.hpp"
#include "shardflow/config.hpp"
#include "shardflow/optimizer.hpp"
#include "shardflow/types.hpp"

namespace shardflow {

struct OptimizerGroups {
  std::vector<OptimizerConfig> groups;
  std::vector<std::uint32_t> group_of;  // by parameter
  // fp32 words of state per element: Adam 2, SGD with momentum (in any group) 1, plain SGD 0.
  std::size_t state_slots() const;
};

// The groups of syncs that go out as one all-gather, and each group's buffer: `world` regions of
// the group's slice, rank by rank (Note [Fused syncs]). Made with the schedule, at every spawn.
struct FusedSyncs {
  SyncFusion fusion;
  std::vector<std::shared_ptr<std::byte>> buffers;  // [group]: into the plan's fusion buffer
};

class Shard {
 public:
  // `mem`: where the parameters live (all on one device) and the trainer's compute stream.
  // `migrating`: the optimizer state comes from another shard (a rebuild), one slot at a time
  // (allocate_slot + import_state), so that both shards' state never exists in full at once.
  Shard(int stage, const Config& cfg, std::vector<ParamSpec> params, BucketPlan plan, ShardPlan shard,
        std::shared_ptr<OptimizerGroups> groups, std::shared_ptr<BucketBuffers> buffers,
        std::shared_ptr<const MemoryOps> mem, bool migrating = false, int in_host_ranks = 0);

  const BucketPlan& plan() const { return plan_; }
  const ShardPlan& shard_plan() const { return shard_; }
  int stage() const { return stage_; }
  // Stage 2 with pooled buckets keeps only its shard of the reduced gradients in a buffer of its
  // own (Note [Pooled buckets (ZeRO-2)]): flat slices arrive by reduce-scatter, other partitions
  // are copied out of the all-reduced bucket.
  bool keeps_grad_shard() const { return stage_ == 2 && shard_.sharded && buffers_->pooled(); }
  // Stages 1 and 2 with the flat partition reduce-scatter (Config::zero.reduce_scatter): into the
  // rank's own gradient shard when the buckets are pooled, else into the rank's slice of the
  // bucket itself, in place (Note [Memory at the ZeRO formula]); the step reads nothing else.
  // Other partitions own pieces of unequal size: their buckets are all-reduced (and, pooled, the
  // owned pieces copied out).
  bool reduce_scatters() const { return stage_ >= 1 && shard_.sharded && flat_ && (stage_ == 2 || reduce_scatter_); }
  bool syncs() const { return shard_.sharded; }
  // The global gradient norm is needed before any step: to clip, or (loss scaling) to find an inf.
  bool exchanges_norm() const { return clip_max_ > 0.0f || scaler_.on; }
  // Note [Loss scaling]: this iteration's steps are skipped (an inf or a NaN in some rank's
  // gradients, known once the norm is in); the scale the trainer multiplies its loss by.
  bool skipping() const { return skipping_; }
  bool last_skipped() const { return skipped_last_; }
  float loss_scale() const { return scaler_.scale; }
  int growth_tracker() const { return scaler_.tracker; }
  void set_loss_scale(float scale, int tracker) { scaler_.scale = scale, scaler_.tracker = tracker; }

  BucketBuffers& buffers() const { return *buffers_; }
  // What bucket b's reduction and sync travel as: its dtype, or Config::precision.comm_dtype for fp32.
  DType sync_dtype(std::size_t b) const { return plan_.buckets[b].dtype == DType::f32 ? comm_dtype_ : plan_.buckets[b].dtype; }
  // 16-bit staging of an fp32 bucket's reduction: the padded bucket, then (stage 2) the received slice.
  std::shared_ptr<std::byte> wire_buffer(std::size_t b) const { return wire_[b]; }
  std::shared_ptr<std::byte> grad_shard(std::size_t b) const { return grad_shard_[b]; }  // stage 2
  std::shared_ptr<float> norm_buffer() const { return norm_; }
  // Casts bucket b's fp32 gradients (written before `bucket_ready`, the compute stream's event)
  // into its wire buffer; returns the event the reduction waits for (null on the CPU).
  cuda::Event to_wire(std::size_t b, cuda::Event bucket_ready);
  // The reduction landed in the wire buffer at `from`: `n` values back into fp32 `dst`.
  void from_wire(std::size_t b, float* dst, const std::byte* from, std::size_t n);
  // Stage 2, after bucket b's reduction: keeps this rank's shard of it (non-flat partitions copy
  // their pieces out of the all-reduced bucket) and gives the bucket's buffer back to the pool.
  void take_grad_shard(std::size_t b);
  void zero_bucket(std::size_t b);  // done with the bucket: ready for the next gradients

  // This rank's share of the squared 2-norm (or the max for inf) over its owned reduced gradients,
  // into its slot of norm_buffer; norm_event() is what the exchange waits for (null on the CPU).
  void partial_norm();
  cuda::Event norm_event() const { return ops_->event(norm_slot()); }
  // Combines the ranks' partials (norm_buffer after the exchange, or this rank's alone in stage 0),
  // records the norm and returns the clip coefficient (1: no clipping needed).
  ClipCoef finish_norm();
  float last_norm() const { return ops_->last_norm(); }

  void step(std::size_t b, ClipCoef clip);  // updates the owned pieces of bucket b in place
  // Note [Mirrored shards]: the twin this rank keeps of another rank's shard (null: none), and
  // bucket b's reduction (with the shift that brought the source's slice) has landed.
  MirrorShard* mirror() const { return mirror_.get(); }
  void mirror_arrived(std::size_t b) {
    if (mirror_) mirror_->arrived(b, steps_);
  }
  // Note [Syncs from the twin]: at world 2 the twin gives the other rank's updated parameters:
  // bucket b's sync is the shift of its reduced slice, and once it landed (step `step`'s)
  // twin_synced takes it and writes the source's values of that step into the parameters.
  bool syncs_from_twin() const { return syncs_from_twin_; }
  void twin_synced(std::size_t b, std::int64_t step);
  // Note [Syncs from the twin, two levels]: over two levels at two hosts the sync is the shift to
  // the twin; once it landed (step `step`'s), twin_shifted steps the twin and puts its values into
  // the bucket's staging beside the rank's own (pack), and the gather runs inside the host only.
  bool twin_in_host() const { return twin_in_host_; }
  void twin_shifted(std::size_t b, std::int64_t step);
  // Either way the shift to the twin is the bucket's sync, not a part of its reduction.
  bool shifts_in_sync() const { return syncs_from_twin_ || twin_in_host_; }
  // The state was replaced (loaded, or migrated from the shard this one replaces): a twin that
  // keeps values the source steps in place takes them from the parameters just loaded.
  void loaded();
  // Note [Going on from the twins]: with a twin, the owner keeps each bucket's pieces as they
  // were before the step in flight, so that a failed step can be discarded here too. What this
  // shard held after `steps` optimizer steps (steps() or steps() - 1), slot by slot as
  // export_state has them, the values (slot migrate... state_slots()) whatever the masters: false
  // if that is no longer here. Without a twin only steps() is (Note [A join from memory]).
  bool export_at(std::int64_t steps, std::size_t slot, std::size_t begin, float* out, std::size_t n) const;
  // The per-parameter sat-out counts and the loss scale after `steps` steps (as export_at).
  std::vector<std::int64_t> skipped_at(std::int64_t steps) const { return steps == steps_ ? skipped_ : before_.skipped; }
  std::pair<float, int> loss_scale_at(std::int64_t steps) const {
    return steps == steps_ ? std::pair{scaler_.scale, scaler_.tracker} : std::pair{before_.scale, before_.tracker};
  }
  // The buckets' memory (the communicator's, for some backends) goes; what export_at reads stays.
  void drop_buckets() { buffers_.reset(); }
  // Note [Unused parameters]: `used[p]` is how many ranks reported p's gradient this iteration;
  // the parameters no rank did are not stepped (no weight decay, no momentum), and their own step
  // count stays where it was, as torch.optim skips a parameter whose grad is None.
  void skip_unused(const std::vector<float>& used);
  // Note [Static graph]: the same, for every iteration from now on.
  void set_fixed_skip(const std::vector<float>& used);
  void end_step();
  // The hyper-parameters this iteration steps with (set_lr snapshots; Note [Hyper-parameter snapshots]).
  void set_groups(std::shared_ptr<const OptimizerGroups> g) { groups_ = std::move(g); }
  // Owned updated parameters -> staging (acquired here); pack_event(b) is what the sync waits for.
  void pack(std::size_t b);
  cuda::Event pack_event(std::size_t b) const { return ops_->event(slot(pack_slot, b)); }
  void unpack(std::size_t b);  // other ranks' parameters: staging -> the trainer's storage (released)
  // A fused bucket packs into and unpacks from its group's buffer instead of a staging buffer of
  // its own. Set between iterations (the actors are being spawned); null: none fused.
  void set_fused_syncs(std::shared_ptr<const FusedSyncs> f) { fused_ = std::move(f); }
  const FusedSyncs* fused_syncs() const { return fused_.get(); }
  bool fused(std::size_t b) const { return fused_ && fused_->fusion.fused(b); }
  // The plan's fusion buffer (fusion_buffer_bytes), made at the first spawn, kept for the plan's life.
  const std::shared_ptr<std::byte>& fusion_buffer() const { return fusion_buffer_; }
  void set_fusion_buffer(std::shared_ptr<std::byte> buf, std::size_t bytes) { fusion_buffer_ = std::move(buf), fusion_buffer_bytes_ = bytes; }
  void mark_done(std::size_t b);  // bucket b's parameters are final for this iteration
  // The trainer's compute stream waits for the shard's work: all of it (wait()), or what bucket b
  // needs (wait_param with forward prefetch). No-ops on the CPU.
  void join_compute();
  void join_bucket(std::size_t b);
  // The other way: the shard's stream waits for the compute stream (Runtime::set_stream switched
  // streams: what the trainer enqueued on the new one comes before the shard's next work).
  void follow_compute() { ops_->after_compute(); }

  std::size_t state_bytes() const;
  std::size_t grad_bytes() const;
  std::size_t comm_bytes() const;

  // Optimizer state in parameter coordinates (all parameters concatenated in registration order),
  // zeros where this rank owns nothing: summing every rank's export gives the full state, from
  // which a new partition imports its pieces (Note [State migration] in runtime.cpp).
  std::size_t state_slots() const;      // 0 (plain SGD), 1 (momentum), 2 (Adam)
  std::size_t migrate_slots() const;    // state slots, plus the fp32 master weights of 16-bit params
  // The owned fp32 masters made from the parameters as they are now (a new shard's are; again
  // after the start-up broadcast, when resumed_step() made it: Note [Rank 0's state everywhere]).
  void masters_from_params();
  // Elements [begin, begin + out.size()) of slot `slot` in parameter coordinates (a window, so a
  // migration needs no full-size copy of the state).
  void export_state(std::size_t slot, std::size_t begin, std::vector<float>& out) const { export_state(slot, begin, out.data(), out.size()); }
  void export_state(std::size_t slot, std::size_t begin, float* out, std::size_t n) const;
  // The window exported last is not read again: its memory may go before the whole slot does.
  void discard_state(std::size_t slot, std::size_t begin, std::size_t n);
  void import_state(std::size_t slot, std::size_t begin, const std::vector<float>& in);
  std::size_t total_elements() const { return total_elements_; }
  const std::vector<std::size_t>& param_base() const { return param_base_; }  // where each parameter starts in those coordinates
  void allocate_slot(std::size_t slot);  // zeroed (a migrating shard's state)
  void release_slot(std::size_t slot);   // migrated away: its memory goes now
  std::int64_t steps() const { return steps_; }
  const std::vector<ParamSpec>& params() const { return params_; }
  void set_steps(std::int64_t s) { steps_ = s; }
  // Per parameter, the steps it sat out (unused on every rank): its own count is steps() minus it.
  const std::vector<std::int64_t>& skipped() const { return skipped_; }
  void set_skipped(std::vector<std::int64_t> s) { skipped_ = std::move(s); }

 private:
  // Per bucket, packed owned elements as fp32 (empty: none kept), in the shard's memory.
  struct Floats {
    std::shared_ptr<std::byte> mem;
    std::size_t n = 0;
    float* data() const { return reinterpret_cast<float*>(mem.get()); }
    bool empty() const { return n == 0; }
  };
  Floats floats(std::size_t n);
  // Event slots (ShardOps::record): per bucket, then the norm and the two compute fences.
  enum Slot : std::size_t { pack_slot, done_slot, wire_slot, per_bucket };
  std::size_t slot(Slot k, std::size_t b) const { return std::size_t(k) * plan_.buckets.size() + b; }
  std::size_t norm_slot() const { return per_bucket * plan_.buckets.size(); }
  std::size_t actor_fence() const { return norm_slot() + 1; }
  std::size_t trainer_fence() const { return norm_slot() + 2; }

  std::byte* param_bytes(std::uint32_t p) const { return static_cast<std::byte*>(params_[p].data); }
  std::size_t esize(std::size_t b) const { return dtype_size(plan_.buckets[b].dtype); }
  std::byte* grad_bytes_at(std::size_t b, const ShardPiece& piece) const;
  // Where rank k's piece of bucket b sits in what the sync moves, as a wire-dtype element offset
  // from `base`: the bucket's staging (the caller's), or its group's buffer (set here).
  std::size_t sync_at(std::size_t b, std::size_t k, const ShardPiece& piece, std::byte*& base) const;
  MirrorShard::StepInputs step_inputs() const;  // this step's, as every twin of this shard takes them
  // Note [Syncs from the twin]: the source's values after the step of the slice the twin holds of
  // bucket b, piece by piece; pack_twin puts them where the source's block goes in the staging.
  void twin_values(std::size_t b, const std::function<void(const ShardPiece&, const float*)>& put);
  void pack_twin(std::size_t b, std::byte* staging);  // Note [Syncs from the twin, two levels]
  std::byte* pack_own(std::size_t b);                  // pack's casts, without the event; the staging
  const std::vector<Floats>& slot_buffers(std::size_t slot) const;  // migrated state slot -> buffers
  std::vector<Floats>& slot_buffers(std::size_t slot) {
    return const_cast<std::vector<Floats>&>(static_cast<const Shard*>(this)->slot_buffers(slot));
  }

  int stage_;
  bool flat_ = false;
  bool reduce_scatter_ = true;  // Config::zero.reduce_scatter
  float clip_max_, clip_type_;
  struct Scaler {
    bool on = false;
    float scale = 1.0f, growth = 2.0f, backoff = 0.5f;
    int interval = 2000, tracker = 0;
  } scaler_;
  bool skipping_ = false, skipped_last_ = false;
  std::vector<ParamSpec> params_;
  std::vector<std::size_t> param_base_;  // offset of each parameter in parameter coordinates
  std::size_t total_elements_ = 0;
  BucketPlan plan_;
  ShardPlan shard_;
  std::shared_ptr<const OptimizerGroups> groups_;
  std::shared_ptr<BucketBuffers> buffers_;
  std::vector<std::shared_ptr<std::byte>> grad_shard_;
  std::unique_ptr<ShardOps> ops_;
  std::vector<Floats> state_a_, state_b_;  // [bucket] momentum / exp_avg, exp_avg_sq
  std::vector<Floats> master_;             // [bucket] fp32 masters (Note [Master weights])
  DType comm_dtype_ = DType::f32;
  std::vector<std::shared_ptr<std::byte>> wire_;
  std::shared_ptr<const FusedSyncs> fused_;
  std::shared_ptr<std::byte> fusion_buffer_;
  std::size_t fusion_buffer_bytes_ = 0;
  std::shared_ptr<float> norm_;
  std::int64_t steps_ = 0;
  std::vector<std::int64_t> skipped_;  // per parameter (Note [Unused parameters])
  std::vector<char> skip_;             // this iteration's parameters no rank used
  std::vector<char> fixed_skip_;       // static_graph: the parameters no rank uses, ever
  float step_clip_ = 1.0f;             // this iteration's clip coefficient (the twin's step input)
  // With a twin (Note [Going on from the twins]): [bucket] the owned values and state before the
  // step `undo_step_` (-1: none kept), and the counters before the last end_step.
  std::vector<Floats> undo_values_, undo_a_, undo_b_;
  std::vector<std::int64_t> undo_step_;
  struct Before {
    std::vector<std::int64_t> skipped;
    float scale = 1.0f;
    int tracker = 0;
  } before_;
  std::vector<std::byte> twin_wire_;     // twin_synced's values in the wire dtype (host shards only)
  bool syncs_from_twin_ = false;         // twins_give_syncs at this world, decided once
  bool twin_in_host_ = false;            // Note [Syncs from the twin, two levels], decided once
  std::unique_ptr<MirrorShard> mirror_;  // last: it refers to the members above
};

}  // namespace shardflow
