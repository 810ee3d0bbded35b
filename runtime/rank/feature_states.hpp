// The features' own states, one struct each, defined in the feature's folder and worked on only by
// the feature's files (runtime/semantics/, runtime/overlap/, runtime/checkpoint/). Everyone else
// reaches a feature through the calls Runtime::Impl declares beside its name.
#pragma once

#include "runtime/checkpoint/background_save.hpp"
#include "runtime/overlap/overlap_state.hpp"
#include "runtime/semantics/semantics_state.hpp"

namespace shardflow {

struct FeatureStates {
  // semantics/: what DDP and OSS users rely on
  StateSyncState state_sync;  // Note [Rank 0's state everywhere]
  UnusedParamsState unused;   // Note [Unused parameters]
  JoinState join;             // Note [Uneven inputs]
  StaticGraphState graph;     // Note [Static graph]
  TrainableState trainable;   // Note [Changing the trainable set]
  ParamGroupsState grouping;  // Note [Changing hyper-parameters]
  FlatBuffersState flat;      // Note [Flat buffers]
  CommHookState hook;         // Note [Comm hooks]
  // overlap/: when the syncs go
  InterleaveLagState lag;       // Note [Choosing the interleave lag]
  ForwardPrefetchState prefetch;  // Note [Forward prefetch]
  // checkpoint/: saves in the background and the runtime's own snapshots
  BackgroundSaveState saves;  // Note [Sharded checkpoints]
  SnapshotState snapshots;    // Note [Snapshots]
};

}  // namespace shardflow
