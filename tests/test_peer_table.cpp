// Node 0's view of its peers (runtime/launch/peer_table.hpp, Note [One owner for the peers'
// state]): the heartbeat thread marks nodes exited and lost and reads their beats while the
// launcher's thread decides from the same table. Run under `make sanitize-thread` this is the
// scenario that catches a read or write that bypasses the table's lock.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "runtime/launch/peer_table.hpp"

using shardflow::launch::PeerTable;
using namespace std::chrono_literals;

TEST_CASE("peer table: 8 nodes, the heartbeat thread beats, loses and readmits them while the launcher's thread decides and waits — every node settles") {
  PeerTable t;
  const int nodes = 8;
  const auto t0 = PeerTable::clock::now();
  t.reset(nodes, t0);
  std::atomic<bool> done{false};
  // The heartbeat thread: neighbouring nodes' flags change at once (a vector<bool> would share a word).
  std::thread heartbeat([&] {
    for (int round = 0; round < 2000; ++round)
      for (int k = 1; k < nodes; ++k) {
        const auto now = t0 + std::chrono::milliseconds(round);
        if (t.beat(k, round % 3 == 0 ? round : round - 1, now) > 2ms) t.mark_lost(k);
        if (round % 7 == k) t.readmit(k, now);
      }
    for (int k = 1; k < nodes; ++k) (k % 2 ? t.mark_exited(k) : t.mark_lost(k));
    done = true;
  });
  // The launcher's thread: decides from the same facts meanwhile, as NodeWatch::decide does. A pass
  // at least: how many of them overlap the heartbeat thread's writes is the scheduler's choice (on
  // a fast machine the 2,000 rounds may end before the first pass), and ThreadSanitizer checks
  // whichever do. Counting the flags that were set measured nothing but that race.
  std::size_t passes = 0;
  do {
    for (int k = 1; k < nodes; ++k) (void)(t.lost(k) + t.exited(k) + t.watched(k));
    ++passes;
  } while (!done);
  std::vector<int> members;
  for (int k = 0; k < nodes; ++k) members.push_back(k);
  t.wait_settled(members, 10s);
  heartbeat.join();
  for (int k = 1; k < nodes; ++k) {
    CHECK_FALSE(t.watched(k));
    CHECK(t.exited(k) == (k % 2 == 1));
  }
  INFO(passes << " pass(es) over the table while the heartbeat thread ran");
  // A node that asks to come back is lost until readmitted, then watched afresh.
  t.rejoining(2);
  CHECK(t.lost(2));
  t.readmit(2, t0);
  CHECK(t.watched(2));
  CHECK(t.beat(2, 5, t0 + 1s) == 0ms);  // its first beat counts as movement
  CHECK_THROWS(t.lost(nodes));          // no such node: an error, not a read past the end
}

// Note [A stall is nobody's silence] (runtime/launch/node_watch.cpp)
TEST_CASE("peer table: a store stall this node's own beats went through is nobody's silence — a live peer is not lost for it, a "
          "dead one still is, that much later") {
  PeerTable t;
  const auto t0 = PeerTable::clock::now();
  t.reset(3, t0);
  CHECK(t.beat(1, 10, t0) == 0ms);  // node 1 alive, node 2 dead from the start
  CHECK(t.beat(2, 20, t0) == 0ms);
  // Every write held up 2.5 s (an election): at 3.4 s neither count has moved.
  t.excuse(2500ms, t0 + 3400ms);
  CHECK(t.beat(1, 10, t0 + 3400ms) == 900ms);  // 3.4 s less the stall: below a 3 s timeout
  CHECK(t.beat(2, 20, t0 + 3400ms) == 900ms);
  CHECK(t.beat(1, 11, t0 + 4400ms) == 0ms);    // node 1's beats land again
  CHECK(t.beat(2, 20, t0 + 5600ms) == 3100ms);  // node 2 is lost after all, 2.5 s later than without the stall
  // Never into the future, and a lost or exited node is left as it is.
  t.mark_lost(2);
  t.excuse(1h, t0 + 6s);
  CHECK(t.beat(1, 11, t0 + 6s) == 0ms);
  t.readmit(2, t0 + 6s);
  CHECK(t.beat(2, 21, t0 + 6s) == 0ms);
  t.excuse(-1s, t0 + 7s);  // no stall: nothing changes
  CHECK(t.beat(2, 21, t0 + 7s) == 1000ms);
}
