// Node 0's view of the other nodes of a multi-node job: which exited, which are lost, and when
// each one's heartbeat last moved.
//
// Note [One owner for the peers' state]
// The heartbeat thread finds nodes exited or lost (NodeWatch::watch_peers) while the launcher's
// thread decides on restarts from the same facts (NodeWatch::decide, decide_restart, finish). Held
// as loose vectors beside NodeWatch's other state, one writer took the lock and a reader did not,
// and a std::vector<bool> packs the nodes' flags into shared words, so two nodes' updates race
// even under separate locks (ThreadSanitizer found it, on the path that chooses between a shrink,
// a restart and a stop). So the state lives here, one struct per node, private, and every read
// and write is a call that takes this table's lock; waiting for the nodes to settle is one of
// them, so no caller holds the lock across anything else.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

namespace shardflow::launch {

class PeerTable {
 public:
  using clock = std::chrono::steady_clock;

  // Every node watched afresh: none exited, none lost, no heartbeat seen yet (as of `now`).
  void reset(int nnodes, clock::time_point now);
  // Neither exited nor lost: its heartbeat still matters.
  bool watched(int node) const;
  bool exited(int node) const;
  bool lost(int node) const;
  void mark_exited(int node);
  void mark_lost(int node);
  // A heartbeat count read from the store: how long the count has not moved (zero when it just
  // moved).
  std::chrono::milliseconds beat(int node, std::int64_t beats, clock::time_point now);
  // Note [A stall is nobody's silence]: this node's own store calls were held up for `stalled`
  // (its heartbeat landed that much later than its interval allows). Every watched peer's silence
  // is shortened by it: their beats could not land either, or could not be read, and a peer is
  // lost only after the heartbeat timeout of time in which the store took this node's writes.
  void excuse(clock::duration stalled, clock::time_point now);
  // A node asking to come back (Note [Rejoining]): not exited, lost until the decision lets it in.
  void rejoining(int node);
  // A node in the next generation that was lost: watched afresh from `now`.
  void readmit(int node, clock::time_point now);
  // Waits, at most `limit`, until every node of `members` but node 0 has exited or is lost.
  void wait_settled(const std::vector<int>& members, std::chrono::milliseconds limit) const;

 private:
  struct Peer {
    bool exited = false, lost = false;
    std::int64_t last_beat = -1;  // the count last read; -1: none yet
    clock::time_point seen;       // when it last moved
  };
  Peer& at(int node);
  const Peer& at(int node) const;

  mutable std::mutex mu_;
  mutable std::condition_variable settled_;
  std::vector<Peer> peers_;
};

}  // namespace shardflow::launch
