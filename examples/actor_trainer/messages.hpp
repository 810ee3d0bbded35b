// How the actor trainer's actors talk (examples/actor_trainer). Per rank:
//
//   main --run--> rank trainer --call(setup)--> rank actor (shardflow/actor.hpp)
//   per step:
//     rank trainer --zero_grad--> rank actor
//     rank trainer --batch(step)--> data loader --Batch--> rank trainer
//     rank trainer --targets(Batch)--> loss;  --forward(x)--> layer 0 --forward(h)--> ... --> loss
//       (forward prefetch: layer i --prefetch--> layer i+1 when layer i starts, the rank trainer
//        --prefetch--> layer 0 when the step starts; the layer asks the rank actor for its update
//        (params_ready) and computes once it has both the answer and its input: the round trip
//        hides behind the layer before's compute, and the answer never waits on a busy actor)
//     loss --loss(value)--> rank trainer;  loss --backward(dy)--> last layer
//     layer i --grad(W), grad(b)--> rank actor (slots) ... --grad_ready(W), grad_ready(b)--> rank actor
//     layer i --backward(dx)--> layer i-1 ... layer 0 --backward_done--> rank trainer
//     rank trainer --iteration--> rank actor --step_done--> rank trainer (next step)
#pragma once

#include <caf/allowed_unsafe_message_type.hpp>
#include <caf/atom.hpp>

#include <memory>
#include <vector>

namespace shardflow::actor_trainer {

// One rank's rows of one global batch.
struct Batch {
  int step = 0, rows = 0;
  std::vector<float> x, y;
};
using BatchPtr = std::shared_ptr<const Batch>;
using Activations = std::shared_ptr<const std::vector<float>>;  // a layer's output, read by the next and kept for backward
using Gradient = std::shared_ptr<std::vector<float>>;           // dL/d(output), handed down

using run_atom = caf::atom_constant<caf::atom("run")>;
using batch_atom = caf::atom_constant<caf::atom("batch")>;
using targets_atom = caf::atom_constant<caf::atom("targets")>;
using forward_atom = caf::atom_constant<caf::atom("forward")>;
using backward_atom = caf::atom_constant<caf::atom("backward")>;
using backward_done_atom = caf::atom_constant<caf::atom("bwd_done")>;
using loss_atom = caf::atom_constant<caf::atom("loss")>;
using failed_atom = caf::atom_constant<caf::atom("failed")>;
using prefetch_atom = caf::atom_constant<caf::atom("prefetch")>;  // forward prefetch: ask for your update now

}  // namespace shardflow::actor_trainer

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(shardflow::actor_trainer::BatchPtr)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(shardflow::actor_trainer::Activations)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(shardflow::actor_trainer::Gradient)
