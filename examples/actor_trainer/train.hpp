// The MLP of examples/mlp trained by actors (examples/actor_trainer): a data loader, one actor per
// layer, a loss actor and a rank trainer per rank, on the actor system the runtime's own actors
// run on, talking to each rank through its rank actor (shardflow/actor.hpp). The same steps, data
// and arithmetic as mlp::train, so the two end bit for bit in the same place.
#pragma once

#include "examples/mlp/train.hpp"

namespace shardflow::actor_trainer {

// Ranks as actors of this process over the in-process backend (opt.world_size ranks). What it
// supports of TrainOptions: the model, data and loss, the optimizer inside the runtime at every
// ZeRO stage, overlap mode, partition and forward prefetch, clipping, bucket caps; UsageError
// naming the option otherwise. A failure on any rank is rethrown (the root cause, not the peers'
// aborts).
mlp::TrainResult train(const mlp::TrainOptions& opt);

// This process is rank comm->rank() of a multi-process job (shardflow run): one rank's actors.
mlp::TrainResult train_rank(const mlp::TrainOptions& opt, const std::shared_ptr<Communicator>& comm);

}  // namespace shardflow::actor_trainer
