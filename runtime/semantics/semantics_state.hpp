// The state of each training-semantics feature, one struct per feature, held together in
// SemanticsState (below) and worked on by the feature's own file in this folder; the core reaches
// a feature only through the named calls declared with it in runtime/rank/runtime_impl.hpp. A
// feature never reads another feature's struct.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "shardflow/comm_hook.hpp"
#include "shardflow/types.hpp"

namespace shardflow {

// Note [Uneven inputs] (join.cpp): 1 / the ranks training this iteration, counted once at the start
// of each synchronised pass, and whether this rank has joined (out of data, shadowing the others).
struct JoinState {
  // Shared with the bucket actors, which divide by it (BucketCollectives).
  std::shared_ptr<std::atomic<float>> divisor = std::make_shared<std::atomic<float>>(1.0f);
  std::atomic<bool> counted{false};
  std::mutex count_mu;
  int training_ranks = 1;
  bool joined = false;
  // The next synchronised pass counts the training ranks again.
  void recount() { counted.store(false, std::memory_order_release); }
};

// Note [Static graph] (static_graph.cpp): the first synchronised iteration learns how many reports
// complete each gradient and which parameters no rank uses; from then on both are fixed.
struct StaticGraphState {
  bool learnt = false;
  std::vector<std::uint8_t> expected_reports;              // per parameter, once learnt
  std::unique_ptr<std::atomic<std::uint64_t>[]> last_report;  // learning: when each was last reported
  std::atomic<std::uint64_t> report_seq{0};
  void reset(std::size_t params) {
    last_report.reset(new std::atomic<std::uint64_t>[params]);
    for (std::size_t i = 0; i < params; ++i) last_report[i].store(0, std::memory_order_relaxed);
  }
};

// Note [Unused parameters] (unused_params.cpp): how many ranks reported each parameter's gradient,
// all-reduced once backward ends; the shard reads them too (a parameter no rank used sits the step out).
struct UnusedParamsState {
  std::shared_ptr<std::vector<float>> used_counts;
  void reset(std::size_t params) { used_counts = std::make_shared<std::vector<float>>(params, 0.0f); }
};

// Note [Changing the trainable set] (trainable.cpp): set_requires_grad after finalize, per
// parameter -1 (unchanged), 0 or 1, until refresh_trainable().
struct TrainableState {
  std::vector<signed char> wanted;
};

// Note [Changing hyper-parameters] (param_groups.cpp): the parameters a configure_optimizer group
// named (the others joined group 0 by default and may still go to a group of add_param_group's).
struct ParamGroupsState {
  std::vector<char> explicitly_grouped;
};

// Note [Flat buffers] (flat_buffers.cpp): the parameters register_flat made, by offset.
struct FlatBuffersState {
  struct Slot {
    std::size_t offset, numel;
    Param param;
  };
  std::vector<Slot> entries;
};

// Note [Comm hooks] (comm_hook_use.cpp): the trainer's hook, if it registered one.
struct CommHookState {
  std::shared_ptr<CommHook> hook;
};

// Note [Rank 0's state everywhere] (state_sync.cpp): device buffers' event, recorded on the compute
// stream when backward ends so that their broadcast reads what backward left.
struct StateSyncState {
  std::shared_ptr<void> buffers_event;
  bool initial_deferred = false;  // finalize() left the start-up broadcast to resumed_step()
};

// All of the folder's state. Runtime::Impl holds it through a pointer (`semantics`, made by
// make_semantics_state), so the rank's floor never includes this header: only the files of this
// folder open it, and the rank reaches a feature through the calls runtime_impl.hpp declares.
struct SemanticsState {
  StateSyncState state_sync;  // Note [Rank 0's state everywhere]
  UnusedParamsState unused;   // Note [Unused parameters]
  JoinState join;             // Note [Uneven inputs]
  StaticGraphState graph;     // Note [Static graph]
  TrainableState trainable;   // Note [Changing the trainable set]
  ParamGroupsState grouping;  // Note [Changing hyper-parameters]
  FlatBuffersState flat;      // Note [Flat buffers]
  CommHookState hook;         // Note [Comm hooks]
};

}  // namespace shardflow
