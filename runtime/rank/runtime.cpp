// Runtime: the trainer-facing side of one rank. It owns the parameters' registration, the bucket
// buffers and the per-iteration bookkeeping; the reduction itself is message flow between the
// actors (actors/messages.hpp), which this file only spawns and feeds.
#include <caf/all.hpp>

#include "kernels/cpu/vector_isa.hpp"
#include "runtime/process/fault_injection.hpp"
#include "runtime/process/freed_memory.hpp"
#include "runtime/rank/rank_actor.hpp"
#include "runtime/rank/runtime_impl.hpp"
#include "shardflow/launch.hpp"

namespace shardflow {
namespace {

std::atomic<std::uint32_t> next_owner_id{1};

}  // namespace

Runtime::Runtime(std::shared_ptr<Communicator> comm, Config config) : impl_(std::make_unique<Impl>()) {
  if (!comm) throw UsageError("Runtime: communicator is null");
  config.validate();
  // Before anything starts: a setting this process cannot honour fails here (Note [Keeping the
  // trainer's freed memory]).
  const auto& kept = keep_freed_memory(config.keep_freed_memory);
  if (comm->rank() == 0)
    rank_logger(0)->info("freed memory {} (Note [Keeping the trainer's freed memory]): {}", kept.keep ? "kept for reuse" : "left to malloc", kept.why);
  // A malformed SHARDFLOW_CPU_VECTORS fails here, not in the first step (Note [Vector loops, the same bits]).
  const auto loops = kernels::vector_isa();
  if (comm->rank() == 0) rank_logger(0)->debug("the optimizer steps run {} loops", kernels::name(loops));
  auto& I = *impl_;
  I.cfg = config;
  I.owner = next_owner_id.fetch_add(1);
  I.begin(*this, std::move(comm), nullptr);
}

void Runtime::Impl::begin(Runtime& rt, std::shared_ptr<Communicator> c, std::shared_ptr<Timeline> kept) {
  auto& I = *this;
  I.overlap = Impl::make_overlap_state(I.cfg);
  I.comm = std::move(c);
  I.rank = I.comm->rank();
  I.world = I.comm->world_size();
  I.log = rank_logger(I.rank);
  I.actors = ProcessActorSystem::acquire(I.cfg.actor_threads);
  I.facade = &rt;
  if (kept) {
    I.timeline = std::move(kept);
  } else {
    std::string trace_file;
    if (!I.cfg.trace.path.empty()) {
      // Ranks that are threads of one process share a file; a rank that is a process of its own
      // writes its own (Note [Timeline]).
      bool own_process = false;
      try {
        const auto env = LaunchEnv::detect();
        own_process = env.launched() && env.world_size > 1;
      } catch (const std::exception&) {
        // a malformed launch environment is the process group's error to report, not the trace's
      }
      trace_file = resolve_trace_path(I.cfg.trace.path, I.rank, own_process);
    }
    I.timeline = std::make_shared<Timeline>(I.rank, trace_file);
  }
  I.collectives->set_timeline(I.timeline);
  I.client.actor = spawn_rank_actor(I.actors->system(), rt);
}

Runtime::~Runtime() {
  impl_->retire();
  impl_->timeline->close();  // the trace file is complete once the last rank's Runtime is gone
}

void Runtime::Impl::retire() {
  auto& I = *this;
  // First, so that nothing runs on the rank actor's thread while the rest goes.
  stop_rank_actor(I.actors->system(), I.client.actor);
  I.client.release();
  I.finish_background_save();
  if (I.prefetching() && !I.failure.failed() && !I.in_pass()) {
    // The last iteration may still be updating the trainer's parameters: let it land before the
    // trainer frees them.
    I.signal->wait_all(I.passes_handed, std::chrono::steady_clock::now() + I.cfg.timeouts.collective);
  }
  if (I.in_pass() && !I.failure.failed()) {
    // Peers are (or will be) inside this iteration's collectives: let them fail now rather than
    // after the timeout. The buffers stay alive until the backend lets go of them (keep_alive).
    I.comm->abort("rank " + std::to_string(I.rank) + "'s Runtime was destroyed in the middle of iteration " +
                  std::to_string(I.iterations));
  }
  I.stop_actors(/*await_exit=*/false);
}

int Runtime::rank() const { return impl_->rank; }
int Runtime::world_size() const { return impl_->world; }
const Config& Runtime::config() const { return impl_->cfg; }
std::size_t Runtime::num_params() const { return impl_->registry.size(); }
std::uint64_t Runtime::iteration() const { return impl_->iterations; }

Param Runtime::register_param(ParamSpec spec) {
  auto& I = *impl_;
  std::lock_guard lock(I.finalize_mu);
  if (I.finalized.load())
    throw UsageError("register_param('" + spec.name + "'): registration is closed once training has started");
  if (I.device_bound && !(spec.device == I.mem->device) && I.comm->supports(spec.device))
    throw UsageError("register_param('" + spec.name + "'): parameter is on " + spec.device.str() + " but '" +
                     I.name_of(0) + "' is on " + I.mem->device.str() +
                     "; one Runtime reduces the parameters of one device (use one Runtime per device)");
  const Device device = spec.device;
  ParamSpec again = spec;
  auto index = Param{I.registry.add(std::move(spec), I.cfg.buckets.gradient_as_bucket_view, *I.comm), I.owner};
  I.remember([again](Runtime& rt) { rt.register_param(again); });
  I.mem->device = device;
  I.device_bound = true;
  return index;
}

void Runtime::register_buffer(BufferSpec spec) {
  auto& I = *impl_;
  std::lock_guard lock(I.finalize_mu);
  if (I.finalized.load())
    throw UsageError("register_buffer('" + spec.name + "'): registration is closed once training has started");
  BufferSpec again = spec;
  I.registry.add_buffer(std::move(spec), *I.comm);
  I.remember([again](Runtime& rt) { rt.register_buffer(again); });  // once it was taken
}

Param Runtime::param(const std::string& name) const {
  auto& I = *impl_;
  auto idx = I.registry.find(name);
  if (!idx) {
    std::string known;
    for (std::size_t i = 0; i < std::min<std::size_t>(I.registry.size(), 5); ++i)
      known += (i ? ", " : "") + I.name_of(std::uint32_t(i));
    if (I.registry.size() > 5) known += ", ...";
    throw UsageError("unknown parameter '" + name + "' on rank " + std::to_string(I.rank) + " (registered: " +
                     (known.empty() ? "none" : known) + ")");
  }
  return Param{*idx, I.owner};
}

void Runtime::finalize() {
  test_fault::reached("registration");
  impl_->ensure_finalized();
  impl_->remember([](Runtime& rt) { rt.finalize(); });
}

void Runtime::Impl::require_between_iterations(const std::string& call, const std::string& advice) const {
  if (in_pass())
    throw UsageError(call + " on rank " + std::to_string(rank) + " in the middle of a synchronised backward pass (its first gradient reported, "
                     "wait() not yet returned): " + advice);
}

void Runtime::set_stream(void* cuda_stream) {
  auto& I = *impl_;
  I.require_between_iterations("set_stream", "change it between iterations");
  I.mem->stream = cuda_stream;
  if (I.shard) {  // GPU shards: the new stream and the shard's are ordered both ways from here on
    I.shard->follow_compute();
    I.shard->join_compute();
  }
}

void* Runtime::grad(Param p) {
  auto& I = *impl_;
  I.ensure_finalized();
  return I.grad_ptr(I.check_trainable(p, "grad"));
}

float* Runtime::grad_f32(Param p) {
  auto& I = *impl_;
  const auto i = I.check_handle(p, "grad_f32");
  if (I.registry.params()[i].dtype != DType::f32)
    throw UsageError("grad_f32: parameter '" + I.name_of(i) + "' is " + dtype_name(I.registry.params()[i].dtype) +
                     ", use grad()");
  return static_cast<float*>(grad(p));
}

void Runtime::zero_grad() {
  auto& I = *impl_;
  I.ensure_finalized();
  I.timeline->stats().touch(Timeline::now());
  I.require_between_iterations("zero_grad()", "call wait() first");
  if (I.cfg.buckets.gradient_as_bucket_view) {
    // Pooled buckets (ZeRO-2) hold no buffer between iterations and start zeroed; flat padding is
    // never written, so it stays zero. With forward prefetch the shard zeroes each bucket when it
    // is done with it (it may still be busy now).
    if (!(I.shard && I.cfg.zero.forward_prefetch)) I.bufs->zero_held();
  } else {
    for (std::size_t i = 0; i < I.registry.size(); ++i) {
      const auto& s = I.registry.params()[i];
      if (s.grad) I.mem->zero(s.grad, std::size_t(numel(s.shape)) * dtype_size(s.dtype));
    }
  }
}

void Runtime::grad_ready(const std::string& name) { grad_ready(param(name)); }

RuntimeStats Runtime::stats() const { return impl_->timeline->stats().snapshot(); }
IterationStats Runtime::last_stats() const { return impl_->timeline->stats().last(); }

namespace {
const char* trainer_cat(const char* cat) {
  static const char* const known[] = {"forward", "backward", "step"};
  for (const char* k : known)
    if (cat && std::strcmp(cat, k) == 0) return k;
  throw UsageError(std::string("Runtime::span: category '") + (cat ? cat : "(null)") + "' is not one of forward, backward, step");
}
}  // namespace

Runtime::Span Runtime::span(std::string name, const char* cat) {
  const auto t = Timeline::now();
  impl_->timeline->stats().touch(t);
  return Span(this, std::move(name), trainer_cat(cat), t);
}

Runtime::Span::~Span() {
  if (!rt_) return;
  auto& tl = *rt_->impl_->timeline;
  tl.span(std::move(name_), cat_, Lane::compute, begin_, Timeline::now(), SpanArgs{-1, -1, nullptr, std::int64_t(rt_->impl_->iterations), -1});
}

void Runtime::grad_ready(Param p) {
  test_fault::reached("backward");
  auto& I = *impl_;
  I.ensure_finalized();
  I.throw_if_failed();
  I.check_settings_used();
  const auto i = I.check_trainable(p, "grad_ready");
  if (I.phase.load(std::memory_order_acquire) == Impl::Phase::reducing)
    throw UsageError("grad_ready('" + I.name_of(i) + "') on rank " + std::to_string(I.rank) +
                     " after finish_backward(): call wait() before the next backward pass");
  const auto reports = std::uint32_t(I.marked[i].fetch_add(1, std::memory_order_acq_rel)) + 1;
  I.count_report(i, reports);
  // Complete after its last report (Note [Static graph]: re-entrant backward reports several times;
  // while the graph is learnt every gradient waits for the end of backward).
  if (I.learning_graph() || reports < I.reports_allowed(i)) {
    if (!I.require_sync.load(std::memory_order_relaxed)) I.touched[i] = 1;
    return;
  }
  I.order[I.order_pos.fetch_add(1, std::memory_order_relaxed)] = i;
  if (!I.require_sync.load(std::memory_order_relaxed)) {
    I.touched[i] = 1;  // accumulates locally; reduced with the next synchronised pass
    return;
  }
  I.count_training_ranks();  // uneven inputs: before the pass's first gradient goes to its bucket
  auto idle = Impl::Phase::idle;
  if (I.phase.compare_exchange_strong(idle, Impl::Phase::backward, std::memory_order_acq_rel)) {
    I.timeline->stats().backward_started(Timeline::now());
    I.send_learnt_zeros();
  }
  if (I.timeline->tracing())
    I.timeline->instant("grad_ready " + I.name_of(i), "backward", Lane::compute,
                        SpanArgs{std::int64_t(I.plan.where[i].bucket), -1, nullptr, std::int64_t(I.iterations), -1});
  I.send_to_bucket(i, false);
}

void Runtime::finish_backward() {
  auto& I = *impl_;
  I.ensure_finalized();
  I.throw_if_failed();
  I.check_settings_used();
  if (I.phase.load(std::memory_order_acquire) == Impl::Phase::reducing) return;
  const auto n = I.registry.size();
  if (!I.require_sync.load()) {
    I.reset_pass();
    return;  // accumulation pass: nothing to reduce yet; wait() returns at once
  }
  I.count_training_ranks();  // a pass without reports
  const bool learning = I.learning_graph();
  if (learning) I.finish_learning_pass();
  if (I.phase.load(std::memory_order_acquire) == Impl::Phase::idle) I.send_learnt_zeros();  // a pass without reports
  std::vector<std::uint32_t> missing, accumulated;
  for (std::uint32_t i = 0; i < n; ++i) {
    if (!I.registry.params()[i].requires_grad) continue;
    const auto reports = I.marked[i].load(std::memory_order_acquire);
    if (I.learnt_as_unused(i, reports)) continue;  // sent as zeros when the pass started
    if (reports) continue;
    (I.touched[i] ? accumulated : missing).push_back(i);
  }
  if (!missing.empty() && !I.cfg.buckets.find_unused_parameters && !learning && !I.has_joined()) {
    std::string names;
    for (std::size_t k = 0; k < missing.size() && k < 10; ++k) names += (k ? ", " : "") + I.name_of(missing[k]);
    if (missing.size() > 10) names += ", ...";
    I.fail(UsageError("finish_backward: " + std::to_string(missing.size()) + " parameter(s) got no gradient in iteration " +
                      std::to_string(I.iterations) + " on rank " + std::to_string(I.rank) + ": " + names +
                      ". Call grad_ready() for each, or set Config::buckets.find_unused_parameters = true to reduce "
                      "parameters without a gradient as zeros."));
  }
  // Gradients accumulated in earlier no_sync passes are reduced as they are; parameters that got
  // nothing at all are reduced as zeros (find_unused_parameters).
  for (auto i : accumulated) {
    I.order[I.order_pos.fetch_add(1)] = i;
    I.send_to_bucket(i, false);
  }
  for (auto i : missing) {
    I.order[I.order_pos.fetch_add(1)] = i;
    I.send_to_bucket(i, true);
  }
  if (I.finds_unused()) I.send_used_counts();
  if (I.syncs_buffers()) I.send_buffers();
  I.timeline->stats().backward_ended(Timeline::now());
  // How many buckets were already reduced, stepped and synced when backward ended (stats()).
  std::size_t pending = 0;
  for (auto b : I.signal->pending(I.passes_handed + 1)) pending += b < I.plan.buckets.size();
  I.done_in_backward = I.plan.buckets.size() - pending;
  I.phase.store(Impl::Phase::reducing, std::memory_order_release);
}

// Note [The rank actor]
// Every wait of the blocking API is a request to the rank actor (runtime/rank/rank_actor.cpp), asked
// from a scoped actor on the trainer's thread: the same request a trainer made of actors sends,
// answered by the same response promise. wait() is split around the completion: begin_wait() hands
// the pass over, the rank actor holds the promise until the IterationSignal has counted what the
// pass needs (told by its on_done, no thread parked on it), then end_wait() does the bookkeeping
// between iterations (rebuild, static graph, snapshot), whose small collectives run on the rank
// actor's own thread, never on a scheduler thread. A trainer thread only blocks in receive().

// A RankCall runs on the rank actor's own thread, which may block, and a blocking call made there
// (join's shadow iterations, save_checkpoint's wait for the updates, refresh_trainable) cannot ask
// the actor it runs in: there each wait blocks on the IterationSignal instead, the same halves
// around it. Only there.
void Runtime::wait() {
  if (impl_->client.on_rank_thread()) return impl_->wait_on_rank_thread();
  impl_->client.ask<rank_api::step_done_atom, std::uint64_t>("wait()", rank_api::iteration_atom::value);
}

void Runtime::Impl::wait_on_rank_thread() {
  auto& I = *this;
  const auto t0 = Timeline::now();
  if (!begin_wait()) return;
  I.await_iterations(I.wait_prefetching ? I.passes_handed - 1 : I.passes_handed);
  if (I.wait_prefetching) I.await_handed(I.passes_handed);
  I.blocked_since("wait (iteration)", -1, t0);
  end_wait();
}

bool Runtime::Impl::begin_wait() {
  auto& I = *this;
  I.ensure_finalized();
  I.throw_if_failed();
  facade->finish_backward();
  if (!I.require_sync.load()) return false;  // an accumulation pass: nothing went out
  ++I.passes_handed;
  // Prefetching, only the previous iteration must be complete (forward waited for its buckets);
  // this one finishes while the next forward runs (Note [Forward prefetch]). The next forward
  // reads and updates the buffers, and the trainer may ask for the unused parameters: the entries
  // handed over at the end of backward must be done, prefetch or not.
  I.wait_prefetching = I.prefetching();
  return true;
}

void Runtime::Impl::end_wait() {
  auto& I = *this;
  const bool prefetching = I.wait_prefetching;
  // GPU shards: what comes next on the compute stream (forward, zero_grad) follows the updates.
  if (I.shard && !prefetching) I.shard->join_compute();
  if (!I.cfg.buckets.gradient_as_bucket_view && !I.shard) {
    for (const auto& b : I.plan.buckets) {
      const std::size_t es = dtype_size(b.dtype);
      for (const auto& e : b.entries)
        if (e.numel) I.mem->copy(I.registry.params()[e.param].grad, I.bufs->grad(b.index).get() + e.offset * es, e.numel * es);
    }
  }
  I.readiness->reset();
  I.recount_training_ranks();
  I.phase.store(Impl::Phase::idle, std::memory_order_release);
  std::fill(I.touched.begin(), I.touched.end(), 0);
  const bool prefetch_wanted = I.cfg.zero.forward_prefetch && I.shard;
  const Shard* stepped_by = I.shard.get();
  I.choose_interleave_lag();
  const bool just_learnt = I.learning_graph();
  if (just_learnt) I.learn_graph();
  const auto* schedule_before = I.signal.get();
  if (!I.rebuilt && I.cfg.buckets.rebuild) {
    const auto r0 = Timeline::now();
    I.rebuild_from_observed_order();
    I.timeline->span("rebuild buckets", "rebuild", Lane::compute, r0, Timeline::now(),
                     SpanArgs{-1, -1, nullptr, std::int64_t(I.iterations), -1});
  } else if (prefetch_wanted && I.observing_forward()) {
    const auto r0 = Timeline::now();
    I.establish_sync_order();
    I.timeline->span("forward order for prefetch", "rebuild", Lane::compute, r0, Timeline::now(),
                     SpanArgs{-1, -1, nullptr, std::int64_t(I.iterations), -1});
  }
  // Note [Static graph]: with the unused set fixed the used counts' exchange leaves the schedule
  // (a rebuild just now made a new one already).
  if (just_learnt && I.signal.get() == schedule_before) I.install_plan(BucketPlan(I.plan), I.iterations + 1);
  if (prefetch_wanted && I.wants_forward_observation()) I.start_observing_forward();
  // A rebuilt shard copied its masters and state on its own stream: the compute stream waits for
  // that too, so that wait()'s promise holds for whichever shard the next iteration uses.
  if (I.shard && I.shard.get() != stepped_by && !prefetching) I.shard->join_compute();
  I.reset_pass();
  I.end_iteration();
  ++I.iterations;
  snapshot_if_due();
}

void Runtime::wait_param(Param p) {
  // Most parameters are ready when forward reaches them: no message for those.
  const auto b = impl_->param_bucket_to_await(p);
  if (b == ~0u) return;
  auto& I = *impl_;
  if (!I.client.on_rank_thread()) return I.client.ask<rank_api::params_ready_atom, Param>("wait_param()", rank_api::params_ready_atom::value, p);
  I.await_bucket(b, "wait_param", [&] { return "the update of parameter '" + I.name_of(p.index) + "' (bucket " + std::to_string(b) + ")"; });
  if (I.shard) I.shard->join_bucket(b);
}

bool Runtime::params_ready(const std::vector<Param>& ps) {
  bool all = true;
  for (const Param p : ps) all = (impl_->param_bucket_to_await(p) == ~0u) && all;  // every use noted, in order
  return all;
}

std::uint32_t Runtime::Impl::param_bucket_to_await(Param p) {
  auto& I = *this;
  I.ensure_finalized();
  I.throw_if_failed();
  const auto b = I.plan.where[I.check_handle(p, "wait_param")].bucket;
  if (b == ~0u) return ~0u;  // frozen: nothing ever changes it
  if (I.observing_forward()) I.note_forward_use(b);
  if (!I.prefetching()) return ~0u;  // wait() waited for everything
  if (!I.signal->done(b, I.passes_handed)) return b;
  if (I.shard) I.shard->join_bucket(b);  // GPU: the compute stream waits for the bucket's update
  return ~0u;
}

void Runtime::wait_all_params() {
  auto& I = *impl_;
  I.ensure_finalized();
  I.throw_if_failed();
  if (!I.prefetching()) return;
  if (!I.client.on_rank_thread()) return I.client.ask<rank_api::all_params_atom>("wait_all_params()", rank_api::all_params_atom::value);
  I.blocked("wait_all_params", -1, [&] { I.await_iterations(I.passes_handed); });
  if (I.shard) I.shard->join_compute();
}

std::future<void> Runtime::collective(CollectiveOp op) {
  auto promise = std::make_shared<std::promise<void>>();
  auto future = promise->get_future();
  impl_->trainer_collective(std::move(op), [promise](std::exception_ptr e) { e ? promise->set_exception(e) : promise->set_value(); });
  return future;
}

void Runtime::Impl::trainer_collective(CollectiveOp op, CollectiveDone on_done) {
  ensure_finalized();
  throw_if_failed();
  require_between_iterations("Runtime::collective ('" + op.tag + "')", "call it between wait() and the next backward");
  {
    std::lock_guard lock(trainer_ops->mu);
    ++trainer_ops->outstanding;
  }
  CollectiveDone done = [on_done = std::move(on_done), ops = trainer_ops](std::exception_ptr e) {
    on_done(e);
    std::lock_guard lock(ops->mu);
    if (--ops->outstanding == 0) ops->cv.notify_all();
  };
  if (world == 1 || !comm_actor_h) {
    collectives->record(op);
    comm->submit(std::move(op), std::move(done));
  } else {
    // The comm stream numbers iterations as `iterations` does: the next one to go out is this.
    caf::anon_send(comm_actor_h, msg::trainer_op_atom::value, std::uint64_t(iterations), std::move(op), std::move(done));
  }
}

void Runtime::set_require_sync(bool sync) {
  auto& I = *impl_;
  I.require_between_iterations("set_require_sync/no_sync", "change it between iterations");
  I.require_sync.store(sync);
}

std::vector<BucketInfo> Runtime::buckets() const {
  auto& I = *impl_;
  I.ensure_finalized();
  std::vector<BucketInfo> out;
  for (const auto& b : I.plan.buckets) {
    BucketInfo info{b.index, b.dtype, b.device, b.bytes(), {}};
    for (const auto& e : b.entries) info.params.push_back(I.name_of(e.param));
    out.push_back(std::move(info));
  }
  return out;
}

std::vector<OwnedPiece> Runtime::owned() const {
  auto& I = *impl_;
  I.ensure_finalized();
  std::vector<OwnedPiece> out;
  if (!I.shard) return out;
  const auto& sp = I.shard->shard_plan();
  for (const auto& bs : sp.buckets)
    for (const auto& piece : bs.pieces[std::size_t(sp.rank)])
      out.push_back({I.name_of(piece.param), piece.param_off, piece.param_off + piece.len});
  return out;
}

std::vector<std::string> Runtime::collective_log() const { return impl_->collectives->lines(); }

float Runtime::last_grad_norm() const {
  impl_->settle_last_step(Impl::LastStep::norm);
  return impl_->shard ? impl_->shard->last_norm() : 0.0f;
}

// Note [What the last step left, under prefetch]
// With forward prefetch wait() returns once the pass is handed over, before it is reduced: the
// shard actor computes the norm, steps each bucket and counts the step (Shard::end_step: the step
// count, the skip, the loss scale's next value) while the next forward runs. What the trainer reads
// of that step after wait() therefore waits for it here. Read at once it was the step before's,
// silently, and a trainer that multiplied its next loss by that loss_scale() trained on gradients
// unscaled by another scale (tests/test_loss_scaling.cpp; ThreadSanitizer found the race as a
// read of the norm after wait() in test_hierarchical). The norm is settled before any bucket
// steps, so the norm waits only for the bucket forward needs first, which forward waits for
// anyway; the rest is counted at the last bucket's step, so it waits for every update, as
// wait_all_params() does (read it after forward and that costs nothing). The wait blocks on the
// signal, as the runtime's own waits between iterations do, with the same deadline and the same
// errors naming what is pending. Without prefetch, or once the pass is complete, nothing waits.
void Runtime::Impl::settle_last_step(LastStep what) {
  if (!shard || !prefetching() || failure.failed()) return;
  if (signal->all_done(passes_handed)) return;
  if (what == LastStep::norm && (!shard->exchanges_norm() || plan.buckets.empty())) return;  // no norm is computed
  if (what == LastStep::whole) return blocked("wait (last step)", -1, [&] { await_iterations(passes_handed); });
  const auto& order = sync_order();
  const std::uint32_t b = order.empty() ? 0 : order.front();
  await_bucket(b, "wait (last norm)", [&] { return "the gradient norm of iteration " + std::to_string(iterations - 1) + " (bucket " + std::to_string(b) + ")"; });
}

MemoryReport Runtime::memory_report() const {
  auto& I = *impl_;
  I.ensure_finalized();
  MemoryReport m;
  for (const auto& p : I.registry.params()) m.params += std::size_t(numel(p.shape)) * dtype_size(p.dtype);
  if (I.shard) {
    m.grads = I.shard->grad_bytes();
    m.optimizer_state = I.shard->state_bytes();
    m.comm_buffers = I.shard->comm_bytes();
  } else {
    m.grads = I.bufs->allocated_bytes();
  }
  return m;
}

std::string MemoryReport::str() const {
  auto mib = [](std::size_t b) { return std::to_string(double(b) / 1048576.0).substr(0, 6) + " MiB"; };
  return "params " + mib(params) + ", grads " + mib(grads) + ", optimizer state " + mib(optimizer_state) +
         ", comm buffers " + mib(comm_buffers);
}

}  // namespace shardflow
