#include "runtime/launch/peer_table.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace shardflow::launch {

PeerTable::Peer& PeerTable::at(int node) {
  if (node < 0 || std::size_t(node) >= peers_.size()) throw std::out_of_range("peer table: no node " + std::to_string(node));
  return peers_[std::size_t(node)];
}

const PeerTable::Peer& PeerTable::at(int node) const { return const_cast<PeerTable*>(this)->at(node); }

void PeerTable::reset(int nnodes, clock::time_point now) {
  std::lock_guard lock(mu_);
  peers_.assign(std::size_t(nnodes), Peer{});
  for (auto& p : peers_) p.seen = now;
}

bool PeerTable::watched(int node) const {
  std::lock_guard lock(mu_);
  return !at(node).exited && !at(node).lost;
}

bool PeerTable::exited(int node) const {
  std::lock_guard lock(mu_);
  return at(node).exited;
}

bool PeerTable::lost(int node) const {
  std::lock_guard lock(mu_);
  return at(node).lost;
}

void PeerTable::mark_exited(int node) {
  {
    std::lock_guard lock(mu_);
    at(node).exited = true;
  }
  settled_.notify_all();
}

void PeerTable::mark_lost(int node) {
  {
    std::lock_guard lock(mu_);
    at(node).lost = true;
  }
  settled_.notify_all();
}

std::chrono::milliseconds PeerTable::beat(int node, std::int64_t beats, clock::time_point now) {
  std::lock_guard lock(mu_);
  Peer& p = at(node);
  if (beats != p.last_beat) {
    p.last_beat = beats;
    p.seen = now;
  }
  return std::chrono::duration_cast<std::chrono::milliseconds>(now - p.seen);
}

void PeerTable::excuse(clock::duration stalled, clock::time_point now) {
  if (stalled <= clock::duration::zero()) return;
  std::lock_guard lock(mu_);
  for (auto& p : peers_)
    if (!p.exited && !p.lost) p.seen = std::min(now, p.seen + stalled);
}

void PeerTable::rejoining(int node) {
  std::lock_guard lock(mu_);
  at(node).exited = false;
  at(node).lost = true;  // watched afresh once the decision is taken (readmit)
}

void PeerTable::readmit(int node, clock::time_point now) {
  std::lock_guard lock(mu_);
  Peer& p = at(node);
  if (!p.lost) return;
  p.lost = false;
  p.last_beat = -1;
  p.seen = now;
}

void PeerTable::wait_settled(const std::vector<int>& members, std::chrono::milliseconds limit) const {
  std::unique_lock lock(mu_);
  settled_.wait_for(lock, limit, [&] {
    for (int k : members)
      if (k != 0 && !at(k).exited && !at(k).lost) return false;
    return true;
  });
}

}  // namespace shardflow::launch
