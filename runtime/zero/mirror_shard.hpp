// A twin of another rank's optimizer shard, one step behind it (Note [Mirrored shards]).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "runtime/plans/bucket_plan.hpp"
#include "runtime/plans/shard_plan.hpp"
#include "runtime/zero/shard_ops.hpp"
#include "shardflow/config.hpp"
#include "shardflow/types.hpp"

namespace shardflow {

struct OptimizerGroups;

// Note [Mirrored shards]
// Under ZeRO a rank's optimizer state exists once: lose the rank and its shard is gone, so every
// rank rolls back to the newest snapshot. A mirror keeps a twin of the shard of the rank
// `distance` ranks back (its source; by default a host's ranks when there are several hosts, so
// that the twin lives on another host: twin_distance below): after each bucket's reduce-scatter
// the comm stream shifts every rank's reduced slice `distance` ranks on (Note [Shift]; one slice
// per rank on the wire, in the wire dtype), and the twin runs the source's update on it: the same
// bytes through the same code, so the twin's state is the source's bit for bit.
// The twin runs one step behind. A rank that fails in step k may leave the others half-way
// through it (some buckets stepped, some not), and step k must then be discarded everywhere; a
// twin that had applied k could not give the source's state at k - 1 back. So a slice that
// arrives is held, and applied when the next step's slice for the same bucket arrives (or when
// the survivors of a lost rank bring it to the step they go on from: reach). What a twin holds
// is then the source's state after step k - 1 and the reduced slice of step k: both ends of the
// failed step.
// Each step's inputs besides the slice (hyper-parameters, the clip coefficient, which parameters
// sat the step out, the step counts) are the same on every rank; the owner hands them over at
// its end_step, and the twin keeps them until it has applied that step everywhere.
// The twin keeps its own fp32 copy of the source's values (the source steps its parameters in
// place, or its fp32 masters): made from the parameters as the source's are, when both are the
// same on every rank. Costs: the twin's state (one state shard more, masters included), two
// slices a bucket in the wire dtype (the one landing and the one held), and the source's step
// again on this rank's cores; beside it the owner's copy from before the step (Shard).
class MirrorShard {
 public:
  // What one step of the source took besides its reduced slices.
  struct StepInputs {
    std::shared_ptr<const OptimizerGroups> groups;
    float clip = 1.0f;              // the clip (and unscale) coefficient, the same on every rank
    bool skipped = false;           // Note [Loss scaling]: no rank stepped
    std::int64_t steps = 0;         // the optimizer's step count before this step
    std::vector<std::int64_t> sat_out;  // per parameter, the steps it sat out before this one
    std::vector<char> unused;       // per parameter: not stepped in this step (unused, static graph)
  };

  MirrorShard(int distance, int source, const BucketPlan& plan, const ShardPlan& shard, const std::vector<ParamSpec>& params,
              const std::vector<std::size_t>& param_base, std::vector<DType> wire, std::size_t state_slots, ShardOps& ops);

  int source() const { return source_; }
  int distance() const { return distance_; }  // the shift that brings the source's slices here
  // Where bucket b's shifted slice lands (the wire dtype, the source's packed layout).
  const std::shared_ptr<std::byte>& landing(std::size_t b) const { return landing_[b]; }
  // Bucket b's slice of step `step` (the owner's count before it) landed: the one held is applied
  // (its step's inputs must have been handed over), this one is held.
  void arrived(std::size_t b, std::int64_t step);
  void stepped(StepInputs in);  // the owner's end_step: step in.steps is over on this rank
  const StepInputs& inputs_of(std::int64_t step) const;  // handed over by stepped(); Error if not (any more)
  // Note [Syncs from the twin]: this twin gives the syncs. At world 2 its slices are shifted after
  // the source's step (`after_step`), which scaled an fp32 bucket's reduced gradient in place by
  // the step's clip coefficient (ShardOps::update): those arrive clipped and are stepped without
  // clipping again; over two levels (Note [Syncs from the twin, two levels]) they come with the
  // reduction, before it. What values_after computes is kept (one state shard more), and the
  // apply a step later takes it.
  void feeds_syncs(bool after_step);
  // Note [Going on from the twins]: the state was made or loaded as it stood after `steps` steps
  // (what a bucket without a held slice stands at); and brings every bucket to where the source
  // stood after `steps` steps, applying a held slice where that is one step on: false if a
  // bucket cannot get there (it applied that step already, or holds an older one).
  void standing_at(std::int64_t steps) { standing_ = steps; }
  bool reach(std::int64_t steps);
  bool reachable(std::int64_t steps) const;  // whether reach(steps) would succeed; changes nothing
  // The step whose slice bucket b holds (the source's count before it; -1: none): the twin's
  // state there is the source's before that step.
  std::int64_t held_step(std::size_t b) const { return held_[b]; }
  // Note [Syncs from the twin]: the source's fp32 values of bucket b after the step whose slice b
  // holds (`in` are that step's inputs), piece by piece to `put`, computed beside the state (kept
  // for that step's apply): the twin itself stays one step behind. Error if b holds no slice of
  // step in.steps.
  void values_after(std::size_t b, const StepInputs& in, const std::function<void(const ShardPiece&, const float*)>& put);

