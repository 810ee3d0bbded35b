// The rank actor: one per Runtime, the typed interface of shardflow/actor.hpp. Note [The rank
// actor] (rank_actor.cpp) says how it answers and why it is detached.
#pragma once

#include <caf/actor_system.hpp>

#include <functional>

#include "shardflow/actor.hpp"

namespace shardflow {

rank_api::actor spawn_rank_actor(caf::actor_system& sys, Runtime& rt);
// Stops it and waits until it is gone: nothing runs on its thread afterwards.
void stop_rank_actor(caf::actor_system& sys, rank_api::actor& h);
// Tells it that a bucket (or a handed-over entry) completed: its waiting requests may be answered.
std::function<void()> rank_actor_poke(const rank_api::actor& h);

}  // namespace shardflow
