// The supervisor's rounds of in-place recovery (supervisor.hpp): a lost rank healed while the
// others keep their processes, the round's verdict in the store, and other nodes' rounds learned.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "runtime/bootstrap/etcd_names.hpp"
#include "runtime/bootstrap/snapshot_env.hpp"
#include "runtime/comm/shm_names.hpp"
#include "runtime/launch/rank_process.hpp"
#include "runtime/launch/supervisor.hpp"
#include "shardflow/errors.hpp"

namespace shardflow::launch {

// ---- Note [Recovering in place] --------------------------------------------------------------
// With --recovery in-place a lost rank (its process exited non-zero or died, or stayed stopped
// for longer than --heartbeat-timeout) is not the end of the generation: its process starts
// again in the generation's next round, the surviving ranks (which see their collectives fail)
// are told so through the store ("g<k>/recovery/<round>": "in-place: ...", the new world and
// each rank's new number) and join it there (rejoin_process_group, Runtime::recover). With
// --recovery shrink nothing starts: the survivors are numbered afresh in their order and go on
// at the smaller world (the output's "[rank N]" follows). The round is over once every rank made the round's
// group ("g<k>/r<round>/joined" counts them). A rank lost while a round is still open, or a
// round not over within --rdzv-timeout, ends the generation as without in-place recovery: every
// rank stops, and the job restarts if restarts are left. Each round that heals counts as one
// restart; one that does not is replaced by the restart it ends in.
//
// ---- Note [Rounds across nodes] ----------------------------------------------------------------
// Across nodes the launcher of the node whose rank was lost runs the round; the other nodes'
// launchers see nothing (their ranks keep running and rejoin through the shared store, and no
// node failure is reported). Rounds are numbered in the store, not by each launcher: a launcher
// claims round r by counting "g<k>/rounds" up to r, and holds it only if round r - 1 is over: every
// rank of the world made its group ("g<k>/r<round>/joined", which the ranks count themselves, so
// a loss right after a round may claim the next one before the holder's launcher polled). Two
// nodes that lose a rank at once cannot both hold a round (the survivors would wait in one while
// the other's lost rank never joins it): the one that does not hold it fails the generation as
// without in-place recovery, and every rank of every node stops and restarts. The rounds over are
// the generation's recoveries, every node's: --max-restarts bounds them all together. A
// shrinking round renumbers every node's ranks: the other nodes' launchers learn it from the
// round's verdict in the store (learn_rounds), for their output prefixes and their own next rounds.
bool Supervisor::can_recover_in_place() {
  return in_place() && !round_ && !first_failure_ && !peer_failure_ && !interrupted_ && !stop_deadline_ &&
         restart_ + recoveries() < spec_.max_restarts;
}

// In-place recoveries over the whole job, every node's (this node's open round included): each
// counts as a restart. Across nodes the store says which of the generation's rounds are over;
// unreachable, this node's own count stands in (the restart that follows cannot reach it either).
int Supervisor::recoveries() {
  const bool healing = round_ && !round_->grow;  // Note [A node joins live]: taking a node in uses no restart
  int in_generation = rounds_healed_ + (healing ? 1 : 0);
  if (in_place() && spec_.nnodes > 1) {
    try {
      auto& st = recovery_store();
      const int claimed = int(st.add(round_key("rounds"), 0));
      int over = 0;
      for (int j = 1; j <= claimed; ++j)
        over += (healing && j == round_no_) ||
                (!(round_ && j == round_no_) && !grew(st, j) && round_over(st, j) && !st.check({recovery_verdict::refused_key(restart_, j)}));
      in_generation = over;
    } catch (const Error&) {
    }
  }
  recoveries_seen_ = recoveries_before_ + in_generation;
  return recoveries_seen_;
}

// Note [Rounds across nodes]: round j is over once every rank of its world joined it: the world
// its word says (a shrink's is smaller than the one before, a growing round's larger), else the
// world now.
bool Supervisor::round_over(Store& st, int j) {
  if (j < 1) return true;
  int world = generation_.world;
  if (const auto key = recovery_verdict::key(restart_, j); st.check({key}))
    if (const auto v = recovery_verdict::parse(st.get(key))) world = v->world;
  return st.add(recovery_verdict::joined_key(restart_, j), 0) >= world;
}

// Note [Rounds across nodes]: the next round's number, or 0 when another node's round is still
// open or the store cannot be reached, with why in `why_not`.
int Supervisor::claim_round(std::string& why_not) {
  try {
    auto& st = recovery_store();
    const int r = int(st.add(round_key("rounds"), 1));
    if (round_over(st, r - 1)) return r;
    why_not = "; not recovered in place: round " + std::to_string(r - 1) + " of another node's recovery is still open";
  } catch (const Error& e) {
    why_not = "; not recovered in place: the store could not be reached (" + std::string(e.what()) + ")";
  }
  return 0;
}

Store& Supervisor::recovery_store() {
  // Cut off from etcd, every call would spend its whole timeout (10 s) before failing as this.
  if (watch_ && watch_->cut_off()) throw CommError("the store is unreachable from this node (cut off)");
  if (!recovery_store_) {
    StoreRendezvous where;
    where.store_host = store_at_;
    where.store_port = std::uint16_t(generation_.port);
    where.token = generation_.token;
    where.etcd_endpoints = spec_.etcd_endpoints;
    where.etcd_root = etcd::root_for(spec_.rdzv_id);
    // Polled from the supervising loop (learn_rounds, every 200 ms): a call must not hold that
    // loop past what a heartbeat may take, or a node cut off from etcd hears of its own heartbeat's
    // failure only after it (the soak's cut host: 10 s). Enough for an etcd election either way.
    where.timeout = std::clamp<std::chrono::milliseconds>(spec_.heartbeat_timeout, std::chrono::seconds(2), std::chrono::seconds(10));
    recovery_store_ = connect_store(where);
  }
  return *recovery_store_;
}

std::string Supervisor::round_key(const std::string& what) const {
  return "g" + std::to_string(restart_) + "/" + what;
}

// Shrinking: this node's surviving ranks take their numbers in round `round`'s world (-1: lost),
// their output prefix follows. One node: the local rank is the rank; across nodes a rank's local
// rank (its LOCAL_RANK, its device) stays.
void Supervisor::renumber(const std::vector<int>& next, int world, int round) {
  std::string moved;
  for (auto& r : ranks_) {
    // A rank that already finished went through the round too (learnt after the job's end).
    if (r.replaced || r.global >= int(next.size())) continue;
    const int n = next[std::size_t(r.global)];
    if (n < 0 || n == r.global) continue;
    moved += (moved.empty() ? "" : ", ") + std::to_string(r.global) + " -> " + std::to_string(n);
    if (spec_.prefix_output) {
      r.out->set_prefix("[rank " + std::to_string(n) + "] ");
      r.err->set_prefix("[rank " + std::to_string(n) + "] ");
    }
    r.global = n;
    if (spec_.nnodes == 1) r.local = n;
  }
  const bool grew = world > generation_.world;
  generation_.world = world;
  if (spec_.nnodes > 1 && !moved.empty())
    say("round " + std::to_string(round) + (grew ? " grew" : " shrank") + " the world to " + std::to_string(world) + ": this node's rank(s) " + moved);
}

// Note [Rounds across nodes]: another node's shrinking round renumbers this node's ranks too,
// and a lost host's round takes that node out here first (Note [A lost host healed in place]);
// polled while supervising (every 200 ms at most), and before this node claims a round of its own.
void Supervisor::learn_rounds() {
  if (!in_place() || spec_.nnodes == 1 || round_ || store_silent_ || first_failure_ || peer_failure_ || stop_deadline_) return;
  try {
    auto& st = recovery_store();
    const int claimed = int(st.add(round_key("rounds"), 0));
    while (learned_round_ < claimed) {
      const int j = learned_round_ + 1;
      const std::string key = recovery_verdict::key(restart_, j);
      if (!st.check({key})) {  // claimed, its word not out yet (or a claim that failed: the generation ends)
        // Note [A node joins live], steps 1 and 3 on the other nodes.
        if (grew(st, j)) {
          if (grow_flag_round_ != j) {
            grow_flag_round_ = j;
            ask_regroup(true);
          }
          if (grown_in_round_ != j && st.check({recovery_verdict::members_key(restart_, j)})) {
            grown_in_round_ = j;
            ask_regroup(false);
            take_in(std::stoi(st.get(recovery_verdict::grow_node_key(restart_, j))), recovery_verdict::parse_nodes(st.get(recovery_verdict::members_key(restart_, j))),
                    joins_from_memory());
            say_ready(j);
          }
          return;
        }
        // Note [A lost host healed in place], step 2: another node runs a lost host's round.
        if (left_out_in_round_ != j && st.check({recovery_verdict::lost_node_key(restart_, j)})) {
          left_out_in_round_ = j;
          const int node = std::stoi(st.get(recovery_verdict::lost_node_key(restart_, j)));
          if (node == spec_.node_rank) {  // found lost while it was silent (stopped, cut off): the others went on
            left_out_ = true;
            peer_failure_ = "this node was found lost by the others and left out of the job in round " + std::to_string(j) +
                            " (a launcher started again here is taken in again: Note [A node joins live])";
            say(*peer_failure_ + "; stopping this node's rank(s)");
            begin_stop(SIGTERM);
            return;
          }
          leave_out(node);
          st.set(recovery_verdict::ready_key(restart_, j, spec_.node_rank), "1");
        }
        // Note [Copies gathered before the word]: another node's lost rank.
        if (gathered_in_round_ != j && st.check({recovery_verdict::gather_key(restart_, j)})) {
          gathered_in_round_ = j;
          gather_newest(mirror_addresses());
          st.set(recovery_verdict::ready_key(restart_, j, spec_.node_rank), "1");
        }
        return;
      }
      const auto v = recovery_verdict::parse(st.get(key));
      ++learned_round_;
      if (v) renumber(v->next, v->world, learned_round_);
    }
  } catch (const Error&) {
    // The store unreachable: the ranks' own rejoin fails too, and the generation ends. Not asked
    // again, so that a store whose host is gone does not hold the output's relay at every poll.
    store_silent_ = true;
  }
}

void Supervisor::recover_in_place(const std::vector<Rank*>& lost) {
  // This node's survivors (across nodes the other nodes' ranks survive too).
  const bool none_alive = std::none_of(ranks_.begin(), ranks_.end(), [&](const Rank& r) {
    return r.running && !r.replaced && std::find(lost.begin(), lost.end(), &r) == lost.end();
  });
  // Across nodes a shrink keeps every node in the job: a node whose every rank was lost starts
  // them again instead (a node without ranks would leave, and with it the copies of the other
  // hosts' snapshots it holds, Note [Snapshots on the other host]).
  const bool emptied = spec_.nnodes > 1 && none_alive;
  const bool shrink = spec_.recovery == "shrink" && !emptied;
  std::string who, pids;
  for (const Rank* r : lost) {
    who += (who.empty() ? "" : "; ") + ("rank " + std::to_string(r->global) + " (pid " + std::to_string(r->pid) + ") " +
                                        describe_status(r->status));
    pids += (pids.empty() ? "" : ", ") + std::to_string(r->global);
  }
  if (none_alive && spec_.nnodes == 1) {  // nobody to go on: the generation ends as without in-place recovery
    first_failure_ = lost.front()->global;
    say(who + "; no rank is left to go on in place");
    begin_stop(SIGTERM);
    return;
  }
  learn_rounds();  // the ranks' numbers now, if another node shrank the world
  std::string why_not;
  const int claimed = claim_round(why_not);
  if (!claimed) {
    for (Rank* r : lost) {
      rank_failed(*r, why_not);
      ::kill(-r->pid, SIGKILL);  // what its process group still holds
    }
    return;
  }
  round_no_ = claimed;
  learned_round_ = claimed;
  round_ = RecoveryRound{clock::now(), who};
  const std::string round = "round " + std::to_string(round_no_) + ", " + std::to_string(restart_ + recoveries()) + " of " +
                            std::to_string(spec_.max_restarts) + " restarts";
  // Shrinking, the survivors (every node's) are numbered afresh in their order; replacing, every
  // rank keeps its number.
  std::vector<int> next(std::size_t(generation_.world));
  int world = 0;
  for (int g = 0; g < generation_.world; ++g) {
    const bool gone = std::any_of(lost.begin(), lost.end(), [&](const Rank* r) { return r->global == g; });
    next[std::size_t(g)] = shrink && gone ? -1 : shrink ? world++ : g;
  }
  if (!shrink) world = generation_.world;
  say(who + "; recovering in place (" + round + "): the other ranks keep running" +
      (shrink ? ", at world " + std::to_string(world) + " from now on"
              : ", rank(s) " + pids + " start again" +
                    (spec_.recovery == "shrink" ? " (a shrink would leave this node without a rank)" : "")));
  std::vector<long> dead;
  for (Rank* r : lost) {
    ::kill(-r->pid, SIGKILL);  // what its process group still holds
    r->replaced = true;
    dead.push_back(r->pid);
  }
  shm::remove_segments_of(dead);
  HeldWord held{{who + (shrink ? "; going on without it" : "; started again"), world, next}, {}, clock::now() + spec_.rdzv_timeout, {}};
  if (!shrink)
    for (const Rank* r : lost) held.again.emplace_back(r->global, r->local);
  if (gathers_copies()) {  // Note [Copies gathered before the word]
    try {
      recovery_store().set(recovery_verdict::gather_key(restart_, round_no_), "1");
    } catch (const Error& e) {
      cannot_tell(e);
      return;
    }
    gather_newest(mirror_addresses());
    hold_word(std::move(held));
    return;
  }
  if (!publish_verdict(held.verdict)) return;
  renumber(held.verdict.next, held.verdict.world, round_no_);
  start_again(held.again);
}

// ---- Note [A round that did not heal] ------------------------------------------------------------
// A round is over once every rank joined it, and then counts as one restart. But a survivor may
// refuse to go on from it after joining: recover() finds no snapshot to go back to while its
// parameters moved since the start (Runtime::recover). Every survivor then exits, and with that
// round counted, --max-restarts 1 left no restart for them: the job failed where one restart of
// every rank would have carried it (scripts/soak.py found it, a host lost before the first
// snapshot). The refusing rank leaves snapshot_env::kRefused in its host's memory; its launcher,
// seeing a rank fail with it there, posts recovery_verdict::refused_key for the newest round
// (every node's count leaves that round out) and ends the generation instead of running another
// round, which would be refused alike: every rank restarts once, from a snapshot or the start.
bool Supervisor::round_refused() {
  if (!take_memory_file(snapshot_env::kRefused)) return false;
  // The round its survivors joined: the newest claimed. Another node's round may not be learned
  // here yet (learn_rounds polls every 200 ms, and a refusal comes at once).
  int round = learned_round_;
  if (spec_.nnodes > 1) {
    try {
      round = std::max(round, int(recovery_store().add(round_key("rounds"), 0)));
    } catch (const Error&) {
    }
  }
  if (round == 0) return false;
  if (refused_round_ == round) return true;  // another survivor of the same round
  refused_round_ = round;
  // Counted here once it was over (check_round); a round still open is not counted, and ends as
  // any failure inside it does (rank_failed: fail_round).
  if (!round_ && rounds_healed_ > 0) --rounds_healed_;
  if (spec_.nnodes > 1) {
    try {
      recovery_store().set(recovery_verdict::refused_key(restart_, refused_round_), "1");
    } catch (const Error&) {
      // The store unreachable: the generation ends anyway, and the restart cannot reach it either.
    }
  }
  return true;
}

// ---- Note [Copies gathered before the word] ------------------------------------------------------
// With three or more nodes a host's memory holds its own snapshot files and its predecessor's
// (Note [Snapshots on the other host]), not the newest snapshot whole, and the ranks load one from
// memory only when every host holds it whole (Note [Snapshots in memory]). A restart and a lost
// host's round gather it first; a lost rank's round did not, so at three nodes its survivors went
// back to the newest snapshot on disk (scripts/soak.py --hosts 3 found it: steps done again that
// memory held). Now the node that runs the round posts recovery_verdict::gather_key, fetches what
// its host lacks, and holds the word until every other node did the same and said it is ready
// (learn_rounds). The survivors are waiting for the word in rejoin_process_group meanwhile, so no
// newer snapshot can begin. With two nodes each host holds every file already, and ranks that keep no
// snapshots in memory (snapshot_env::kInUse) have nothing to gather: nothing is held then. After
// a join from memory (Note [A join from memory]) the newcomer's host may hold only the newest
// snapshot's index, so two nodes gather too.
bool Supervisor::gathers_copies() const {
  return mirror_ && spec_.nnodes > 1 && (members_.size() >= 3 || partial_copies_) && keeps_snapshots_in_memory();
}

std::filesystem::path Supervisor::memory_file(const char* name) const {
  if (!snapshot_memory_ || snapshot_memory_->path().empty()) return {};
  return std::filesystem::path(snapshot_memory_->path()) / name;
}

bool Supervisor::take_memory_file(const char* name) const {
  const auto file = memory_file(name);
  std::error_code ec;
  return !file.empty() && std::filesystem::remove(file, ec);
}

bool Supervisor::keeps_snapshots_in_memory() const {
  std::error_code ec;
  const auto in_use = memory_file(snapshot_env::kInUse);
  return !in_use.empty() && std::filesystem::exists(in_use, ec);
}

// The word of a round run here goes out once every other node says it holds the newest snapshot
// whole (polled by supervise() through check_held_word; past --rdzv-timeout the round fails,
// naming who did not).
void Supervisor::hold_word(HeldWord held) {
  for (int k : members_)
    if (k != spec_.node_rank) held.waiting.push_back(k);
  held_word_ = std::move(held);
  check_held_word();
}

void Supervisor::check_held_word() {
  if (!held_word_) return;
  if (!all_ready(held_word_->waiting, held_word_->deadline, "did not fetch the newest snapshot")) return;
  const HeldWord held = std::move(*held_word_);
  held_word_.reset();
  if (!publish_verdict(held.verdict)) return;
  renumber(held.verdict.next, held.verdict.world, round_no_);
  start_again(held.again);
}

// A replacing round's lost ranks of this node, started again once its word is out.
void Supervisor::start_again(const std::vector<std::pair<int, int>>& again) {
  for (const auto& [global, local] : again) {
    auto& r = ranks_.emplace_back();
    r.global = global;
    r.local = local;
    spawn(r, generation_.node, generation_.world, generation_.port, generation_.token, generation_.mask);
    say("started rank " + std::to_string(r.global) + " (pid " + std::to_string(r.pid) + ") again in round " + std::to_string(round_no_));
  }
}

// The nodes of this node's round that said they are ready (recovery_verdict::ready_key) leave
// `waiting`. True once none is left; false while some are and `deadline` has not passed; past it
// the round ends (and with it the struct `waiting` lives in), naming who `missed` it.
bool Supervisor::all_ready(std::vector<int>& waiting, clock::time_point deadline, const std::string& missed) {
  try {
    auto& st = recovery_store();
    waiting.erase(std::remove_if(waiting.begin(), waiting.end(),
                                 [&](int k) { return st.check({recovery_verdict::ready_key(restart_, round_no_, k)}); }),
                  waiting.end());
  } catch (const Error& e) {
    cannot_tell(e);
    return false;
  }
  if (waiting.empty()) return true;
  if (clock::now() < deadline) return false;
  std::string who;
  for (int k : waiting) who += (who.empty() ? "" : ", ") + watch_->label(k);
  end_round(who + " " + missed + " within --rdzv-timeout");
  return false;
}

// The round's word for the surviving ranks (Note [Recovering in place]); false when the store
// cannot take it: then the round has ended, and every rank restarts.
bool Supervisor::publish_verdict(const recovery_verdict::Verdict& v) {
  try {
    recovery_store().set(recovery_verdict::key(restart_, round_no_), recovery_verdict::format(v));
    return true;
  } catch (const Error& e) {
    cannot_tell(e);
    return false;
  }
}

void Supervisor::cannot_tell(const Error& e) {
  say("cannot tell the surviving ranks through the store (" + std::string(e.what()) + "); restarting every rank instead");
  end_round("the store could not be reached");
}

// Whether this host's launcher copies its snapshot files now, for ranks started with a copy to
// wait for (snapshot_env::kNoCopies).
void Supervisor::say_copies(bool on) {
  const auto flag = memory_file(snapshot_env::kNoCopies);
  if (flag.empty()) return;
  if (on) {
    take_memory_file(snapshot_env::kNoCopies);
  } else {
    std::ofstream(flag) << "the other host was lost: this launcher copies no snapshot files\n";
  }
}

// Every rank joined this node's round: it is over, said with how long it took.
void Supervisor::round_over_here() {
  const double s = std::chrono::duration<double>(clock::now() - round_->started).count();
  char took[32];
  std::snprintf(took, sizeof took, "%.2f", s);
  if (round_->grow) {
    say("grew in place: every rank joined round " + std::to_string(round_no_) + " at world " + std::to_string(generation_.world) + ", " +
        took + " s after " + round_->lost);
  } else {
    say("recovered in place: every rank joined round " + std::to_string(round_no_) + " " + took + " s after the loss");
    ++rounds_healed_;
  }
  round_.reset();
}

// How many ranks joined this node's round so far (each counts itself in the store once its
// round's group is made); throws what the store throws.
std::int64_t Supervisor::joined_round() { return recovery_store().add(recovery_verdict::joined_key(restart_, round_no_), 0); }

// Polled by supervise(): the round is over once every rank joined it; not over in time, the
// generation ends (the survivors are stopped and, restarts left, every rank starts again).
void Supervisor::check_round() {
  if (!round_ || grow_round_) return;
  std::int64_t joined = 0;
  try {
    joined = joined_round();
  } catch (const Error& e) {
    end_round(std::string("the store could not be read (") + e.what() + ")");
    return;
  }
  if (joined >= generation_.world) {
    round_over_here();
  } else if (clock::now() - round_->timed_from > spec_.rdzv_timeout) {
    end_round(std::to_string(joined) + " of " + std::to_string(generation_.world) + " ranks joined round " + std::to_string(round_no_) +
              " within --rdzv-timeout");
  } else {
    round_->joined = joined;
  }
}

// This node's ranks are done with the round still open (supervise's last poll): joins made since
// the poll before are counted (the ranks may finish within one poll of the last), and a round
// left open is said with its count rather than passed over in silence. Neither its timeout nor a
// store out of reach ends it here: with no rank left to stop, that would only fail the others.
void Supervisor::check_round_at_end() {
  if (!round_ || grow_round_ || first_failure_ || peer_failure_ || interrupted_) return;
  try {
    round_->joined = joined_round();
  } catch (const Error&) {
    // The store's host may be done too: the count of the last poll is said.
  }
  if (round_->joined >= generation_.world) return round_over_here();
  say("round " + std::to_string(round_no_) + " was still open when this node's ranks ended: " + std::to_string(round_->joined) + " of " +
      std::to_string(generation_.world) + " ranks had joined it");
}

// The round failed: the generation ends as a failure would end it without in-place recovery.
void Supervisor::end_round(const std::string& why) {
  if (!first_failure_ && !interrupted_ && !peer_failure_) {
    peer_failure_ = "recovering in place failed: " + why + " (after " + round_->lost + ")";
    say(*peer_failure_ + "; stopping every rank");
    begin_stop(SIGTERM);
    if (watch_) watch_->report_failure(*peer_failure_);  // the other nodes' ranks wait in the round too
  }
  fail_round();
}

// A round that did not heal the job does not count as a restart: the restart it ends in does
// (so that --max-restarts 1 still restarts every rank when, say, a trainer does not call recover).
void Supervisor::fail_round() {
  round_.reset();
  held_word_.reset();
  grow_round_.reset();
  ask_regroup(false);
}

}  // namespace shardflow::launch
