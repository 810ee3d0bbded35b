// The supervisor's round for a node taken into a running generation (supervisor.hpp).
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "runtime/bootstrap/snapshot_env.hpp"
#include "runtime/launch/supervisor.hpp"
#include "shardflow/errors.hpp"

namespace shardflow::launch {

// ---- Note [A node joins live] ------------------------------------------------------------------
// A node left out (its host lost and healed in place, or left out at a restart) whose launcher is
// started again asks to join (Note [Rejoining]). Under --recovery in-place or shrink with --nnodes
// MIN:MAX the running generation takes it in without a restart, at a step boundary, losing no
// step: the survivors keep their processes, as when healing in place, and the world grows back.
// The node that sees the request first runs a round of its own (node 0 with its TCP store; on
// etcd the first to claim "grow/<node>"):
// 1. It claims the round, posts the node it takes in, and tells the ranks through their hosts'
//    memory (snapshot_env::kRegroup; the other nodes' launchers learn the round and do the same).
// 2. Rank 0 reads it at the next snapshot into memory, and its word goes with the save's id to
//    every rank: that snapshot completes at once, and each rank's iteration ends in the error an
//    in-place trainer answers with recover(rejoin_process_group(...)), where it says it is there.
// 3. Once every rank is, the node is told the round's nodes (launch/joined/<k>: "G R"), every
//    node points its ring of copies anew (the node before the newcomer seeds its memory with that
//    snapshot; with more than two nodes each fetches what its memory lacks), and says it is ready.
// 4. The round's word goes out: every rank keeps its node's place, the newcomer's ranks take
//    theirs (node by node, so two levels still pair up), and all of them load that snapshot.
// It uses no restart. Not taken in live, the node waits for the next restart, as before, and the
// launcher says why once: the ranks keep no snapshots in memory (snapshot_env::kInUse: none, or on
// disk only: no step to go on from at once), or an earlier round shrank the world by ranks rather
// than whole nodes. The ranks are waited for as long as the job runs; a node not ready within
// --rdzv-timeout after that (the newcomer lost again) ends the generation as a failed round does.
void Supervisor::look_for_joiners() {
  if (!in_place() || !spec_.min_nnodes || spec_.nnodes == 1 || !watch_ || round_ || store_silent_ || first_failure_ || peer_failure_ ||
      interrupted_ || stop_deadline_ || left_out_ || int(members_.size()) >= spec_.nnodes)
    return;
  std::vector<int> asking;
  try {
    asking = watch_->asking_to_join();
  } catch (const Error&) {
    return;  // the store: the heartbeats say what became of it
  }
  for (int k : asking) {
    std::string why_not;
    if (!keeps_snapshots_in_memory())
      why_not = "the ranks keep no snapshots in memory (none, or on disk only), so there is no step the job can go on from at once";
    else if (generation_.world != int(members_.size()) * spec_.nproc_per_node)
      why_not = "an earlier round of this generation shrank the world by ranks, not by whole nodes";
    if (!why_not.empty()) {
      if (std::find(refused_joins_.begin(), refused_joins_.end(), k) == refused_joins_.end()) {
        refused_joins_.push_back(k);
        say(watch_->label(k) + " asks to join; not taken in live: " + why_not + "; it joins at the next restart");
      }
      continue;
    }
    try {
      auto& st = recovery_store();
      if (!round_over(st, int(st.add(round_key("rounds"), 0)))) return;  // another node's round first: asked again later
      if (st.add(round_key("grow/" + std::to_string(k)), 1) != 1) continue;  // another node takes it in
    } catch (const Error&) {
      return;
    }
    learn_rounds();  // the world now, if another node's round changed it
    const int claimed = claim_round(why_not);
    if (!claimed) {
      say(watch_->label(k) + " asks to join; not taken in live" + why_not + "; it joins at the next restart");
      continue;
    }
    round_no_ = learned_round_ = claimed;
    const std::string what = watch_->label(k) + " asks to join";
    round_ = RecoveryRound{clock::now(), what, true};
    grow_round_ = GrowRound{k, what, members_, joins_from_memory(), false, {}, clock::now() + spec_.rdzv_timeout};
    try {
      recovery_store().set(recovery_verdict::grow_node_key(restart_, round_no_), std::to_string(k));
    } catch (const Error& e) {
      cannot_tell(e);
      return;
    }
    ask_regroup(true);
    say(what + ": taking it in (round " + std::to_string(round_no_) + "): the ranks go on at world " +
        std::to_string(int(members_.size() + 1) * spec_.nproc_per_node) + " from their next snapshot in memory, " +
        (grow_round_->from_memory ? "its ranks taking their part of the state from the running ranks' memory" : "which its ranks load"));
    return;  // one node a round
  }
}

// Steps 2-4 on the node that runs the round, polled by supervise().
void Supervisor::check_grow_round() {
  if (!grow_round_) return;
  auto& gr = *grow_round_;
  if (!gr.admitted) try {
      auto& st = recovery_store();
      // The ranks leave their iterations at their next snapshot in memory, however far off (no
      // deadline: giving up could strand a rank that already read the word; the job's end, or a
      // failure's restart, ends the round).
      if (st.add(recovery_verdict::parked_key(restart_, round_no_), 0) < generation_.world) return;
      std::vector<int> next = members_;
      next.push_back(gr.node);
      std::sort(next.begin(), next.end());
      st.set(recovery_verdict::members_key(restart_, round_no_), recovery_verdict::format_nodes(next));
      ask_regroup(false);
      // " memory": the newcomer's launcher fetches no snapshot for its ranks (Note [A join from memory]).
      take_in(gr.node, next, gr.from_memory, std::to_string(restart_) + " " + std::to_string(round_no_) + (gr.from_memory ? " memory" : ""));
      gr.admitted = true;
      for (int k : members_)
        if (k != spec_.node_rank) gr.waiting.push_back(k);
      gr.deadline = clock::now() + spec_.rdzv_timeout;
    } catch (const Error& e) {
      cannot_tell(e);
      return;
    }
  if (!all_ready(gr.waiting, gr.deadline, "did not get the newest snapshot")) return;
  // Every rank keeps its node's place in the new order; the newcomer's ranks take theirs.
  recovery_verdict::Verdict v{gr.what + "; taken in", int(members_.size()) * spec_.nproc_per_node,
                              std::vector<int>(std::size_t(generation_.world))};
  for (int g = 0; g < generation_.world; ++g) {
    const int node = gr.before[std::size_t(g / spec_.nproc_per_node)];
    const int at = int(std::find(members_.begin(), members_.end(), node) - members_.begin());
    v.next[std::size_t(g)] = at * spec_.nproc_per_node + g % spec_.nproc_per_node;
  }
  grow_round_.reset();
  round_->timed_from = clock::now();
  if (publish_verdict(v)) renumber(v.next, v.world, round_no_);
}

// Step 3 on any node of the round: the newcomer is in this node's generation and its ring of copies.
// Where its ranks get their state from the running ranks' memory (Note [A join from memory],
// runtime/checkpoint/twin_restore.cpp), no snapshot has to be whole anywhere for the join: the
// node before it sends it the newest snapshot's index only, and nobody fetches. A later round
// that needs the files there fetches them then (gather_newest: the index names them).
void Supervisor::take_in(int node, const std::vector<int>& next, bool from_memory, const std::string& joined) {
  const std::vector<int> before = members_;
  watch_->admit(node, joined);
  members_ = next;
  partial_copies_ |= from_memory;
  point_mirror(before, !from_memory, from_memory);
}

bool Supervisor::joins_from_memory() const {
  std::error_code ec;
  const auto said = memory_file(snapshot_env::kJoinFromMemory);
  return !said.empty() && std::filesystem::exists(said, ec);
}

void Supervisor::say_ready(int round) {
  try {
    recovery_store().set(recovery_verdict::ready_key(restart_, round, spec_.node_rank), "1");
  } catch (const Error&) {
    // The node that runs the round names this node when its deadline passes.
  }
}

// Step 1: whether the ranks of this host leave their iteration at their next snapshot in memory.
void Supervisor::ask_regroup(bool on) {
  const auto flag = memory_file(snapshot_env::kRegroup);
  if (flag.empty()) return;
  if (on)
    std::ofstream(flag) << "the launcher takes a node into the job: go on in its next round\n";
  else
    take_memory_file(snapshot_env::kRegroup);
}

}  // namespace shardflow::launch