  // The source's values (slot state_slots) and state (slots below), as Shard::export_state has
  // its own: parameter coordinates, zeros outside the source's pieces.
  void export_state(std::size_t slot, std::size_t begin, float* out, std::size_t n) const;
  void import_state(std::size_t slot, std::size_t begin, const std::vector<float>& in);
  void masters_from_params();  // the values from the parameters as they are now (the same on every rank)
  std::size_t state_slots() const { return slots_; }
  std::size_t bytes() const;   // the twin's state, masters and slices

 private:
  struct Floats {
    std::shared_ptr<std::byte> mem;
    float* data() const { return reinterpret_cast<float*>(mem.get()); }
  };
  std::vector<Floats>& slot(std::size_t s) { return s == slots_ ? master_ : s == 0 ? state_a_ : state_b_; }
  const std::vector<Floats>& slot(std::size_t s) const { return const_cast<MirrorShard*>(this)->slot(s); }
  void apply(std::size_t b, const StepInputs& in);
  // `from_*`: what the step reads, when not where it writes (null: in place).
  void update_piece(std::size_t b, const ShardPiece& piece, const StepInputs& in, float* values, float* a, float* s, void* grad,
                    DType grad_dtype, const float* from_values = nullptr, const float* from_a = nullptr, const float* from_s = nullptr);

  const int distance_, source_;
  const BucketPlan& plan_;
  const ShardPlan& shard_;
  const std::vector<ParamSpec>& params_;
  const std::vector<std::size_t>& param_base_;
  std::vector<DType> wire_;  // [bucket] what the slices travel as
  std::size_t slots_;
  ShardOps& ops_;
  std::vector<Floats> master_, state_a_, state_b_;     // [bucket] the source's packed pieces
  std::vector<std::shared_ptr<std::byte>> landing_, held_slice_;  // [bucket]
  std::vector<std::int64_t> held_;                     // [bucket] the step of the held slice (-1: none)
  std::vector<char> clipped_;                          // [bucket] its slices arrive clipped (feeds_syncs)
  // feeds_syncs: [bucket] values_after's values and state, and the held step they are the result
  // of (-1: none); the apply of that step swaps them in.
  std::vector<Floats> ahead_values_, ahead_a_, ahead_b_;
  std::vector<std::int64_t> ahead_step_;
  std::int64_t standing_ = 0;                          // where a bucket without a held slice stands
  std::map<std::int64_t, StepInputs> inputs_;          // by step, until every bucket applied it
  std::vector<float> scratch_;                         // a 16-bit wire's slice in fp32
  std::vector<float> grad_copy_;                       // values_after's copy of a piece's slice
};

// The ranks a host runs under a launcher (LOCAL_WORLD_SIZE, else srun's or mpirun's own variables,
// as LaunchEnv reads them; a node's ranks are consecutive), if that divides `world`; 0: not known.
// `getenv` for tests; empty: the process's environment.
int ranks_per_host(int world, const std::function<const char*(const char*)>& getenv = {});
// Note [Syncs from the twin]: whether the twins give the syncs at `world` ranks: at world 2 when
// the two ranks sit on two hosts (LOCAL_WORLD_SIZE 1), where the all-gather crosses the network.
// On one host the all-gather is a copy in memory, cheaper than the twin's step ahead.
bool twins_give_syncs(int world);
// Config::zero.twin_distance as it applies at `world` ranks (Note [Mirrored shards]): UsageError
// for a distance that brings a rank's slices back to itself.
int twin_distance(const Config& cfg, int world);

class Shard;
// Tests only: `observe` (empty: none) sees each shard that keeps a twin at the end of its every
// step, on the shard's thread.
void set_mirror_observer_for_tests(std::function<void(const Shard&)> observe);
void observe_mirror_for_tests(const Shard& shard);

}  // namespace shardflow
