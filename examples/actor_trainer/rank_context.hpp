// What one rank's trainer actors share: the runtime and its rank actor, the model's storage (the
// registered parameters), the options and the handles of the rank's other actors. Filled before
// the first step and read-only afterwards, except `model`'s parameters, which only the runtime
// writes (its steps and syncs) while no layer reads them (Note [The rank actor]), and what a
// recovery in place changes (the rank, the world, the rank actor, the workers): the rank trainer
// changes those while none of its workers is alive (rank_trainer.cpp).
#pragma once

#include <caf/actor.hpp>

#include <vector>

#include "examples/mlp/model.hpp"
#include "examples/mlp/train.hpp"
#include "shardflow/actor.hpp"

namespace shardflow::actor_trainer {

struct RankContext {
  int rank = 0;
  int world = 1;  // this round's: a shrinking recovery makes it smaller
  const mlp::TrainOptions* opt = nullptr;
  const mlp::Dataset* data = nullptr;
  Runtime* rt = nullptr;
  rank_api::actor runtime;   // the rank actor
  mlp::Model* model = nullptr;
  std::vector<Param> params;  // [2 * layer + bias]
  bool prefetch = false;      // forward prefetch: each layer asks for its parameters' update
  // The rank's actors: its trainer, and the workers the trainer spawns (and spawns again after
  // recovering in place).
  caf::actor loader, loss, trainer;
  std::vector<caf::actor> layers;
  std::vector<caf::actor> workers() const;
};

}  // namespace shardflow::actor_trainer
