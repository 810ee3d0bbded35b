// The supervisor's round for a whole node lost (supervisor.hpp): the survivors heal in place
// without it.
#include <algorithm>

#include "runtime/bootstrap/snapshot_env.hpp"
#include "runtime/launch/supervisor.hpp"
#include "shardflow/errors.hpp"

namespace shardflow::launch {

// ---- Note [A lost host healed in place] --------------------------------------------------------
// With --recovery in-place or shrink and --nnodes MIN:MAX, a node found lost by its heartbeats
// (its host gone, its link down, its launcher killed) need not end the generation: the ranks of
// the nodes left keep their processes and go on at the smaller world in a round of their own, as
// after a shrinking round (its word counts the lost node's ranks lost and numbers the others
// afresh). Its ranks cannot start again anywhere, so --recovery in-place shrinks here too. The
// lost node leaves the generation, marked left: a launcher started again there is taken in
// again (Note [A node joins live]). The node that found it lost runs the round (node 0 with its
// TCP store; on etcd, where every node watches every other, the first to claim "lost/<node>"):
// 1. It claims the round and posts the lost node in it (recovery_verdict::lost_node_key).
// 2. Every node left takes the lost node out of its ring of snapshot copies and fetches what its
//    memory lacks of the newest snapshot from the others (a host holds its own and its
//    predecessor's files: the lost node's are on its successor only), then says it is ready.
//    With one node left it stops copying and tells its ranks (snapshot_env::kNoCopies), or each
//    would wait its collective timeout for copies at every snapshot.
// 3. Once every node left is ready, the round's word goes out: the survivors, waiting for it in
//    rejoin_process_group, reload that snapshot from their own host's memory at the new world.
// Elsewhere the generation fails as before, saying why: not elastic, too few nodes left, a world
// an earlier round shrank (the lost node's ranks carry numbers this launcher did not give), a
// round still open, no restart left, a node left not ready in time. Node 0's loss with its TCP
// store is no such case: the store is gone with it.
void Supervisor::recover_lost_node(int node, const std::string& what) {
  try {  // on etcd every node left finds it lost: one runs the round, the others learn it
    if (recovery_store().add(round_key("lost/" + std::to_string(node)), 1) != 1) return;
  } catch (const Error& e) {
    watch_->fail_lost(what + "; not recovered in place: the store could not be reached (" + e.what() + ")");
    return;
  }
  learn_rounds();  // the world now, if another node's round shrank it
  std::string why_not;
  const int left = int(members_.size()) - 1;
  if (!spec_.min_nnodes)
    why_not = "--nnodes is not elastic (MIN:MAX)";
  else if (left < spec_.min_nnodes)
    why_not = "only " + std::to_string(left) + " node(s) would be left, and --nnodes " + std::to_string(spec_.min_nnodes) + ":" +
              std::to_string(spec_.nnodes) + " needs at least " + std::to_string(spec_.min_nnodes);
  else if (generation_.world != int(members_.size()) * spec_.nproc_per_node)
    why_not = "an earlier round of this generation shrank the world";
  else if (round_)
    why_not = "round " + std::to_string(round_no_) + " of in-place recovery is still open";
  else if (!can_recover_in_place())
    why_not = restart_ + recoveries() >= spec_.max_restarts ? "no restart is left (--max-restarts " + std::to_string(spec_.max_restarts) + ")"
                                                            : "the job is stopping";
  const int claimed = why_not.empty() ? claim_round(why_not) : 0;
  if (!claimed) {
    watch_->fail_lost(what + (why_not.rfind("; ", 0) == 0 ? why_not : "; not recovered in place: " + why_not));
    return;
  }
  round_no_ = claimed;
  learned_round_ = claimed;
  round_ = RecoveryRound{clock::now(), what};
  const int index = int(std::find(members_.begin(), members_.end(), node) - members_.begin());
  HeldWord held{{what + "; going on without it", 0, std::vector<int>(std::size_t(generation_.world))}, {}, clock::now() + spec_.rdzv_timeout, {}};
  auto& v = held.verdict;
  for (int g = 0; g < generation_.world; ++g) v.next[std::size_t(g)] = g / spec_.nproc_per_node == index ? -1 : v.world++;
  say(what + "; recovering in place (round " + std::to_string(round_no_) + ", " + std::to_string(restart_ + recoveries()) + " of " +
      std::to_string(spec_.max_restarts) + " restarts): the ranks of the node(s) left keep running, at world " +
      std::to_string(v.world) + " from now on, without it");
  try {
    recovery_store().set(recovery_verdict::lost_node_key(restart_, round_no_), std::to_string(node));
  } catch (const Error& e) {
    end_round("the store could not be reached (" + std::string(e.what()) + ")");
    return;
  }
  leave_out(node);
  hold_word(std::move(held));
}

// Note [A lost host healed in place], step 2 on any node left: the ring of copies without the
// lost node, and the newest snapshot whole in this host's memory.
void Supervisor::leave_out(int node) {
  const std::vector<int> before = members_;
  members_.erase(std::remove(members_.begin(), members_.end(), node), members_.end());
  watch_->drop_member(node);
  point_mirror(before, true);
}

}  // namespace shardflow::launch
