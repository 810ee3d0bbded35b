#include "actors/comm_stream_actor.hpp"

#include <caf/all.hpp>

#include <algorithm>

#include "runtime/process/fault_injection.hpp"
#include "shardflow/errors.hpp"

namespace shardflow {
namespace {

msg::Failure to_failure(const std::exception_ptr& e) {
  if (!e) return {};
  try {
    std::rethrow_exception(e);
  } catch (const TimeoutError& x) {
    return {msg::Failure::timeout, x.what()};
  } catch (const MismatchError& x) {
    return {msg::Failure::mismatch, x.what()};
  } catch (const UsageError& x) {
    return {msg::Failure::usage, x.what()};
  } catch (const std::exception& x) {
    return {msg::Failure::comm, x.what()};
  } catch (...) {
    return {msg::Failure::comm, "unknown failure in collective"};
  }
}

// Note [Reduced, straight to the shard]
// A reduction's completion tells the shard actor itself. It went through the bucket actor, which
// only passed it on: one more thread hand-over per bucket on the way from the link to the step,
// the runtime's own cost that bench_overhead measures (100 buckets). The bucket actor still hears,
// first, to clear its in-flight mark; its view is as before, so a trainer's report of the bucket's
// next gradients finds it as it did. The shard still takes one bucket's reductions in order: the
// next one goes out only after this iteration's sync of the bucket, which follows its step, which
// follows the shard's message. A failure goes to both; the shard's is the one that counts (the
// bucket actor passes nothing on when there is a shard).
//
// What the completion of entry e's op tells its actor. Completions run on the backend's stream
// thread: they only send a message. Ops of one entry complete in order, so the last one's
// completion stands for the entry; an earlier failure is reported at once (the iteration keeps
// the first failure it hears of). `on_complete` (reductions) runs first: a failure there (a CUDA
// cast, say) fails the bucket like a failed collective.
CollectiveDone completion_for(const CommStreamState& s, const ScheduledCollective& e, bool last,
                              std::shared_ptr<std::function<void()>> on_complete) {
  switch (e.kind) {
    case ScheduledCollective::reduce:
      // Note [Reduced, straight to the shard]
      return [owner = s.owners[e.bucket], shard = s.shard, b = e.bucket, on_complete, last](std::exception_ptr x) {
        if (!last && !x) return;  // a hook's phase of several ops: the last one stands for them
        if (!x && on_complete && *on_complete) try {
            (*on_complete)();
          } catch (...) {
            x = std::current_exception();
          }
        auto failure = to_failure(x);
        caf::anon_send(owner, msg::reduced_atom::value, b, failure);  // first: see the Note
        if (shard) caf::anon_send(shard, msg::reduced_atom::value, b, std::move(failure));
      };
    case ScheduledCollective::norm:
      return [shard = s.shard](std::exception_ptr x) { caf::anon_send(shard, msg::norm_done_atom::value, to_failure(x)); };
    case ScheduledCollective::buffers:
    case ScheduledCollective::unused:
      return [done = s.handed_done, kind = e.kind, shard = s.shard, last](std::exception_ptr x) {
        if (!last && !x) return;
        if (kind == ScheduledCollective::unused && shard) caf::anon_send(shard, msg::unused_known_atom::value, to_failure(x));
        done(kind, to_failure(x));
      };
    case ScheduledCollective::sync:
      if (s.twin_gathers)  // Note [Syncs from the twin, two levels]: the twin steps, then the gather
        return [shard = s.shard, b = e.bucket, last](std::exception_ptr x) {
          if (last || x) caf::anon_send(shard, msg::twin_shifted_atom::value, b, to_failure(x));
        };
      [[fallthrough]];
    default:
      if (s.fused && s.fused->fusion.fused(e.bucket))
        return [shard = s.shard, g = s.fused->fusion.group_of[e.bucket], last](std::exception_ptr x) {
          if (last || x) caf::anon_send(shard, msg::group_synced_atom::value, g, to_failure(x));
        };
      return [shard = s.shard, b = e.bucket, last](std::exception_ptr x) {
        if (last || x) caf::anon_send(shard, msg::broadcast_done_atom::value, b, to_failure(x));
      };
  }
}

}  // namespace

CommStreamState::~CommStreamState() {
  for (auto& t : trainer_ops)
    t.done(std::make_exception_ptr(CommError("trainer collective '" + t.op.tag + "': the runtime stopped before issuing it")));
}

namespace {

using comm_stream_self = msg::comm_stream_actor_t::stateful_pointer<CommStreamState>;

// Where each entry of the schedule sits, by bucket and by kind.
void index_schedule(CommStreamState& st, std::vector<ScheduledCollective> entries) {
  std::size_t buckets = 0;
  for (const auto& e : entries)
    if (e.kind == ScheduledCollective::reduce) ++buckets;
  st.reduce_entry.assign(buckets, 0);
  st.sync_entry.assign(buckets, ~0u);
  st.gather_entry.assign(buckets, ~0u);
  st.twin_gathers = false;
  for (std::uint32_t i = 0; i < entries.size(); ++i) {
    const auto& e = entries[i];
    if (e.kind == ScheduledCollective::reduce) {
      st.reduce_entry[e.bucket] = i;
      st.last_reduce_entry = i;
    } else if (e.kind == ScheduledCollective::sync) {
      st.sync_entry[e.bucket] = i;
    } else if (e.kind == ScheduledCollective::gather) {
      st.gather_entry[e.bucket] = i;
      st.twin_gathers = true;
    } else if (e.kind == ScheduledCollective::buffers || e.kind == ScheduledCollective::unused) {
      st.handed_entry[e.kind] = i;
    } else {
      st.norm_entry = i;
    }
  }
  st.owners.resize(buckets);
  st.collectives.resize(buckets);
  st.ready.assign(entries.size(), 0);
  st.ready_at.assign(entries.size(), -1);
  st.entries = std::move(entries);
}

// A comm hook's phase (Note [Comm hooks]) ends in its `then`, run on the backend's stream thread
// when the phase's last op completed: the next phase comes back here by message (hook_phase).
CollectiveDone then_next_phase(comm_stream_self self, const ScheduledCollective& e, std::shared_ptr<std::function<bool(CollectiveIssue&)>> then,
                               CollectiveDone finish) {
  return [me = msg::comm_stream_actor_t(caf::actor_cast<msg::comm_stream_actor_t>(self)), kind = std::uint8_t(e.kind), bucket = e.bucket, then,
          finish = std::move(finish)](std::exception_ptr x) {
    if (!x) try {
        CollectiveIssue next;
        if ((*then)(next)) {
          caf::anon_send(me, msg::hook_phase_atom::value, kind, bucket, true, std::move(next));
          return;
        }
      } catch (...) {
        x = std::current_exception();
      }
    finish(x);
    caf::anon_send(me, msg::hook_phase_atom::value, kind, bucket, false, CollectiveIssue{});
  };
}

// Note [Timeline]: the link figures (and the span, when tracing) end when completion is heard of.
CollectiveDone timed(const CommStreamState& s, const ScheduledCollective& e, const CollectiveOp& op, Timeline::Time ready, CollectiveDone inner) {
  CollectiveOp what;  // the op's description, without its buffers
  what.kind = op.kind;
  what.dtype = op.dtype;
  what.count = op.count;
  what.distance = op.distance;  // a shift's: one by a multiple of the world puts nothing on the link (wire_bytes)
  what.recv_count = op.recv_count;
  if (s.log->tracing()) what.tag = op.tag;
  const bool syncs = e.kind == ScheduledCollective::sync || e.kind == ScheduledCollective::gather;
  const char* cat = syncs || e.kind == ScheduledCollective::buffers ? "sync" : "reduce";  // the used counts: a reduction
  const std::int64_t bucket = e.kind == ScheduledCollective::reduce || syncs ? std::int64_t(e.bucket) : -1;
  return [log = s.log, what = std::move(what), world = s.comm->world_size(), cat, bucket, it = std::int64_t(s.iteration), t0 = Timeline::now(),
          ready, inner = std::move(inner)](std::exception_ptr x) {
    log->completed(what, world, cat, bucket, it, t0, ready);
    inner(x);
  };
}

// Submits one phase of entry e's collectives. A hook's reduction may take several phases; the
// schedule issues nothing else until the last phase is out, so every rank's order stays the same.
// `ready`: when the entry was marked ready (-1: a later phase of a comm hook's reduction).
void submit(comm_stream_self self, const ScheduledCollective& e, CollectiveIssue issue, Timeline::Time ready = -1) {
  auto& s = self->state;
  auto& ops = issue.ops;
  auto on_complete = std::make_shared<std::function<void()>>(std::move(issue.on_complete));
  std::shared_ptr<std::function<bool(CollectiveIssue&)>> then;
  if (issue.then) {
    then = std::make_shared<std::function<bool(CollectiveIssue&)>>(std::move(issue.then));
    s.blocked = true;
  }
  // Nothing to move: a bucket of empty parameters, a sync the twin gave (Note [Syncs from the
  // twin]), a handed-over exchange with nothing in it. Done at once, a fused group as a group.
  if (ops.empty() && e.kind != ScheduledCollective::reduce && e.kind != ScheduledCollective::norm) completion_for(s, e, true, nullptr)(nullptr);
  for (std::size_t k = 0; k < ops.size(); ++k) {
    auto& op = ops[k];
    s.log->record(op);
    s.logger->debug("issue {} '{}': {} x {}", collective_name(op.kind), op.tag, op.count, dtype_name(op.dtype));
    CollectiveDone done = completion_for(s, e, k + 1 == ops.size(), on_complete);
    if (then && k + 1 == ops.size()) done = then_next_phase(self, e, then, std::move(done));
    done = timed(s, e, op, ready, std::move(done));
    test_fault::issuing(op.tag);
    s.comm->submit(std::move(op), std::move(done));
  }
}

// A trainer's collective (Runtime::collective) goes out between two iterations' schedules. It is
// in the collective log, not in the runtime's link figures (Runtime::stats: the runtime's own).
void release_trainer_ops(comm_stream_self self) {
  auto& s = self->state;
  if (s.next != 0 || s.blocked) return;
  std::vector<CommStreamState::TrainerOp> later;
  for (auto& t : s.trainer_ops) {
    if (t.before <= s.iteration) {
      s.log->record(t.op);
      s.comm->submit(std::move(t.op), std::move(t.done));
    } else {
      later.push_back(std::move(t));
    }
  }
  s.trainer_ops = std::move(later);
}

std::string entry_name(const ScheduledCollective& e) {
  switch (e.kind) {
    case ScheduledCollective::norm: return "the grad norm exchange";
    case ScheduledCollective::buffers: return "the buffers' broadcast";
    case ScheduledCollective::unused: return "the used counts' exchange";
    default: return "bucket " + std::to_string(e.bucket);
  }
}

// Entry e's ops, made now that it goes out.
CollectiveIssue prepare(CommStreamState& s, const ScheduledCollective& e) {
  switch (e.kind) {
    case ScheduledCollective::reduce: return s.collectives[e.bucket]->reduction(s.iteration);
    case ScheduledCollective::sync:
      if (s.fused && s.fused->fusion.fused(e.bucket)) {
        const auto g = s.fused->fusion.group_of[e.bucket];
        return s.collectives[e.bucket]->group_sync(g, s.last_packed[g]);
      }
      return s.collectives[e.bucket]->sync();
    case ScheduledCollective::gather: return s.collectives[e.bucket]->twin_gather();
    case ScheduledCollective::buffers:
    case ScheduledCollective::unused: return std::move(s.handed[e.kind]);
    default: return std::move(s.norm);
  }
}

// How many entries entry i stands for: a fused group's first sync stands for its members' (they
// follow it in the schedule: the grouping was made from it), 0 while one of them is not ready.
std::uint32_t entries_at(const CommStreamState& s, std::uint32_t i) {
  const auto& e = s.entries[i];
  if (e.kind != ScheduledCollective::sync || !s.fused || !s.fused->fusion.fused(e.bucket)) return 1;
  const auto n = std::uint32_t(s.fused->fusion.groups[s.fused->fusion.group_of[e.bucket]].members.size());
  for (std::uint32_t k = 1; k < n; ++k)
    if (!s.ready[i + k]) return 0;
  return n;
}

// Issues the ready entries from the schedule's position on, in order, until one is not ready.
void issue_ready(comm_stream_self self) {
  auto& s = self->state;
  release_trainer_ops(self);
  while (!s.blocked && s.next < s.entries.size() && s.ready[s.next]) {
    const std::uint32_t i = s.next, n = entries_at(s, i);
    if (n == 0) break;
    s.next += n;
    std::fill(s.ready.begin() + i, s.ready.begin() + i + n, 0);
    const auto& e = s.entries[i];
    CollectiveIssue issue;
    try {
      issue = prepare(s, e);
    } catch (const std::exception& x) {  // preparing the ops failed (a device cast, say): the entry fails, nothing is issued
      completion_for(s, e, true, nullptr)(std::make_exception_ptr(
          CommError("rank " + std::to_string(s.comm->rank()) + ": preparing " + entry_name(e) + "'s collective: " + x.what())));
      continue;
    }
    submit(self, e, std::move(issue), s.ready_at[i]);
    if (e.kind == ScheduledCollective::reduce && i == s.last_reduce_entry && s.shard) self->send(s.shard, msg::all_issued_atom::value);
  }
}

// The iteration's schedule is out: start over. True when the next iteration's first entry is
// ready already (Note [Ready before the wrap]).
bool wrap(comm_stream_self self) {
  auto& s = self->state;
  if (s.next != s.entries.size()) return false;
  s.next = 0;
  ++s.iteration;
  release_trainer_ops(self);
  return !s.entries.empty() && !s.blocked && s.ready[0];
}

// Issues every ready entry in schedule order. At an iteration's boundary (and once a comm hook's
// last phase is out) the trainer's collectives go first: before the next iteration's entries.
//
// Note [Ready before the wrap]
// With forward prefetch the next backward runs while this iteration's last syncs are still going
// out, so the next iteration's first buckets can be ready before the schedule wraps: their `ready`
// marks wait at its start. Once the last entry is out the pump goes round
// again and issues them. It stopped at the wrap instead, so they waited for the next message to
// this actor, and when none came (the trainer held by stage 2's backpressure until one of those
// very buckets was reduced) that rank never issued its reduction: the others timed out naming it
// (test_zero, "under random arrival orders ...", at world 3 with prefetch: 1 run in 2).
void pump(comm_stream_self self) {
  do {
    issue_ready(self);
  } while (wrap(self));
}

// Entry i may go out once every earlier one has.
void mark_ready(comm_stream_self self, std::uint32_t i) {
  self->state.ready[i] = 1;
  self->state.ready_at[i] = Timeline::now();
  pump(self);
}

// Every rank places it after the same entries: those of the iterations before `before`. One
// whose iteration `before` is already going out on this rank came during a backward pass.
void on_trainer_op(comm_stream_self self, std::uint64_t before, CollectiveOp& op, CollectiveDone& done) {
  auto& s = self->state;
  if (before < s.iteration || (before == s.iteration && s.next != 0)) {
    done(std::make_exception_ptr(UsageError("rank " + std::to_string(s.comm->rank()) + ": Runtime::collective ('" + op.tag +
                                            "') during the backward pass of iteration " + std::to_string(s.iteration) +
                                            ": call it between wait() and the next backward")));
    return;
  }
  s.trainer_ops.push_back({before, std::move(op), std::move(done)});
  release_trainer_ops(self);
}

}  // namespace

msg::comm_stream_actor_t::behavior_type comm_stream_actor(comm_stream_self self, std::shared_ptr<Communicator> comm,
                                                          std::vector<ScheduledCollective> entries, std::shared_ptr<CollectiveLog> log,
                                                          std::uint64_t first_iteration,
                                                          std::function<void(ScheduledCollective::Kind, const msg::Failure&)> handed_done,
                                                          std::shared_ptr<const FusedSyncs> fused) {
  auto& st = self->state;
  st.handed_done = std::move(handed_done);
  if (fused && !fused->fusion.groups.empty()) {
    st.last_packed.assign(fused->fusion.groups.size(), 0);
    st.fused = std::move(fused);
  }
  st.iteration = first_iteration;
  st.comm = std::move(comm);
  st.logger = rank_logger(st.comm->rank());
  st.log = std::move(log);
  index_schedule(st, std::move(entries));
  return {
      [=](msg::set_peer_atom, msg::shard_actor_t shard) { self->state.shard = std::move(shard); },
      [=](msg::bucket_ready_atom, std::uint32_t b, std::shared_ptr<const BucketCollectives> collectives, msg::bucket_actor_t owner) {
        auto& s = self->state;
        s.owners[b] = std::move(owner);
        s.collectives[b] = std::move(collectives);
        mark_ready(self, s.reduce_entry[b]);
      },
      [=](msg::step_done_atom, std::uint32_t b) {
        auto& s = self->state;
        if (s.fused && s.fused->fusion.fused(b)) s.last_packed[s.fused->fusion.group_of[b]] = b;
        mark_ready(self, s.sync_entry[b]);
      },
      [=](msg::twin_packed_atom, std::uint32_t b) { mark_ready(self, self->state.gather_entry[b]); },
      [=](msg::norm_ready_atom, CollectiveIssue& exchange) {
        self->state.norm = std::move(exchange);
        mark_ready(self, self->state.norm_entry);
      },
      [=](msg::hook_phase_atom, std::uint8_t kind, std::uint32_t bucket, bool more, CollectiveIssue& issue) {
        if (more) return submit(self, ScheduledCollective{ScheduledCollective::Kind(kind), bucket}, std::move(issue));
        self->state.blocked = false;
        pump(self);
      },
      [=](msg::trainer_op_atom, std::uint64_t before, CollectiveOp& op, CollectiveDone& done) { on_trainer_op(self, before, op, done); },
      [=](msg::handed_over_atom, std::uint8_t kind, CollectiveIssue& issue) {
        const auto k = ScheduledCollective::Kind(kind);
        self->state.handed[k] = std::move(issue);
        mark_ready(self, self->state.handed_entry.at(k));
      },
  };
}

}  // namespace shardflow
