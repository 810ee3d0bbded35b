// The actor trainer's actors, one per file.
#pragma once

#include <caf/event_based_actor.hpp>
#include <caf/stateful_actor.hpp>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "examples/actor_trainer/messages.hpp"
#include "examples/actor_trainer/rank_context.hpp"

namespace shardflow::actor_trainer {

// Answers batch(step) with this rank's rows of that global batch, and builds the next one while
// the step computes.
struct LoaderState {
  std::map<int, BatchPtr> ready;
  static inline const char* name = "data_loader";
};
caf::behavior data_loader(caf::stateful_actor<LoaderState>* self, const RankContext* ctx);

// One Linear layer (ReLU after it unless it is the last): forward from the layer before, backward
// from the layer after, its two gradients written into the runtime's slots and reported as soon as
// they are complete.
struct LayerState {
  Activations in;  // kept from forward for backward
  int rows = 0;
  // Forward prefetch: whether this step's update of the layer's parameters is in, and the input
  // that came before it did.
  bool landed = false;
  Activations waiting;
  std::uint64_t generation = 0;  // prefetches asked for: an answer to an older one is stale
  static inline const char* name = "layer";
};
caf::behavior layer(caf::stateful_actor<LayerState>* self, const RankContext* ctx, int index);

// Scores the last layer's output against the batch's targets, the loss to the rank trainer and
// dL/d(output) to the last layer.
struct LossState {
  BatchPtr batch;
  static inline const char* name = "loss";
};
caf::behavior loss(caf::stateful_actor<LossState>* self, const RankContext* ctx);

// Drives one rank's steps (the loop of mlp::train_steps as messages) and fills `result` (rank 0's
// parameters, losses and figures; this rank's memory reports at `slot`) before answering run.
struct RankTrainerState {
  caf::response_promise run;
  int step = 0;
  std::chrono::steady_clock::time_point t0;
  float loss = 0.0f;
  bool have_loss = false, have_backward = false, failed = false;
  // Recovering in place (Note [The actor trainer heals in place], rank_trainer.cpp): answers of an
  // earlier round are stale; the workers still to stop.
  std::uint64_t round = 0;
  bool recovering = false;
  std::size_t stopping = 0;
  int started_as = 0;  // the rank this process started as (its log lines name it)
  int first = 0;  // the step this round started at (after a snapshot): local_losses[step - first]
  std::vector<float> local_losses;
  // The global losses as mlp_train prints them: a step's report waits for the reduction of its
  // loss (every loss_every steps), the steps between show the last global value.
  std::vector<float> reduced;       // one slot per step: the buffers of the loss all-reduces
  std::vector<int> in_flight;       // steps whose loss is being reduced, oldest first
  float last_global = 0.0f;
  std::vector<mlp::StepReport> held;
  static inline const char* name = "rank_trainer";
};
caf::behavior rank_trainer(caf::stateful_actor<RankTrainerState>* self, RankContext* ctx, mlp::TrainResult* result, std::size_t slot);

}  // namespace shardflow::actor_trainer
