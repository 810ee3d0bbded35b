// Note [The rank actor]
// One per Runtime: the typed interface of shardflow/actor.hpp, and what the blocking API's waits
// ask (runtime.cpp). A wait is a response promise held here, not a parked thread:
//   - iteration: begin_wait() hands the pass over; the promise waits until the IterationSignal
//     has counted what the pass needs (Impl::pass_complete), then end_wait() prepares the next
//     iteration and the answer goes out with the iteration number (and step_done to subscribers);
//   - params_ready(p): until p's bucket holds its update (forward prefetch);
//   - all_params: until every update landed.
// The signal tells this actor of each completion (a poke, IterationSignal's on_done); every wait
// has a deadline (Config::timeouts.collective + 5 s) after which it is answered with the
// TimeoutError naming the buckets still pending (Note [One deadline in flight]).
//
// The actor is detached (a thread of its own), for two reasons. What it runs between iterations
// includes small blocking collectives (the bucket rebuild's broadcast, a snapshot's verdicts,
// finalize in a RankCall), and these wait for the other ranks' rank actors: on a scheduler of one
// worker thread, one rank blocked there would stop every other rank's actors, itself included.
// And stage 2's backpressure in grad() waits for a bucket buffer; here that wait holds this
// rank's thread only, while the scheduler keeps running the actors that free the buffer.
#include "runtime/rank/rank_actor.hpp"

#include <caf/all.hpp>

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "runtime/rank/runtime_impl.hpp"

