#include "runtime/core/rank_events.hpp"

#include <caf/actor_cast.hpp>
#include <caf/send.hpp>

#include <algorithm>

#include "shardflow/actor.hpp"

namespace shardflow {

void RankEvents::subscribe(caf::actor who, std::uint8_t mask) {
  if (!who) return;
  std::lock_guard lock(mu_);
  for (auto& [a, m] : subscribers_)
    if (a == who) {
      m = mask;  // subscribing again replaces the mask
      return;
    }
  subscribers_.emplace_back(std::move(who), mask);
}

void RankEvents::unsubscribe(const caf::actor& who) {
  std::lock_guard lock(mu_);
  subscribers_.erase(std::remove_if(subscribers_.begin(), subscribers_.end(), [&](const auto& s) { return s.first == who; }),
                     subscribers_.end());
}

std::vector<caf::actor> RankEvents::to(std::uint8_t event) {
  std::vector<caf::actor> out;
  std::lock_guard lock(mu_);
  for (const auto& [a, m] : subscribers_)
    if (m & event) out.push_back(a);
  return out;
}

void RankEvents::params_ready(std::uint32_t bucket, std::uint64_t iteration) {
  for (const auto& a : to(rank_api::params_ready)) caf::anon_send(a, rank_api::params_ready_atom::value, bucket, iteration);
}

void RankEvents::step_done(std::uint64_t iteration) {
  for (const auto& a : to(rank_api::step_done)) caf::anon_send(a, rank_api::step_done_atom::value, iteration);
}

void RankEvents::checkpoint_done(const std::string& dir, std::uint64_t step) {
  for (const auto& a : to(rank_api::checkpoint_done)) caf::anon_send(a, rank_api::checkpoint_done_atom::value, dir, step);
}

void RankEvents::failed(const caf::error& e) { failed(e, round()); }

void RankEvents::failed(const caf::error& e, std::uint64_t round) {
  {
    std::lock_guard lock(mu_);
    if (round != round_ || std::exchange(failed_, true)) return;
  }
  for (const auto& a : to(rank_api::failed)) caf::anon_send(a, rank_api::failed_atom::value, e);
}

std::uint64_t RankEvents::round() {
  std::lock_guard lock(mu_);
  return round_;
}

void RankEvents::recovered(const caf::actor& rank_actor, std::uint64_t step, int rank, int world) {
  {
    std::lock_guard lock(mu_);
    failed_ = false;  // the new round's failures are news again
    ++round_;
  }
  const auto typed = caf::actor_cast<rank_api::actor>(rank_actor);
  for (const auto& a : to(rank_api::recovered))
    caf::anon_send(a, rank_api::recovered_atom::value, typed, step, std::int32_t(rank), std::int32_t(world));
}

}  // namespace shardflow
