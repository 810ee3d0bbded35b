// The rank trainer: one rank's loop of steps as messages, and its recovery in place.
//
// Note [The actor trainer heals in place]
// Under `shardflow run --recovery in-place | shrink` a lost peer ends the round: the rank actor
// answers the step's requests with the error (and the layers' requests fail alike). The rank
// trainer then does what mlp_train's loop does with Runtime::recover(), without blocking a
// scheduler thread:
//   1. it stops its workers (data loader, loss, layers) and waits for their down messages: a layer
//      may still hold a slot of the old round's buckets, and the context the workers read (the
//      rank, the world, the rank actor) may change only while none of them is alive;
//   2. it asks its rank actor to recover onto the next round (rank_api::recover_atom with the
//      launcher's rejoin), which runs on a thread of its own and answers the step to go on after,
//      the rank and the world (a shrinking round numbers the survivors afresh);
//   3. it spawns the workers again, for the new rank and world, and goes on from that step.
// Every answer of the old round that still arrives is stale (`round` moved on): dropped.
#include <caf/all.hpp>

#include <unistd.h>

#include <cstdio>
#include <limits>
#include <memory>

#include "examples/actor_trainer/actors.hpp"

namespace shardflow::actor_trainer {

std::vector<caf::actor> RankContext::workers() const {
  std::vector<caf::actor> all{loader, loss};
  all.insert(all.end(), layers.begin(), layers.end());
  return all;
}

namespace {

using Self = caf::stateful_actor<RankTrainerState>*;

void spawn_workers(RankContext* ctx) {
  auto& sys = actor_system_of(*ctx->rt);
  ctx->loader = sys.spawn(data_loader, ctx);
  ctx->loss = sys.spawn(loss, ctx);
  ctx->layers.clear();
  for (int i = 0; i + 1 < int(ctx->opt->sizes.size()); ++i) ctx->layers.push_back(sys.spawn(layer, ctx, i));
}

// A peer lost (its death, or its silence past the timeout): what recovering in place answers.
bool peer_lost(const caf::error& e) {
  return e.category() == caf::atom("shardflow") && (static_cast<errc>(e.code()) == errc::comm || static_cast<errc>(e.code()) == errc::timeout);
}

void start_step(Self self, RankContext* ctx, mlp::TrainResult* result, std::size_t slot);
void finish(Self self, RankContext* ctx, mlp::TrainResult* result, std::size_t slot);

// Step 3 of Note [The actor trainer heals in place].
void recovered(Self self, RankContext* ctx, mlp::TrainResult* result, std::size_t slot, std::uint64_t step, int rank, int world) {
  auto& st = self->state;
  const auto& opt = *ctx->opt;
  if (opt.global_batch % world != 0) {
    st.failed = true;
    st.run.deliver(make_error(errc::usage, "recovered at world " + std::to_string(world) + ", which does not divide --global-batch " +
                                               std::to_string(opt.global_batch) + ": every rank takes an equal share of each batch"));
    return;
  }
  ctx->runtime = rank_actor_of(*ctx->rt);
  ctx->rank = rank;
  ctx->world = world;
  st.recovering = false;
  st.step = st.first = int(step);
  st.local_losses.clear();  // this round's steps, as mlp_train reports them
  if (rank == 0) result->step_ms.clear(), result->grad_norms.clear();
  st.in_flight.clear();
  st.held.clear();
  std::fprintf(stderr, "rank %d (pid %ld): recovered in place as rank %d of %d, going on after step %d\n", st.started_as, long(::getpid()),
               rank, world, int(step));
  spawn_workers(ctx);
  if (st.step < opt.steps)
    start_step(self, ctx, result, slot);
  else
    finish(self, ctx, result, slot);
}

// Steps 1 and 2: once the last worker is gone, the rank actor recovers onto the next round.
void recover(Self self, RankContext* ctx, mlp::TrainResult* result, std::size_t slot) {
  auto& st = self->state;
  st.recovering = true;
  ++st.round;
  const auto workers = ctx->workers();
  st.stopping = workers.size();
  for (const auto& w : workers) {
    self->monitor(w);
    self->send_exit(w, caf::exit_reason::user_shutdown);
  }
  self->set_down_handler([=](caf::down_msg&) {
    if (--self->state.stopping > 0) return;
    self->request(ctx->runtime, caf::infinite, rank_api::recover_atom::value, rank_api::NextRound(ctx->opt->rejoin))
        .then([=](rank_api::recovered_atom, std::uint64_t step, std::int32_t rank,
                  std::int32_t world) { recovered(self, ctx, result, slot, step, rank, world); },
              [=](caf::error& e) {
                self->state.failed = true;
                self->state.run.deliver(e);
              });
  });
}

// An error of round `round`: a lost peer is recovered from in place when the launcher allows it,
// anything else ends the run (the first error is the cause).
void fail(Self self, RankContext* ctx, mlp::TrainResult* result, std::size_t slot, std::uint64_t round, const caf::error& e) {
  auto& st = self->state;
  if (round != st.round || st.recovering || st.failed) return;
  if (ctx->opt->rejoin && peer_lost(e)) {
    std::fprintf(stderr, "rank %d: this round ended (%s); recovering in place\n", ctx->rank, what(e).c_str());
    return recover(self, ctx, result, slot);
  }
  st.failed = true;
  if (st.run.pending()) st.run.deliver(e);
}

// Reports in step order: those up to the newest reduced step, and after it those no pending
// reduction holds back.
void report(Self self, const RankContext* ctx) {
  auto& st = self->state;
  const int next_pending = st.in_flight.empty() ? std::numeric_limits<int>::max() : st.in_flight.front();
  std::size_t n = 0;
  for (; n < st.held.size() && st.held[n].step < next_pending; ++n) {
    st.held[n].loss = st.last_global;
    if (ctx->opt->on_step) ctx->opt->on_step(st.held[n]);
  }
  st.held.erase(st.held.begin(), st.held.begin() + std::ptrdiff_t(n));
}

// After the last step: every update landed, every step's global loss, rank 0's results.
void finish(Self self, RankContext* ctx, mlp::TrainResult* result, std::size_t slot) {
  const auto& opt = *ctx->opt;
  const auto round = self->state.round;
  auto on_error = [=](caf::error& e) { fail(self, ctx, result, slot, round, e); };
  auto fill = [=] {
    auto& st = self->state;
    if (round != st.round) return;
    result->memory_end[slot] = ctx->rt->memory_report();
    if (ctx->rank == 0) {
      if (opt.report_loss) result->losses = st.local_losses;
      if (ctx->data->test_rows > 0) {
        result->heldout_accuracy = ctx->model->accuracy(ctx->data->x_test.data(), ctx->data->y_test.data(), ctx->data->test_rows);
        result->heldout_rows = ctx->data->test_rows;
      }
      result->params = ctx->model->release_state_dict();
      result->buckets = ctx->rt->buckets();
      result->collectives = ctx->rt->collective_log();
      result->stats = ctx->rt->stats();
    }
    if (slot == 0) result->rank_at_end = ctx->rank;  // one result for ranks as threads: slot 0 writes it, as mlp_train
    st.run.deliver(run_atom::value);
  };
  self->request(ctx->runtime, caf::infinite, rank_api::all_params_atom::value)
      .then(
          [=](rank_api::all_params_atom) {
            auto& st = self->state;
            if (round != st.round) return;
            // Every step's global loss in one collective at the end (the same sums as per step).
            if (opt.report_loss && ctx->world > 1 && opt.loss_every > 1 && !st.local_losses.empty()) {
              self->request(ctx->runtime, caf::infinite, rank_api::collective_atom::value,
                            mlp::loss_allreduce(st.local_losses.data(), st.local_losses.size(), ctx->world))
                  .then([=](rank_api::collective_atom, const std::string&) { fill(); }, on_error);
            } else {
              fill();
            }
          },
          on_error);
}

// The step's global norm, into its slot. With forward prefetch iteration_atom is answered before
// the step is taken and Runtime::last_grad_norm() waits for the norm (Note [What the last step
// left, under prefetch]), a wait that must not hold a scheduler thread: it runs on the rank's own.
void record_norm(Self self, RankContext* ctx, mlp::TrainResult* result, std::size_t slot) {
  const auto round = self->state.round;
  const auto at = result->grad_norms.size();
  result->grad_norms.push_back(0.0f);
  auto norm = std::make_shared<float>(0.0f);
  self->request(ctx->runtime, caf::infinite, rank_api::call_atom::value, rank_api::RankCall{[norm](Runtime& rt) { *norm = rt.last_grad_norm(); }})
      .then(
          [=](rank_api::call_atom) {
            if (round == self->state.round) result->grad_norms[at] = *norm;
          },
          [=](caf::error& e) { fail(self, ctx, result, slot, round, e); });
}

// The iteration is done: the step's loss (reduced every loss_every steps) and its report.
void end_step(Self self, RankContext* ctx, mlp::TrainResult* result, std::size_t slot) {
  auto& st = self->state;
  const auto& opt = *ctx->opt;
  const int step = st.step;
  const auto round = st.round;
  st.local_losses.push_back(st.loss);
  const bool reduce_now = (step + 1) % std::max(1, opt.loss_every) == 0 || step + 1 == opt.steps;
  const bool reduces = opt.report_loss && ctx->world > 1;
  if (!reduces) st.last_global = st.loss;
  if (reduces && reduce_now) {
    st.reduced[std::size_t(step)] = st.loss;
    st.in_flight.push_back(step);
    self->request(ctx->runtime, caf::infinite, rank_api::collective_atom::value, mlp::loss_allreduce(&st.reduced[std::size_t(step)], 1, ctx->world))
        .then(
            [=](rank_api::collective_atom, const std::string&) {
              auto& st = self->state;
              if (round != st.round) return;
              st.last_global = st.reduced[std::size_t(step)];
              if (opt.loss_every <= 1) st.local_losses[std::size_t(step - st.first)] = st.last_global;  // already global
              st.in_flight.erase(st.in_flight.begin());
              report(self, ctx);
              if (st.in_flight.empty() && st.step == opt.steps) finish(self, ctx, result, slot);
            },
            [=](caf::error& e) { fail(self, ctx, result, slot, round, e); });
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - st.t0).count();
  if (ctx->rank == 0) {
    if (opt.runtime.zero.clip_grad_norm > 0) record_norm(self, ctx, result, slot);
    result->step_ms.push_back(ms);
    st.held.push_back(mlp::StepReport{step, st.last_global, ms, ctx->rt->last_stats()});
  }
  report(self, ctx);
  ++st.step;
  if (st.step < opt.steps)
    start_step(self, ctx, result, slot);
  else if (st.in_flight.empty())
    finish(self, ctx, result, slot);
}

void start_step(Self self, RankContext* ctx, mlp::TrainResult* result, std::size_t slot) {
  auto& st = self->state;
  const auto round = st.round;
  st.t0 = std::chrono::steady_clock::now();
  st.have_loss = st.have_backward = false;
  self->send(ctx->runtime, rank_api::zero_grad_atom::value);
  if (ctx->prefetch) self->send(ctx->layers.front(), prefetch_atom::value);  // the first layer's update, asked for before its input is ready
  self->request(ctx->loader, caf::infinite, batch_atom::value, st.step)
      .then(
          [=](BatchPtr batch) {
            if (round != self->state.round) return;
            self->send(ctx->loss, targets_atom::value, batch);
            self->send(ctx->layers.front(), forward_atom::value, Activations(batch, &batch->x), batch->rows);
          },
          [=](caf::error& e) { fail(self, ctx, result, slot, round, e); });
}

}  // namespace

caf::behavior rank_trainer(caf::stateful_actor<RankTrainerState>* self, RankContext* ctx, mlp::TrainResult* result, std::size_t slot) {
  self->state.reduced.resize(std::size_t(std::max(0, ctx->opt->steps)));
  self->state.started_as = ctx->rank;
  auto backward_over = [=] {
    auto& st = self->state;
    if (!st.have_loss || !st.have_backward || st.failed || st.recovering) return;
    const auto round = st.round;
    self->request(ctx->runtime, caf::infinite, rank_api::iteration_atom::value)
        .then(
            [=](rank_api::step_done_atom, std::uint64_t) {
              if (round == self->state.round) end_step(self, ctx, result, slot);
            },
            [=](caf::error& e) { fail(self, ctx, result, slot, round, e); });
  };
  return {
      [=](run_atom) {
        auto& st = self->state;
        st.run = self->make_response_promise();
        spawn_workers(ctx);
        // Setup's collectives run on the rank actor's thread, never on a scheduler thread: with
        // snapshots, the newest complete one is loaded and the steps go on after it.
        const auto optimizer = ctx->opt->optimizer;
        const bool snapshots = !ctx->opt->runtime.snapshot.dir.empty();
        auto resumed = std::make_shared<std::uint64_t>(0);
        self->request(ctx->runtime, caf::infinite, rank_api::call_atom::value, rank_api::RankCall{[=](Runtime& rt) {
                        rt.finalize();
                        rt.configure_optimizer(optimizer);
                        result->memory[slot] = rt.memory_report();
                        if (snapshots) *resumed = rt.resumed_step();
                      }})
            .then(
                [=](rank_api::call_atom) {
                  self->state.step = self->state.first = int(*resumed);
                  if (self->state.step < ctx->opt->steps)
                    start_step(self, ctx, result, slot);
                  else
                    finish(self, ctx, result, slot);
                },
                [=](caf::error& e) { fail(self, ctx, result, slot, 0, e); });
        return st.run;
      },
      [=](loss_atom, float value) {
        if (self->state.recovering) return;  // a worker's message from the round that ended
        self->state.loss = value;
        self->state.have_loss = true;
        backward_over();
      },
      [=](backward_done_atom) {
        if (self->state.recovering) return;
        self->state.have_backward = true;
        backward_over();
      },
      [=](failed_atom, caf::error& e) { fail(self, ctx, result, slot, self->state.round, e); },
  };
}

}  // namespace shardflow::actor_trainer