namespace shardflow {

struct RankActorAccess {
  static Runtime::Impl& impl(Runtime& rt) { return *rt.impl_; }
};

namespace {

using poke_atom = caf::atom_constant<caf::atom("sf_poke")>;
using deadline_atom = caf::atom_constant<caf::atom("sf_dline")>;
using steady = std::chrono::steady_clock;
using collective_done_atom = caf::atom_constant<caf::atom("sf_cdone")>;

// The public interface and the messages only the runtime sends it.
using rank_actor_impl = rank_api::actor::extend<caf::reacts_to<poke_atom>, caf::reacts_to<deadline_atom>,
                                                caf::reacts_to<collective_done_atom, std::uint64_t, caf::error>>;

template <class... Ts>
using promise_of = caf::typed_response_promise<Ts...>;

struct RankActorState {
  Runtime* rt = nullptr;
  std::uint64_t next_id = 0;  // names a trainer's collective for its completion
  bool deadline_armed = false;  // Note [One deadline in flight]
  struct IterationWait {
    promise_of<rank_api::step_done_atom, std::uint64_t> rp;
    steady::time_point due;
    Timeline::Time t0;
  };
  std::optional<IterationWait> iteration;
  // params_ready for one parameter or several: answered once every bucket listed landed.
  struct ParamWait {
    std::vector<std::uint32_t> buckets;  // still to land
    std::uint64_t target;
    steady::time_point due;
    Timeline::Time t0;
    std::string what;  // for the timeout's message
    std::function<void()> answer;
    std::function<void(const caf::error&)> fail;
  };
  std::vector<ParamWait> params;
  struct AllWait {
    promise_of<rank_api::all_params_atom> rp;
    std::uint64_t target;
    steady::time_point due;
    Timeline::Time t0;
  };
  std::vector<AllWait> all;
  struct CollectiveWait {
    promise_of<rank_api::collective_atom, std::string> rp;
    std::string tag;
  };
  std::map<std::uint64_t, CollectiveWait> collectives;
  bool waiting() const { return iteration || !params.empty() || !all.empty(); }
  static inline const char* name = "rank";
};
using rank_self = rank_actor_impl::stateful_pointer<RankActorState>;

caf::error error_of(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return to_error(x);
  } catch (...) {
    return make_error(errc::error, "an exception that is not a std::exception");
  }
}

// Every waiting request gets the error; the subscribers hear it once.
void fail_waits(rank_self self, const caf::error& e) {
  auto& st = self->state;
  if (st.iteration) st.iteration->rp.deliver(e);
  st.iteration.reset();
  for (auto& w : st.params) w.fail(e);
  st.params.clear();
  for (auto& w : st.all) w.rp.deliver(e);
  st.all.clear();
  RankActorAccess::impl(*st.rt).client.subscribers->failed(e);
}

// A message nobody answers failed (a bad grad_ready): the rank fails as a failed collective fails
// it, so that the error reaches the trainer at its next request, the subscribers now, and the
// peers through the abort instead of at their timeout.
void fail_rank(rank_self self, const std::exception& e) {
  RankActorAccess::impl(*self->state.rt).record_failure(std::current_exception(), e.what());
  fail_waits(self, to_error(e));
}

// Answers what the signal now allows.
void look(rank_self self) {
  auto& st = self->state;
  auto& rt = *st.rt;
  auto& I = RankActorAccess::impl(rt);
  try {
    if (st.iteration && I.pass_complete(I.passes_handed, I.wait_prefetching)) {
      I.blocked_since("wait (iteration)", -1, st.iteration->t0);
      RankActorAccess::impl(rt).end_wait();  // a failure here is the waiting request's (still pending)
      auto rp = st.iteration->rp;
      st.iteration.reset();
      rp.deliver(rank_api::step_done_atom::value, std::uint64_t(I.iterations));
      I.client.subscribers->step_done(I.iterations);
    }
    for (auto it = st.params.begin(); it != st.params.end();) {
      if (I.signal->failure()) I.check_outcome(IterationSignal::Outcome::failed, it->target, it->what);  // throws it
      auto& left = it->buckets;
      for (auto b = left.begin(); b != left.end();)
        if (I.signal->done(*b, it->target)) {
          if (I.shard) I.shard->join_bucket(*b);  // GPU: the compute stream waits for the update
          b = left.erase(b);
        } else {
          ++b;
        }
      if (!left.empty()) {
        ++it;
        continue;
      }
      I.blocked_since("wait_param", -1, it->t0);
      it->answer();
      it = st.params.erase(it);
    }
    for (auto it = st.all.begin(); it != st.all.end();) {
      if (!I.pass_complete(it->target, false)) {
        ++it;
        continue;
      }
      I.blocked_since("wait_all_params", -1, it->t0);
      if (I.shard) I.shard->join_compute();
      it->rp.deliver(rank_api::all_params_atom::value);
      it = st.all.erase(it);
    }
  } catch (const std::exception& e) {
    fail_waits(self, to_error(e));
  }
}

// Tells the signal what the waits left need first (Note [Watched completions]); true when a
// completion met some of it since look() read the signal: look again. (Sleeping then, with that
// wait's part left out of the watch, would leave it to its deadline: the run's collective
// timeout, ten minutes by default.)
bool watch_waits(rank_self self) {
  auto& st = self->state;
  auto& I = RankActorAccess::impl(*st.rt);
  IterationSignal::Watch w;
  bool met = st.iteration && !I.watch_pass(w, I.passes_handed, I.wait_prefetching);
  for (const auto& p : st.params)
    for (const auto b : p.buckets) w.slots.emplace_back(b, p.target);
  for (const auto& a : st.all) met = !I.watch_pass(w, a.target, false) || met;
  return met || I.signal->watch(w);
}

// Note [Idle between waits]
// Once the last wait is answered nobody needs a wake-up until the next request, which looks at the
// signal itself when it comes (check(), then its watch): so the signal is told to watch nothing,
// and completions stop waking the rank actor's thread for no one (a failure still wakes it). Left
// unwatched, every completion between two waits woke it: at stage 2, where backward waits for
// buffers and the buckets' syncs land before the trainer's wait(), that was a wake-up of the rank
// actor's thread for most buckets (bench_overhead, 100 buckets). The signal is the one read while
// a wait held the trainer: once that wait is answered the trainer may re-plan and replace it.
void check(rank_self self) {
  // Between iterations the trainer may be re-planning (a new signal): nothing to read then.
  while (self->state.waiting()) {
    const auto signal = RankActorAccess::impl(*self->state.rt).signal;
    look(self);
    if (!self->state.waiting()) {
      if (signal) signal->watch({});
      return;
    }
    if (!watch_waits(self)) return;
  }
}

// Note [One deadline in flight]
// Every wait is answered with a TimeoutError once it has waited the collective timeout and 5 s
// more. Each wait used to send itself a delayed message for that: CAF's clock thread then woke for
// every wait (a wake-up and a sleep a step, on a 2-core machine beside the compute) and held every
// message until it fell due, answered or not: at the default 10-minute timeout, 600,000 of them
// for a job of 1 ms steps. Now a wait notes when it falls due, and at most one deadline message is
// in flight, for the earliest due of the waits pending when it was sent; when it comes, the waits
// due fail and it is sent again for the earliest of those left, if any.
steady::time_point arm_deadline(rank_self self) {
  auto& st = self->state;
  const auto limit = RankActorAccess::impl(*st.rt).cfg.timeouts.collective + std::chrono::seconds(5);
  if (!std::exchange(st.deadline_armed, true)) self->delayed_send(self, limit, deadline_atom::value);
  return steady::now() + limit;
}

// params_ready: answered now when every parameter holds its update, else once its buckets land.
void await_params(rank_self self, const std::vector<Param>& ps, std::function<void()> answer,
                  std::function<void(const caf::error&)> fail) {
  auto& st = self->state;
  auto& I = RankActorAccess::impl(*st.rt);
  const auto t0 = Timeline::now();
  std::vector<std::uint32_t> buckets;
  std::string what;
  for (const auto p : ps) {
    const auto b = RankActorAccess::impl(*st.rt).param_bucket_to_await(p);
    if (b == ~0u || std::find(buckets.begin(), buckets.end(), b) != buckets.end()) continue;
    if (buckets.empty()) what = "the update of parameter '" + I.name_of(p.index) + "' (bucket " + std::to_string(b) + ")";
    buckets.push_back(b);
  }
  if (buckets.empty()) return answer();
  st.params.push_back(RankActorState::ParamWait{std::move(buckets), I.passes_handed, arm_deadline(self), t0, std::move(what),
                                                std::move(answer), std::move(fail)});
  check(self);
}

// ---- The handlers, each a short function; the behaviour below is their table ----------------

// Notes this rank's thread: a blocking wait asked from a RankCall would wait for this very actor
// (Impl::ask refuses it).
void here(rank_self self) {
  RankActorAccess::impl(*self->state.rt).client.thread.store(std::this_thread::get_id(), std::memory_order_relaxed);
}

// A request answered by its return value: an error goes back to the asker.
template <class Result, class F>
Result answered(rank_self self, F&& f) {
  here(self);
  try {
    return f();
  } catch (const std::exception& e) {
    return to_error(e);
  }
}

// A request answered later through `rp`: an error now is the promise's.
template <class Promise, class F>
Promise promised(rank_self self, Promise rp, F&& f) {
  here(self);
  try {
    f(rp);
  } catch (const std::exception& e) {
    rp.deliver(to_error(e));
  }
  return rp;
}

// A message without an answer: its error fails the rank.
template <class F>
void unanswered(rank_self self, F&& f) {
  here(self);
  try {
    f();
  } catch (const std::exception& e) {
    fail_rank(self, e);
  }
}

caf::result<rank_api::call_atom> on_call(rank_self self, rank_api::RankCall& f) {
  return answered<caf::result<rank_api::call_atom>>(self, [&] {
    if (!f) throw UsageError("rank_api::call_atom on rank " + std::to_string(RankActorAccess::impl(*self->state.rt).rank) + ": the RankCall is empty");
    f(*self->state.rt);
    return rank_api::call_atom::value;
  });
}

std::vector<GradSlot> grad_slots(Runtime& rt, const std::vector<Param>& ps) {
  std::vector<GradSlot> slots;
  for (const auto p : ps) slots.push_back(GradSlot{p, rt.grad(p)});  // stage 2's backpressure waits here, on this rank's thread
  return slots;
}

promise_of<rank_api::step_done_atom, std::uint64_t> on_iteration(rank_self self) {
  here(self);
  auto& st = self->state;
  auto& I = RankActorAccess::impl(*st.rt);
  auto rp = self->make_response_promise<rank_api::step_done_atom, std::uint64_t>();
  if (st.iteration) {
    rp.deliver(make_error(errc::usage, "rank " + std::to_string(I.rank) + ": an iteration was asked for while iteration " +
                                           std::to_string(I.iterations) + " is still pending; ask once per backward pass"));
    return rp;
  }
  const auto t0 = Timeline::now();
  try {
    if (!RankActorAccess::impl(*st.rt).begin_wait()) {  // accumulation: nothing went out
      rp.deliver(rank_api::step_done_atom::value, std::uint64_t(I.iterations));
      return rp;
    }
  } catch (const std::exception& e) {
    rp.deliver(to_error(e));
    return rp;
  }
  st.iteration = RankActorState::IterationWait{rp, arm_deadline(self), t0};
  check(self);
  return rp;
}

template <class Answer>
promise_of<rank_api::params_ready_atom, Answer> on_params_ready(rank_self self, const std::vector<Param>& ps, Answer answer) {
  return promised(self, self->make_response_promise<rank_api::params_ready_atom, Answer>(), [&](auto rp) {
    await_params(
        self, ps, [rp, answer]() mutable { rp.deliver(rank_api::params_ready_atom::value, answer); },
        [rp](const caf::error& e) mutable { rp.deliver(e); });
  });
}

promise_of<rank_api::all_params_atom> on_all_params(rank_self self) {
  return promised(self, self->make_response_promise<rank_api::all_params_atom>(), [&](auto rp) {
    auto& st = self->state;
    auto& I = RankActorAccess::impl(*st.rt);
    I.ensure_finalized();
    I.throw_if_failed();
    if (!I.prefetching()) {  // the last wait() waited for every update
      rp.deliver(rank_api::all_params_atom::value);
      return;
    }
    st.all.push_back(RankActorState::AllWait{rp, I.passes_handed, arm_deadline(self), Timeline::now()});
    check(self);
  });
}

promise_of<rank_api::collective_atom, std::string> on_collective(rank_self self, CollectiveOp& op) {
  auto& st = self->state;
  const auto id = st.next_id++;
  auto tag = op.tag;
  return promised(self, self->make_response_promise<rank_api::collective_atom, std::string>(), [&](auto rp) {
    RankActorAccess::impl(*st.rt).trainer_collective(std::move(op), [h = caf::actor_cast<rank_actor_impl>(self), id](std::exception_ptr e) {
      caf::anon_send(h, collective_done_atom::value, id, e ? error_of(e) : caf::error{});
    });
    st.collectives.emplace(id, RankActorState::CollectiveWait{rp, std::move(tag)});
  });
}

void on_collective_done(rank_self self, std::uint64_t id, caf::error& e) {
  auto& st = self->state;
  auto it = st.collectives.find(id);
  if (it == st.collectives.end()) return;
  if (e)
    it->second.rp.deliver(std::move(e));
  else
    it->second.rp.deliver(rank_api::collective_atom::value, it->second.tag);
  st.collectives.erase(it);
}

using checkpoint_answer = caf::result<rank_api::checkpoint_done_atom, std::string, std::uint64_t>;
checkpoint_answer on_checkpoint(rank_self self) {
  return answered<checkpoint_answer>(self, [&] {
    auto& I = RankActorAccess::impl(*self->state.rt);
    const auto pending = I.pending_checkpoint();
    if (!pending) return checkpoint_answer(rank_api::checkpoint_done_atom::value, std::string(), std::uint64_t(0));
    I.finish_checkpoint();
    return checkpoint_answer(rank_api::checkpoint_done_atom::value, pending->first, pending->second);
  });
}

// Note [Recovering from actors]
// recover() stops this very actor (retire) and blocks on the launcher's word and the snapshot's
// load, so it cannot run here, nor on a scheduler thread: a one-shot detached actor runs it and
// answers the trainer's request itself (delegated), then quits. The process's actor system, whose
// scheduler runs the trainer's actors and this helper, stays up through the swap of the Runtime's
// parts (recover() holds it).
using recovery_helper = caf::typed_actor<caf::replies_to<rank_api::recover_atom, rank_api::NextRound>::with<
    rank_api::recovered_atom, std::uint64_t, std::int32_t, std::int32_t>>;

recovery_helper::behavior_type recover_once(recovery_helper::pointer self, Runtime* rt) {
  return {
      [=](rank_api::recover_atom, rank_api::NextRound& next) {
        auto rp = self->make_response_promise<rank_api::recovered_atom, std::uint64_t, std::int32_t, std::int32_t>();
        try {
          if (!next) throw UsageError("rank_api::recover_atom: the NextRound is empty (it makes the next round's communicator)");
          const auto step = rt->recover(next());
          rp.deliver(rank_api::recovered_atom::value, step, std::int32_t(rt->rank()), std::int32_t(rt->world_size()));
        } catch (const std::exception& e) {
          rp.deliver(to_error(e));
        }
        self->quit();
        return rp;
      },
  };
}

caf::delegated<rank_api::recovered_atom, std::uint64_t, std::int32_t, std::int32_t> on_recover(rank_self self, rank_api::NextRound& next) {
  auto helper = self->system().spawn<caf::detached>(recover_once, self->state.rt);
  return self->delegate(helper, rank_api::recover_atom::value, std::move(next));
}

// Note [One deadline in flight]: the waits due now fail; the earliest of the others gets the next.
void on_deadline(rank_self self) {
  auto& st = self->state;
  auto& I = RankActorAccess::impl(*st.rt);
  st.deadline_armed = false;
  const auto now = steady::now();
  std::optional<steady::time_point> next;
  const auto due = [&](steady::time_point d) {
    if (d <= now) return true;
    next = next ? std::min(*next, d) : d;
    return false;
  };
  try {
    if (st.iteration && due(st.iteration->due))
      I.pass_timed_out(I.wait_prefetching ? I.passes_handed - 1 : I.passes_handed, "iteration " + std::to_string(I.iterations));
    for (const auto& w : st.params)
      if (due(w.due)) I.pass_timed_out(w.target, w.what);
    for (const auto& w : st.all)
      if (due(w.due)) I.pass_timed_out(w.target, "the parameters' updates (wait_all_params)");
  } catch (const std::exception& e) {
    fail_waits(self, to_error(e));
    return;
  }
  if (!next) return;
  st.deadline_armed = true;
  // Rounded up: a message a microsecond early would find the wait not yet due and send another.
  self->delayed_send(self, std::chrono::ceil<std::chrono::microseconds>(*next - now), deadline_atom::value);
}

rank_actor_impl::behavior_type rank_actor(rank_self self, Runtime* rt) {
  self->state.rt = rt;
  auto& I = RankActorAccess::impl(*rt);
  using namespace rank_api;
  using save_answer = caf::result<save_atom, std::string>;
  return {
      [=](call_atom, RankCall& f) { return on_call(self, f); },
      [=](grad_atom, Param p) { return answered<caf::result<GradSlot>>(self, [&] { return GradSlot{p, rt->grad(p)}; }); },
      [=](grad_atom, const std::vector<Param>& ps) {
        return answered<caf::result<std::vector<GradSlot>>>(self, [&] { return grad_slots(*rt, ps); });
      },
      [=](grad_ready_atom, Param p) { unanswered(self, [&] { rt->grad_ready(p); }); },
      [=](grad_ready_atom, const std::vector<Param>& ps) {
        unanswered(self, [&] {
          for (const auto p : ps) rt->grad_ready(p);
        });
      },
      [=](grads_ready_atom, std::uint64_t offset, std::uint64_t count) {
        unanswered(self, [&] { rt->grads_ready(std::size_t(offset), std::size_t(count)); });
      },
      [=](zero_grad_atom) { unanswered(self, [&] { rt->zero_grad(); }); },
      [=](require_sync_atom, bool sync) { unanswered(self, [&] { rt->set_require_sync(sync); }); },
      [=](iteration_atom) { return on_iteration(self); },
      [=](params_ready_atom, Param p) { return on_params_ready(self, {p}, p); },
      [=](params_ready_atom, std::vector<Param>& ps) { return on_params_ready(self, ps, ps); },
      [=](all_params_atom) { return on_all_params(self); },
      [=](collective_atom, CollectiveOp& op) { return on_collective(self, op); },
      [=](collective_done_atom, std::uint64_t id, caf::error& e) { on_collective_done(self, id, e); },
      [=](save_atom, std::string& dir) {
        return answered<save_answer>(self, [&] {
          rt->save_sharded_checkpoint_async(dir);
          return save_answer(save_atom::value, dir);
        });
      },
      [=](checkpoint_atom) { return on_checkpoint(self); },
      [=](recover_atom, NextRound& next) { return on_recover(self, next); },
      [=, &I](subscribe_atom, caf::actor& who, std::uint8_t mask) { I.client.subscribers->subscribe(std::move(who), mask); },
      [=, &I](unsubscribe_atom, caf::actor& who) { I.client.subscribers->unsubscribe(who); },
      [=](poke_atom) { check(self); },
      [=](deadline_atom) { on_deadline(self); },
  };
}

}  // namespace

rank_api::actor spawn_rank_actor(caf::actor_system& sys, Runtime& rt) { return sys.spawn<caf::detached>(rank_actor, &rt); }

void stop_rank_actor(caf::actor_system& sys, rank_api::actor& h) {
  if (!h) return;
  caf::scoped_actor self{sys};
  self->send_exit(h, caf::exit_reason::user_shutdown);
  self->wait_for(h);
  h = rank_api::actor{};
}

std::function<void()> rank_actor_poke(const rank_api::actor& h) {
  return [h = caf::actor_cast<rank_actor_impl>(h)] { caf::anon_send(h, poke_atom::value); };
}

rank_api::actor rank_actor_of(Runtime& rt) { return RankActorAccess::impl(rt).client.actor; }
caf::actor_system& actor_system_of(Runtime& rt) { return RankActorAccess::impl(rt).actors->system(); }

}  // namespace shardflow
