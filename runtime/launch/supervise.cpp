// The supervisor's ranks (supervisor.hpp): their processes started, reaped, signalled and
// watched, and the loop that waits on them, the signals and the other nodes (Note [Launcher
// supervision], launcher.hpp).
#include <fcntl.h>
#include <poll.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>

#include "runtime/launch/rank_process.hpp"
#include "runtime/launch/supervisor.hpp"
#include "shardflow/errors.hpp"

namespace shardflow::launch {

// Polled during the rendezvous, before any rank exists: Ctrl-C must not wait for the deadline.
bool Supervisor::interrupted_by_signal() {
  signalfd_siginfo si{};
  while (::read(sigfd_, &si, sizeof(si)) == ssize_t(sizeof(si)))
    if (si.ssi_signo != SIGCHLD) interrupted_ = int(si.ssi_signo);
  return interrupted_ != 0;
}

void Supervisor::spawn(Rank& r, int node, int world, int port, const std::string& token, const sigset_t& old_mask) {
  const auto env = rank_environment(spec_, socket_, {r.global, r.local, world, store_at_, port, token, restart_, spec_.max_restarts,
                                                       snapshot_memory_ ? snapshot_memory_->path() : std::string(), mirror_label_,
                                                       node, torch_port(port), round_no_});
  const RankProcess p = start_rank_process(spec_.command, env, old_mask);
  r.pid = p.pid;
  r.running = true;
  r.out_fd = p.out_fd;
  r.err_fd = p.err_fd;
  const std::string prefix = spec_.prefix_output ? "[rank " + std::to_string(r.global) + "] " : "";
  r.out = std::make_unique<OutputRelay>(STDOUT_FILENO, prefix);
  r.err = std::make_unique<OutputRelay>(STDERR_FILENO, prefix);
}

void Supervisor::signal_all(int sig) {
  for (auto& r : ranks_)
    if (r.running) ::kill(-r.pid, sig);
}

// Stops the job: SIGTERM now, SIGKILL once the grace period has passed.
void Supervisor::begin_stop(int sig) {
  if (stop_deadline_) return;
  signal_all(sig);
  stop_deadline_ = clock::now() + spec_.kill_grace;
}

void Supervisor::reap() {
  std::vector<Rank*> lost;  // to recover in place once the loop is done: a replacement adds to ranks_
  for (;;) {
    int status = 0;
    // Stops too: a stopped rank hangs its peers until they time out, and the peer that times out
    // first is not the one to blame, so the verdict names the stopped rank as the likely cause.
    const pid_t pid = ::waitpid(-1, &status, WNOHANG | WUNTRACED | WCONTINUED);
    if (pid <= 0) break;
    for (auto& r : ranks_) {
      if (r.pid != pid) continue;
      if (WIFSTOPPED(status)) {
        r.stopped_by = WSTOPSIG(status);
        r.stopped_since = clock::now();
        say("rank " + std::to_string(r.global) + " (pid " + std::to_string(pid) + ") was stopped by SIG" +
            sigabbrev_np(r.stopped_by) + (in_place() ? "; it counts as lost if still stopped after --heartbeat-timeout"
                                                     : "; its peers wait for it until their timeout"));
        continue;
      }
      if (WIFCONTINUED(status)) {
        r.stopped_by = 0;
        r.stopped_since.reset();
        continue;
      }
      r.running = false;
      r.status = status;
      r.signal_ours = WIFSIGNALED(status) && stop_deadline_ &&
                      (WTERMSIG(status) == SIGTERM || (WTERMSIG(status) == SIGKILL && killed_));
      const bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
      const bool refused = failed && round_refused();
      if (failed && !refused && can_recover_in_place()) {
        lost.push_back(&r);
        continue;
      }
      if (failed)
        rank_failed(r, refused ? "; it refused to go on from round " + std::to_string(refused_round_) +
                                     " (nothing to go back to: see its message), so that round counts as no restart"
                               : "");
      // The rank's group may still hold children of its own; they go with it.
      if (stop_deadline_) ::kill(-pid, SIGKILL);
    }
  }
  if (!lost.empty()) recover_in_place(lost);
}

// A rank's failure that is not recovered in place ends the generation: every rank of every node
// stops (and restarts, if restarts are left). `why_not`: why it was not recovered in place, if it could have been.
void Supervisor::rank_failed(Rank& r, const std::string& why_not) {
  if (first_failure_ || interrupted_ || peer_failure_) return;
  if (round_) fail_round();  // lost while a round was open: the round did not heal the job
  first_failure_ = r.global;
  say("rank " + std::to_string(r.global) + " (pid " + std::to_string(r.pid) + ") " + describe_status(r.status) + why_not +
      "; stopping the other rank(s)");
  begin_stop(SIGTERM);
  if (watch_) {
    const std::string mine = "rank " + std::to_string(r.global) + " (local rank " + std::to_string(r.local) + ", pid " +
                             std::to_string(r.pid) + ") " + describe_status(r.status);
    const auto first = watch_->report_failure(mine);
    if (!first)
      store_lost_ = watch_->label(0) + "'s store is unreachable too: node 0 is likely down and this rank's failure its echo";
    else if (first->find(mine) == std::string::npos)
      peer_failure_ = *first;  // another node failed first: the likelier cause
  }
}

// A rank stopped (SIGSTOP) for longer than --heartbeat-timeout counts as lost: killed, it is
// recovered like any other (its peers would otherwise wait for it until their own timeout).
void Supervisor::kill_long_stopped() {
  if (!in_place()) return;
  for (auto& r : ranks_)
    if (r.running && r.stopped_since && clock::now() - *r.stopped_since > spec_.heartbeat_timeout) {
      say("rank " + std::to_string(r.global) + " (pid " + std::to_string(r.pid) + ") has been stopped for longer than "
          "--heartbeat-timeout: killing it, it counts as lost");
      r.stopped_since.reset();
      ::kill(-r.pid, SIGKILL);
      ::kill(-r.pid, SIGCONT);
    }
}

void Supervisor::on_signal() {
  signalfd_siginfo si{};
  while (::read(sigfd_, &si, sizeof(si)) == ssize_t(sizeof(si))) {
    const int sig = int(si.ssi_signo);
    if (sig == SIGCHLD) {
      reap();
      continue;
    }
    if (interrupted_) {  // a second Ctrl-C: no more patience
      say("second " + std::string(sigabbrev_np(sig)) + ": killing every rank");
      signal_all(SIGKILL);
      continue;
    }
    interrupted_ = sig;
    say("got SIG" + std::string(sigabbrev_np(sig)) + ": forwarding it to every rank");
    signal_all(sig);
    stop_deadline_ = clock::now() + spec_.kill_grace;
  }
}

// Another node failed or vanished (Note [Failures cross hosts]): this node's ranks go too.
void Supervisor::on_peer_failure() {
  std::uint64_t count;
  [[maybe_unused]] auto r = ::read(watch_->event_fd(), &count, sizeof count);
  for (const auto& [node, what] : watch_->take_lost()) recover_lost_node(node, what);
  if (peer_failure_ || first_failure_ || interrupted_) return;
  peer_failure_ = watch_->peer_failure();
  if (!peer_failure_) return;
  say(*peer_failure_ + "; stopping this node's rank(s)");
  begin_stop(SIGTERM);
}

bool Supervisor::any_running() const {
  for (const auto& r : ranks_)
    if (r.running) return true;
  return false;
}

void Supervisor::supervise() {
  // Non-blocking signal reads: on_signal drains every queued signal.
  ::fcntl(sigfd_, F_SETFL, ::fcntl(sigfd_, F_GETFL) | O_NONBLOCK);
  char buf[65536];
  std::optional<clock::time_point> drain_until;
  for (;;) {
    std::vector<pollfd> fds{{sigfd_, POLLIN, 0}, {watch_ ? watch_->event_fd() : -1, POLLIN, 0}};
    std::vector<std::pair<int*, OutputRelay*>> pipes;
    for (auto& r : ranks_) {
      for (auto [fd, relay] : {std::pair{&r.out_fd, r.out.get()}, std::pair{&r.err_fd, r.err.get()}})
        if (*fd >= 0) {
          fds.push_back({*fd, POLLIN, 0});
          pipes.emplace_back(fd, relay);
        }
    }
    // A held word with ranks of this node to start again once it is out (Note [Copies gathered
    // before the word]): their node has none running meanwhile, and must not end.
    const bool running = any_running() || (held_word_ && !held_word_->again.empty());
    if (!running && pipes.empty()) {
      check_round_at_end();
      learn_rounds();  // a round its ranks went through in the last 200 ms: said all the same
      return;
    }
    if (!running && !drain_until) drain_until = clock::now() + std::chrono::seconds(2);
    if (drain_until && clock::now() >= *drain_until) {  // a grandchild holds a pipe open: let it be
      check_round_at_end();
      break;
    }
    // While this node runs a round its steps wait on the store (the ranks parked, the other nodes
    // ready): polled every 200 ms, each wait cost up to that, and a join has two (0.28-0.44 s for
    // a round across two netns hosts). During a round the store is asked every 20 ms instead.
    int wait_ms = round_ || grow_round_ || held_word_ ? 20 : 200;
    if (stop_deadline_ && running) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(*stop_deadline_ - clock::now()).count();
      if (left <= 0) {
        if (!killed_) say("grace period over: killing the remaining rank(s)");
        killed_ = true;
        signal_all(SIGKILL);
      }
      wait_ms = int(std::clamp<long>(left, 10, 200));
    }
    const int n = ::poll(fds.data(), fds.size(), wait_ms);
    if (n < 0 && errno != EINTR) throw Error("poll: " + std::string(std::strerror(errno)));
    check_round();
    check_held_word();
    check_grow_round();
    kill_long_stopped();
    if (clock::now() - learned_at_ > std::chrono::milliseconds(200)) {
      learned_at_ = clock::now();
      learn_rounds();
      look_for_joiners();
    }
    if (n <= 0) {
      reap();  // belt and braces: SIGCHLDs coalesce
      continue;
    }
    if (fds[0].revents) on_signal();
    if (fds[1].revents) on_peer_failure();
    for (std::size_t i = 2; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      auto [fd, relay] = pipes[i - 2];
      const ssize_t got = ::read(*fd, buf, sizeof(buf));
      if (got > 0) {
        relay->feed(buf, std::size_t(got));
      } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
        relay->flush();
        ::close(*fd);
        *fd = -1;
      }
    }
  }
  for (auto& r : ranks_) {
    r.out->flush();
    r.err->flush();
  }
}

}  // namespace shardflow::launch
