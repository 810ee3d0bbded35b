#include "actors/shard_actor.hpp"

#include <caf/all.hpp>

#include <algorithm>
#include <optional>
#include <utility>


namespace shardflow {
namespace {

void reset(ShardActorState& s) {
  std::fill(s.reduced.begin(), s.reduced.end(), 0);
  std::fill(s.stepped.begin(), s.stepped.end(), 0);
  s.nreduced = s.nstepped = s.nsynced = s.staging_in_flight = s.first_unstepped = 0;
  s.all_issued = false;
  s.unused_known = false;
  s.phase = s.shard->exchanges_norm() ? ShardPhase::waiting_for_norm : ShardPhase::stepping;
  s.clip_coef = ClipCoef{};
}

void on_reduced(msg::shard_actor_t::stateful_pointer<ShardActorState> self, std::uint32_t b, const msg::Failure& failure);

// This iteration is over: the next one starts with the reductions that came early (Note [The next
// iteration's reductions]).
void next_iteration(msg::shard_actor_t::stateful_pointer<ShardActorState> self) {
  auto& s = self->state;
  reset(s);
  auto early = std::move(s.next_reduced);
  s.next_reduced.clear();
  for (const auto b : early) on_reduced(self, b, msg::Failure{});
}

// A turn of steps ends before the next step would take it past this (Note [One step per message]).
constexpr Timeline::Time kStepTurnUs = 50;

msg::Failure shard_failure(const ShardActorState& s, std::uint32_t b, const std::exception& e) {
  return {msg::Failure::comm,
          "rank " + std::to_string(s.shard->shard_plan().rank) + ": optimizer shard, bucket " + std::to_string(b) + ": " + e.what()};
}

using shard_self = msg::shard_actor_t::stateful_pointer<ShardActorState>;

// The trainer changed hyper-parameters between iterations: this iteration's snapshot, taken when
// its first step goes (Note [Hyper-parameter snapshots]).
void take_snapshot(ShardActorState& s) {
  const auto it = std::uint64_t(s.shard->steps());
  std::size_t pick = s.snapshots.size();
  for (std::size_t i = 0; i < s.snapshots.size(); ++i)
    if (s.snapshots[i].first <= it) pick = i;
  if (pick < s.snapshots.size()) {
    s.shard->set_groups(s.snapshots[pick].second);
    s.snapshots.erase(s.snapshots.begin(), s.snapshots.begin() + std::ptrdiff_t(pick) + 1);
  }
}

// Clipping: the global norm needs every reduced gradient, so no step goes before all reductions
// are in and the norm's exchange is back. False while the steps must wait for it.
bool norm_settled(shard_self self) {
  auto& s = self->state;
  if (s.phase == ShardPhase::norm_in_flight) return false;
  if (s.phase != ShardPhase::waiting_for_norm) return true;
  if (s.nreduced < s.reduced.size()) return false;
  s.phase = ShardPhase::norm_in_flight;
  s.shard->partial_norm();  // the exchange waits for its event (Note [Shard streams])
  if (s.shard->syncs()) {
    self->send(s.comm, msg::norm_ready_atom::value, norm_exchange(s.shard));
    return false;
  }
  s.clip_coef = s.shard->finish_norm();  // stage 0: every rank sees every gradient
  s.phase = ShardPhase::stepping;
  return true;
}

// Note [Which bucket steps next]
// The reduced, unstepped bucket that comes first in the syncs' order steps next. Stepping strictly
// in that order made every bucket wait for the one the next forward needs first, which with
// forward prefetch is the last one reduced: all B steps then ran after backward, in series with
// the first sync (measured at link/compute 1: forward's first layer waited 2.6 ms where its reduce
// + step + sync take 0.9). With pooled staging (stage 2: at most staging_cap buckets between step
// and synced, so the parameter syncs do not bring back the memory the gradient shards saved) a
// bucket holds a staging buffer from its step to its sync's end and syncs end in order, so only
// the first staging_cap unsynced buckets of the order may step: the one the comm stream issues
// next can always get one.
// A fused bucket (Note [Fused syncs]) takes no staging buffer: it may step whatever the staging
// holds, and only the buckets that sync alone count in the window.
std::optional<std::uint32_t> next_bucket(ShardActorState& s) {
  const std::size_t B = s.reduced.size();
  const bool allowed = s.overlap == Overlap::interleaved || (s.overlap == Overlap::after_backward && s.all_issued) || s.nreduced == B;
  const bool pooled = s.shard->buffers().pooled();
  if (!allowed || s.nstepped == B) return std::nullopt;
  // Fused buckets from position i on (they may step past the staged window).
  auto fused_from = [&](std::size_t i) { return (B - i) - (s.staged_before[B] - s.staged_before[i]); };
  const bool staging_full = pooled && s.staging_in_flight >= s.staging_cap;
  auto bucket_at = [&](std::size_t i) { return s.order.empty() ? std::uint32_t(i) : s.order[i]; };
  while (s.first_unstepped < B && s.stepped[bucket_at(s.first_unstepped)]) ++s.first_unstepped;
  if (staging_full && fused_from(s.first_unstepped) == 0) return std::nullopt;
  for (std::size_t i = s.first_unstepped; i < B; ++i) {
    const auto b = bucket_at(i);
    const bool staged = !s.shard->fused(b);
    const bool in_window = !pooled || s.staged_before[i] < s.staged_before[std::min(s.nsynced, B)] + s.staging_cap;
    if (staged && !in_window && fused_from(i) == 0) break;  // nothing further may step
    if (s.reduced[b] && !s.stepped[b] && (!staged || (!staging_full && in_window))) return b;
  }
  return std::nullopt;
}

// The step counts advance before the last bucket is reported: without syncs that report ends the
// iteration, and the trainer may read the count at once (state migration when the buckets are
// rebuilt after wait()). Counting after the send raced with that read.
void end_step_once(ShardActorState& s) {
  if (s.nstepped == s.reduced.size() && s.phase != ShardPhase::stepped) {
    s.phase = ShardPhase::stepped;
    s.shard->end_step();
  }
}

// Steps bucket b, then hands it to the comm stream for its sync (or, without syncs, it is done).
// Returns when the step began and ended (the turn's accounting).
std::pair<Timeline::Time, Timeline::Time> step_bucket(shard_self self, std::uint32_t b) {
  auto& s = self->state;
  Shard& sh = *s.shard;
  s.stepped[b] = 1;
  ++s.nstepped;
  const auto t0 = Timeline::now();
  if (!sh.skipping()) sh.step(b, s.clip_coef);  // Note [Loss scaling]: an inf somewhere: no rank steps
  end_step_once(s);
  // Note [Syncs from the twin]: nothing to send, or (two levels) packed once the shift is out.
  if (sh.syncs() && !sh.shifts_in_sync()) sh.pack(b);
  const auto t1 = Timeline::now();
  s.timeline->stats().optimizer(t0, t1);
  if (s.timeline->tracing())
    s.timeline->span("step bucket " + std::to_string(b), "step", Lane::optimizer, t0, t1,
                     SpanArgs{std::int64_t(b), -1, nullptr, std::int64_t(sh.steps()) - (s.phase == ShardPhase::stepped ? 1 : 0), -1});
  if (sh.syncs()) {
    if (!sh.fused(b)) ++s.staging_in_flight;
    self->send(s.comm, msg::step_done_atom::value, b);
  } else {
    if (s.zero_on_done) sh.zero_bucket(b);
    sh.mark_done(b);
    s.iteration->bucket_done(b, msg::Failure{});
  }
  return {t0, t1};
}

// Note [One step per message]
// Steps go in turns of at most kStepTurnUs: after a turn the actor hands its scheduler thread back,
// so the comm stream can issue the syncs of the buckets just stepped while the next ones step.
// Stepping every ready bucket in one go kept both scheduler threads busy with two ranks' shards and
// held every sync back until all steps were done (measured: 0.8 ms of idle link per iteration at
// 16 buckets of 0.25 MiB, ~40 us a step). A turn takes one more step only if that one, as long as
// the last, still ends within the turn: large steps go one per turn as before, while small ones
// share a turn instead of each paying a hand-over (bench_overhead: 100 buckets of 10 KiB). The
// step_next message to itself goes through CAF's clock (a delayed send of 0), so that the actor's
// mailbox is empty when this message is done and the thread takes the next actor's turn; a plain
// send would be processed in the same turn. (One message per turn for every actor would do it too,
// but cost 3x on the runtime's overhead: bench_overhead.)
void try_step(shard_self self) {
  auto& s = self->state;
  if (!norm_settled(self)) return;
  if (s.used_counts && !s.unused_known) return;  // Note [Unused parameters]
  if (s.nstepped == 0 && !s.snapshots.empty()) take_snapshot(s);
  const auto turn_start = Timeline::now();
  for (auto next = next_bucket(s); next;) {
    const auto [t0, t1] = step_bucket(self, *next);
    next = next_bucket(s);
    if (next && (t1 - turn_start) + (t1 - t0) > kStepTurnUs) {
      self->delayed_send(self, std::chrono::microseconds(0), msg::step_next_atom::value);
      return;
    }
  }
  end_step_once(s);  // no buckets at all
  if (s.nstepped == s.reduced.size() && !s.shard->syncs()) next_iteration(self);
}

// The shard's own work failing (a CUDA error on a GPU shard) fails the iteration with a message
// that names the rank and the bucket, instead of killing the actor and leaving wait() to time out.
template <class Work>
void guarded(shard_self self, std::uint32_t b, const Work& work) {
  try {
    work();
  } catch (const std::exception& e) {
    self->state.iteration->bucket_done(b, shard_failure(self->state, b, e));
  }
}

// An exchange every step waits for (the norm, the used counts) completed: its failure fails the
// iteration; otherwise `use` takes its result and the steps may go.
template <class Use>
void exchanged(shard_self self, const msg::Failure& failure, const Use& use) {
  if (failure) return self->state.iteration->bucket_done(0, failure);
  guarded(self, 0, [&] {
    use(self->state);
    try_step(self);
  });
}

// Note [The next iteration's reductions]
// With forward prefetch the next backward may start while this iteration's last syncs are still
// on their way, and a bucket's next reduction goes out once its own sync has landed. Over two
// levels (Note [Lanes]) collectives complete out of order: the next iteration's reduction of a
// bucket whose sync came early can land before another bucket's sync of this iteration. Taken at
// once, it counted into this iteration (`reduced` was set already), the last sync's reset then
// wiped it, and that bucket was never stepped: every rank stopped at its sync until the collective
// timeout (2 hosts x 2 ranks, forward prefetch, a trainer that reports gradients without waiting
// for every parameter first: 2 runs in 2). A reduction for a bucket this iteration has reduced
// already is the next iteration's (a bucket's reductions come in order: Note [Reduced, straight to
// the shard]), so it waits until the iteration is over. Its step cannot come too early either
// way: the comm stream issued it after this iteration's sync of the same bucket, which went out
// after that bucket's step.
void on_reduced(shard_self self, std::uint32_t b, const msg::Failure& failure) {
  if (failure) return self->state.iteration->bucket_done(b, failure);
  if (self->state.reduced[b]) return self->state.next_reduced.push_back(b);
  guarded(self, b, [&] {
    auto& s = self->state;
    s.shard->take_grad_shard(b);  // stage 2: keep only this rank's shard of it and give the buffer back
    // Note [Mirrored shards]: the twin takes the slice before this bucket's step can end the step
    // (Note [Syncs from the twin]: it comes with the sync instead).
    if (!s.shard->shifts_in_sync()) s.shard->mirror_arrived(b);
    s.reduced[b] = 1;
    ++s.nreduced;
    try_step(self);
  });
}

// The step a sync belongs to: end_step may have counted it already.
std::int64_t synced_step(const ShardActorState& s) { return s.shard->steps() - (s.phase == ShardPhase::stepped ? 1 : 0); }

// Note [Syncs from the twin, two levels]: bucket b's shift to the twin landed. The twin steps it
// into the staging beside this rank's block, and the gather inside the host may go.
void on_twin_shifted(shard_self self, std::uint32_t b, const msg::Failure& failure) {
  if (failure) return self->state.iteration->bucket_done(b, failure);
  guarded(self, b, [&] {
    auto& s = self->state;
    const auto step = synced_step(s);
    const auto t0 = Timeline::now();
    s.shard->twin_shifted(b, step);
    const auto t1 = Timeline::now();
    s.timeline->stats().optimizer(t0, t1);
    if (s.timeline->tracing())
      s.timeline->span("twin's step bucket " + std::to_string(b), "step", Lane::optimizer, t0, t1, SpanArgs{std::int64_t(b), -1, nullptr, step, -1});
    self->send(s.comm, msg::twin_packed_atom::value, b);
  });
}

// Bucket b's sync landed: other owners' updated parameters into the trainer's storage.
void on_synced(shard_self self, std::uint32_t b, msg::Failure& failure) {
  auto& s = self->state;
  if (!failure) try {
      const auto t0 = Timeline::now();
      if (s.shard->syncs_from_twin())
        s.shard->twin_synced(b, synced_step(s));
      else
        s.shard->unpack(b);
      if (s.timeline->tracing())
        s.timeline->span("unpack bucket " + std::to_string(b), "sync", Lane::optimizer, t0, Timeline::now(), SpanArgs{std::int64_t(b), -1, nullptr, -1, -1});
      if (s.zero_on_done) s.shard->zero_bucket(b);
      s.shard->mark_done(b);
    } catch (const std::exception& e) {
      failure = shard_failure(s, b, e);
    }
  if (!s.shard->fused(b)) --s.staging_in_flight;
  s.iteration->bucket_done(b, failure);
  if (++s.nsynced == s.reduced.size())
    next_iteration(self);
  else
    guarded(self, b, [&] { try_step(self); });  // a staging buffer came back: a deferred step may go
}

}  // namespace

msg::shard_actor_t::behavior_type shard_actor(shard_self self, ShardActorArgs args) {
  auto& st = self->state;
  st.used_counts = std::move(args.used_counts);
  st.timeline = std::move(args.timeline);
  st.zero_on_done = args.zero_on_done;
  st.order = std::move(args.order);
  st.staging_cap = std::max<std::size_t>(1, args.staging_cap);
  st.reduced.assign(args.shard->plan().buckets.size(), 0);
  st.stepped.assign(args.shard->plan().buckets.size(), 0);
  st.shard = std::move(args.shard);
  st.staged_before.assign(st.reduced.size() + 1, 0);
  for (std::size_t i = 0; i < st.reduced.size(); ++i)
    st.staged_before[i + 1] = st.staged_before[i] + (st.shard->fused(st.order.empty() ? i : st.order[i]) ? 0 : 1);
  st.overlap = args.overlap;
  st.comm = std::move(args.comm);
  st.iteration = std::move(args.iteration);
  st.phase = st.shard->exchanges_norm() ? ShardPhase::waiting_for_norm : ShardPhase::stepping;
  return {
      [=](msg::set_groups_atom, std::uint64_t from_iteration, std::shared_ptr<const OptimizerGroups> groups) {
        self->state.snapshots.emplace_back(from_iteration, std::move(groups));
      },
      [=](msg::reduced_atom, std::uint32_t b, msg::Failure& failure) { on_reduced(self, b, failure); },
      [=](msg::step_next_atom) { guarded(self, 0, [&] { try_step(self); }); },
      [=](msg::all_issued_atom) {
        self->state.all_issued = true;
        guarded(self, 0, [&] { try_step(self); });
      },
      [=](msg::norm_done_atom, msg::Failure& failure) {
        exchanged(self, failure, [](ShardActorState& s) {
          s.clip_coef = s.shard->finish_norm();
          s.phase = ShardPhase::stepping;
        });
      },
      [=](msg::unused_known_atom, msg::Failure& failure) {
        exchanged(self, failure, [](ShardActorState& s) {
          s.shard->skip_unused(*s.used_counts);
          s.unused_known = true;
        });
      },
      [=](msg::broadcast_done_atom, std::uint32_t b, msg::Failure& failure) { on_synced(self, b, failure); },
      [=](msg::twin_shifted_atom, std::uint32_t b, msg::Failure& failure) { on_twin_shifted(self, b, failure); },
      [=](msg::group_synced_atom, std::uint32_t g, msg::Failure& failure) {
        for (const auto b : self->state.shard->fused_syncs()->fusion.groups[g].members) {
          auto f = failure;
          on_synced(self, b, f);
        }
      },
  };
}

}  // namespace shardflow
