// The bucket plan's life on one rank: finalizing (the ranks agree on the parameters), installing a
// plan (buffers, shard, actors), the one rebuild from the observed gradient order, and moving the
// optimizer state when ownership moves with it.
// Note [State migration]
// When the buckets are rebuilt after the first iteration, ownership moves. Each rank exports the
// state it owns in parameter coordinates (zeros elsewhere); summing the exports over the ranks
// (x + 0 = x exactly) gives every rank the full state, from which it imports its new pieces. A
// one-time cost of one all-reduce of the parameter count per state slot.
#include "runtime/rank/runtime_impl.hpp"

#include "runtime/rank/rank_actor.hpp"
#include "runtime/process/fault_injection.hpp"
#include "kernels/cpu/elementwise.hpp"
#include "actors/bucket_actor.hpp"
#include "actors/comm_stream_actor.hpp"
#include "actors/shard_actor.hpp"

#include <caf/scoped_actor.hpp>

namespace shardflow {

namespace {

bool same_layout(const BucketPlan& a, const BucketPlan& b) {
  if (a.buckets.size() != b.buckets.size()) return false;
  for (std::size_t i = 0; i < a.buckets.size(); ++i) {
    const auto &x = a.buckets[i].entries, &y = b.buckets[i].entries;
    if (x.size() != y.size()) return false;
    for (std::size_t e = 0; e < x.size(); ++e)
      if (x[e].param != y[e].param) return false;
  }
  return true;
}

}  // namespace

void Runtime::Impl::ensure_finalized() {
  if (finalized.load(std::memory_order_acquire)) return;
  std::lock_guard lock(finalize_mu);
  if (finalized.load(std::memory_order_relaxed)) return;
  throw_if_failed();
  const auto n = registry.size();
  if (n == 0) throw UsageError("rank " + std::to_string(rank) + ": no parameters registered before training started");
  for (const auto& b : registry.buffers())
    if (!(b.device == mem->device))
      throw UsageError("register_buffer: buffer '" + b.name + "' is on " + b.device.str() + " but the parameters are on " +
                       mem->device.str() + "; a Runtime's buffers live where its parameters do");
  try {
    collectives->record(CollectiveOp{CollectiveKind::allgather, DType::f32, nullptr, nullptr, 4, 0, 1.0f,
                                     "verify parameter lists", {}});
    verify_same_params(*comm, registry.signature(), cfg.timeouts.collective);
    sync_initial_state();
  } catch (const MismatchError& e) {
    fail(e);
  } catch (const TimeoutError& e) {
    fail(e);
  } catch (const CommError& e) {
    fail(e);
  }
  size_param_counts(n);
  marked.reset(new std::atomic<std::uint8_t>[n]);
  for (std::size_t i = 0; i < n; ++i) marked[i].store(0, std::memory_order_relaxed);
  touched.assign(n, 0);
  order.assign(n, 0);
  install_plan(make_plan(reverse_registration_order(registry.params())), 0);
  log->info("{} parameters in {} bucket(s) on backend {} (world {}); caps: first {} bytes ({}), then {} bytes ({}), last {} bytes ({})\n{}", n,
            plan.buckets.size(), comm->backend_name(), world, caps.first, caps.first_rule, caps.cap, caps.cap_rule, caps.last, caps.last_rule,
            plan.describe());
  finalized.store(true, std::memory_order_release);
}

BucketPlan Runtime::Impl::make_plan(const std::vector<std::uint32_t>& order) {
  caps = bucket_caps(registry.params(), order, PlanSettings::from(cfg, world, groups ? groups->state_slots() : 0, groups != nullptr));
  if (groups) check_in_flight_honoured(caps, cfg.zero.max_buckets_in_flight, int(cfg.zero.stage), cfg.name_of("zero.max_buckets_in_flight"));
  if (!caps.warning.empty() && rank == 0) log->info("{}", caps.warning);
  if (caps.pooled && rank == 0) log->info("{}", caps.pool_line());
  return caps.plan(registry.params(), order);
}

void Runtime::Impl::install_plan(BucketPlan next, std::uint64_t first_iteration, StateOnRebuild state) {
  // Note [No state moved before a load]: a plan adopted from a snapshot is installed just before
  // that snapshot is loaded, and the load writes every state element the new shard owns. Moving
  // the old shard's state over first would be wasted work, and not only on this host: across
  // ranks it is an all-reduce of every slot (1.27 s of a node's 4.1 s join pause at 64 MiB of
  // parameters with AdamW over 1 Gbit/s). The new shard then starts as a new run's does.
  const bool migrate = state == StateOnRebuild::migrate && shard != nullptr;
  stop_actors();  // the old plan's actors hold its buffers; nothing is in flight between iterations
  std::shared_ptr<Shard> next_shard;
  std::shared_ptr<BucketBuffers> next_bufs;
  if (groups) {
    // With the runtime's optimizer nothing in the old buffers is needed any more (gradients were
    // stepped, parameters synced): they go before the new ones come, so a rebuild does not hold
    // two plans' gradients (Note [Memory at the ZeRO formula]).
    if (bufs) bufs->release_all();
    if (shard && !migrate)  // nor its state: the new shard's comes from the load
      for (std::size_t slot = 0; slot < shard->migrate_slots(); ++slot) shard->release_slot(slot);
    auto shard_plan = make_shard_plan(next, registry.params(), cfg.zero.partition, world, rank, cfg.zero.stage >= ZeroStage::optimizer_state);
    std::vector<std::size_t> bytes;
    for (std::size_t b = 0; b < shard_plan.buckets.size(); ++b)
      bytes.push_back(shard_plan.buckets[b].padded * dtype_size(next.buckets[b].dtype));
    next_bufs = std::make_shared<BucketBuffers>(std::move(bytes), caps.pooled, allocator(), zeroer());
    next_shard = std::make_shared<Shard>(int(cfg.zero.stage), cfg, registry.params(), next, std::move(shard_plan), groups,
                                         next_bufs, mem, /*migrating=*/migrate, comm->in_host_ranks());
  } else {
    std::vector<std::size_t> bytes;
    for (const auto& b : next.buckets) bytes.push_back(b.bytes());
    next_bufs = std::make_shared<BucketBuffers>(std::move(bytes), false, allocator(), zeroer());
    // Plain DDP: the trainer reads the reduced gradients after wait(); a rebuild moves them along.
    if (bufs && cfg.buckets.gradient_as_bucket_view)
      for (const auto& b : next.buckets)
        for (const auto& e : b.entries)
          if (e.numel)
            mem->copy(next_bufs->grad(b.index).get() + e.offset * dtype_size(b.dtype), grad_ptr(e.param),
                     e.numel * dtype_size(b.dtype));
  }
  if (migrate && next_shard) migrate_state(*shard, *next_shard);
  plan = std::move(next);
  bufs = std::move(next_bufs);
  shard = std::move(next_shard);
  if (shard) fix_unused_in(*shard);  // Note [Static graph]
  events = std::make_shared<BucketEvents>(mem, plan.buckets.size());
  std::vector<std::uint32_t> sizes;
  for (const auto& b : plan.buckets) sizes.push_back(std::uint32_t(b.entries.size()));
  readiness = std::make_unique<BucketReadiness>(std::move(sizes));
  spawn_actors(first_iteration);
}

void Runtime::Impl::migrate_state(Shard& from, Shard& to) {
  // In windows of parameter coordinates, one slot at a time; the old slot goes before the next is
  // made. The new slot's pages become resident as windows land in them (alloc_zeroed) and the old
  // slot's go as they are exported, so on the CPU a rebuild holds about a window more than
  // training does (before: one whole slot more, 64 MiB of 440 at 2048 x 4 with Adam). A failure
  // half-way fails the run: the old slot is partly discarded by then.
  const std::size_t total = from.total_elements();
  std::vector<float> window;
  // The masters slot exists only while some trained parameter needs one (Note [Master weights]):
  // after refresh_trainable() the old or the new shard may lack it.
  const std::size_t both = std::min(from.migrate_slots(), to.migrate_slots());
  for (std::size_t slot = 0; slot < from.migrate_slots(); ++slot) {
    if (slot < both) {
      to.allocate_slot(slot);
      for (std::size_t begin = 0; begin < total; begin += kStateWindow) {
        window.resize(std::min(kStateWindow, total - begin));
        state_window(from, slot, begin, window, "migrate optimizer state", true);
        to.import_state(slot, begin, window);
      }
    }
    from.release_slot(slot);
  }
  to.set_steps(from.steps());
  to.set_skipped(from.skipped());
  to.set_loss_scale(from.loss_scale(), from.growth_tracker());
  to.loaded();
  // Masters the old shard did not keep (parameters it did not train, or no masters slot at all)
  // start from the parameters, as a new shard's do (Note [Changing the trainable set]).
  if (to.migrate_slots() > to.state_slots()) {
    const std::size_t masters = to.state_slots();
    if (masters >= both) to.allocate_slot(masters);
    std::size_t base = 0;
    for (const auto& p : to.params()) {
      const auto n = std::size_t(numel(p.shape));
      const std::uint32_t i = std::uint32_t(&p - to.params().data());
      if (p.requires_grad && (masters >= both || !from.params()[i].requires_grad)) {
        if (p.device.kind != Device::Kind::cpu)
          throw UsageError("refresh_trainable: parameter '" + p.name + "' lives on " + p.device.str() +
                           "; starting the fp32 master of a device parameter trained again is not supported yet");
        std::vector<float> values(n);
        kernels::convert_to_f32(p.dtype, values.data(), static_cast<const std::byte*>(p.data), n);
        to.import_state(masters, base, values);
      }
      base += n;
    }
  }
}

// Note [Control words after prefetched syncs]
// With forward prefetch, wait() returns while the iteration's parameter syncs are still on the comm
// stream, and the bookkeeping after it (snapshot_if_due: "every rank's files written", finishing a
// snapshot) ran its control words straight on the communicator, so each rank put them among its
// syncs wherever its own timing fell: a collective mismatch (found by test_libtorch's recovery
// scenario, forward prefetch with a snapshot every step). A control word goes out only once every
// handed-over pass is complete, so it follows the same syncs on every rank. The cost is the overlap
// of those syncs with the next forward, on the iterations that issue a control word.
void Runtime::Impl::run_now(const CollectiveOp& op) {
  auto started = start_now(op);
  comm->wait(started, cfg.timeouts.collective);
}

Communicator::Started Runtime::Impl::start_now(const CollectiveOp& op) {
  if (prefetching()) facade->wait_all_params();
  {
    std::unique_lock lock(trainer_ops->mu);
    if (!trainer_ops->cv.wait_for(lock, cfg.timeouts.collective, [&] { return trainer_ops->outstanding == 0; }))
      throw TimeoutError("rank " + std::to_string(rank) + ": " + op.tag + ": the trainer's own collectives (Runtime::collective) " +
                         "did not complete within Config::timeouts.collective");
  }
  collectives->record(op);
  return comm->start(op);
}

CollectiveOp Runtime::Impl::control_op(CollectiveKind kind, void* words, std::size_t count, const std::string& tag, int root) {
  CollectiveOp op;
  op.kind = kind;
  op.dtype = DType::f32;
  op.send = op.recv = words;
  op.count = count;
  op.root = root;
  op.tag = tag;
  return op;
}

void Runtime::Impl::control_collective(CollectiveKind kind, void* words, std::size_t count, const std::string& tag, int root) {
  if (world == 1) return;
  run_now(control_op(kind, words, count, tag, root));
}

void Runtime::Impl::state_window(Shard& from, std::size_t slot, std::size_t begin, std::vector<float>& window, const char* what,
                                 bool discard) {
  if (!discard) test_fault::reached("checkpoint");
  from.export_state(slot, begin, window);
  if (discard) from.discard_state(slot, begin, window.size());
  if (!from.shard_plan().sharded) return;  // every rank holds all of it
  CollectiveOp op;  // each element has one owner; the other ranks add zeros
  op.kind = CollectiveKind::allreduce;
  op.send = op.recv = window.data();
  op.count = window.size();
  op.tag = std::string(what) + " " + std::to_string(slot) + " from element " + std::to_string(begin);
  run_now(op);
}

// Note [Fused syncs]: the groups of this schedule, each in its place in the plan's fusion buffer
// (from the backend: shared memory for shm, as the buckets'; made at the plan's first spawn, the
// size `shardflow plan` says), handed to the shard before its actor starts. A new schedule (a lag
// or prefetch choice) gets new groups in the same buffer.
std::shared_ptr<const FusedSyncs> Runtime::Impl::fuse_small_syncs(const std::vector<ScheduledCollective>& schedule) {
  if (!shard || !shard->syncs()) return nullptr;
  std::vector<DType> wire;
  for (std::size_t b = 0; b < plan.buckets.size(); ++b) wire.push_back(shard->sync_dtype(b));
  const std::size_t bytes = fusion_buffer_bytes(shard->shard_plan(), wire, cfg.zero.fuse_syncs_bytes);
  if (bytes && !shard->fusion_buffer()) shard->set_fusion_buffer(allocator()(bytes), bytes);
  auto f = std::make_shared<FusedSyncs>();
  // Note [Syncs from the twin]: each bucket's sync is then its own shift; nothing is gathered.
  if (!shard->shifts_in_sync()) f->fusion = fuse_syncs(schedule, shard->shard_plan(), wire, cfg.zero.fuse_syncs_bytes);
  if (f->fusion.groups.empty()) {
    shard->set_fused_syncs(nullptr);
    return nullptr;
  }
  const auto& buf = shard->fusion_buffer();
  for (const auto& g : f->fusion.groups) {
    if (g.at + g.bytes(world) > bytes)  // fuse_syncs keeps within kFusedGroups caps and the fusable buckets
      throw CommError("rank " + std::to_string(rank) + ": fused sync group of bucket " + std::to_string(g.members.front()) +
                      " does not fit the fusion buffer (" + std::to_string(bytes) + " bytes)");
    f->buffers.emplace_back(buf, buf.get() + g.at);
  }
  shard->set_fused_syncs(f);
  return f;
}

void Runtime::Impl::spawn_actors(std::uint64_t first_iteration) {
  auto& sys = actors->system();
  // The trainer's entries (used counts, buffers) count in the signal after the buckets.
  signal = std::make_shared<IterationSignal>(plan.buckets.size() + (finds_unused() ? 1 : 0) + (syncs_buffers() ? 1 : 0),
                                             signal_listener(first_iteration));
  passes_handed = 0;
  const std::map<ScheduledCollective::Kind, std::uint32_t> handed{{ScheduledCollective::unused, signal_index(ScheduledCollective::unused)},
                                                                   {ScheduledCollective::buffers, signal_index(ScheduledCollective::buffers)}};
  auto schedule = build_schedule();
  auto fused = fuse_small_syncs(schedule);
  comm_actor_h = sys.spawn(comm_stream_actor, comm, std::move(schedule), collectives, first_iteration,
                           [s = signal, handed](ScheduledCollective::Kind k, const msg::Failure& f) { s->bucket_done(handed.at(k), f); },
                           fused);
  if (shard) {
    // With forward prefetch the trainer's zero_grad() cannot know when a bucket is free again, so
    // the shard zeroes each bucket itself once it is done with it (pooled buckets start zeroed).
    const bool zero_on_done = cfg.zero.forward_prefetch && !bufs->pooled();
    // The syncs' order tells the shard which reduced bucket steps first (Note [Which bucket steps
    // next]).
    shard_actor_h = sys.spawn(shard_actor, ShardActorArgs{shard, cfg.zero.overlap, comm_actor_h, signal, zero_on_done, sync_order(), timeline,
                                                          used_counts_for_shard(), caps.staging_in_flight});
    caf::anon_send(comm_actor_h, msg::set_peer_atom::value, shard_actor_h);
  }
  bucket_actors.clear();
  const BucketSources sources{&plan, bufs, shard, events, timeline, rank, world, effective_hook(), &registry.params(),
                              join_divisor()};
  for (const auto& bk : plan.buckets)
    bucket_actors.push_back(sys.spawn(bucket_actor, std::make_shared<const BucketCollectives>(bk.index, sources),
                                      std::uint32_t(bk.entries.size()), comm_actor_h, shard_actor_h, signal));
}

IterationSignal::OnDone Runtime::Impl::signal_listener(std::uint64_t first_iteration) const {
  // Parameters are ready per bucket only where the runtime steps them (a DDP bucket's completion
  // is its reduced gradients, announced with the iteration).
  const std::size_t param_buckets = shard ? plan.buckets.size() : 0;
  return [poke = rank_actor_poke(client.actor), events = client.subscribers, round = client.subscribers->round(), param_buckets,
          first_iteration, buffers = std::weak_ptr<BucketBuffers>(bufs)](std::uint32_t b, std::uint64_t count, const BucketFailure& f,
                                                                        bool wake) {
    if (f) {
      if (const auto held = buffers.lock()) held->interrupt();  // Note [A failure ends the wait for a buffer]
      events->failed(make_error(f.kind == BucketFailure::timeout    ? errc::timeout
                                : f.kind == BucketFailure::mismatch ? errc::mismatch
                                : f.kind == BucketFailure::usage    ? errc::usage
                                                                    : errc::comm,
                                f.what),
                     round);
    } else if (b < param_buckets) {
      events->params_ready(b, first_iteration + count);
    }
    if (wake) poke();  // Note [Watched completions]
  };
}

// Note [Old actors gone before the next]: the plan's actors share the shard (and, without a new
// plan, its buckets) with the next set, and the next set's spawn writes into the shard (its fused
// syncs). An actor's behaviour is made on a worker thread when the actor first runs, so an actor
// spawned just before (a lag choice and a prefetch choice or a rebuild made in the same wait())
// may still be reading the shard when the next spawn writes it: ThreadSanitizer saw exactly that
// in CI. So before a respawn the old actors are gone: monitored, told to exit, their down
// messages awaited. Between iterations nothing is in flight and they never block, so that is a
// message round each; the bound only makes a defect a warning rather than a hang. A Runtime that
// retires (destroyed, or replaced by recovery) does not wait: its actors may be finishing a failed
// collective, nothing is spawned beside them, and they hold what they use.
void Runtime::Impl::stop_actors(bool await_exit) {
  std::vector<caf::actor> old;
  for (auto& a : bucket_actors) old.push_back(caf::actor_cast<caf::actor>(a));
  if (comm_actor_h) old.push_back(caf::actor_cast<caf::actor>(comm_actor_h));
  if (shard_actor_h) old.push_back(caf::actor_cast<caf::actor>(shard_actor_h));
  if (!await_exit) {
    for (auto& a : old) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
  } else if (!old.empty()) {
    caf::scoped_actor self{actors->system()};
    for (auto& a : old) {
      self->monitor(a);
      self->send_exit(a, caf::exit_reason::user_shutdown);
    }
    std::size_t left = old.size();
    bool late = false;
    while (left > 0 && !late)
      self->receive([&](const caf::down_msg&) { --left; },
                    caf::after(cfg.timeouts.collective) >> [&] { late = true; });
    if (late)
      log->warn("rank {}: {} of {} actors of the old plan did not stop within {} ms; going on", rank, left, old.size(),
                std::chrono::duration_cast<std::chrono::milliseconds>(cfg.timeouts.collective).count());
  }
  shard_actor_h = msg::shard_actor_t{};
  bucket_actors.clear();
  comm_actor_h = msg::comm_stream_actor_t{};
}

void Runtime::Impl::rebuild_from_observed_order() {
  std::vector<std::uint32_t> observed(order.begin(), order.begin() + std::ptrdiff_t(registry.trainable()));
  // Rank 0's order wins, so every rank builds the same buckets.
  control_collective(CollectiveKind::broadcast, observed.data(), observed.size(), "rebuild buckets: ready order");
  auto next = make_plan(observed);
  rebuilt = true;
  if (same_layout(plan, next)) return;
  install_plan(std::move(next), iterations + 1);  // inside wait(): the actors start the next iteration
  log->info("buckets rebuilt from the observed gradient order:\n{}", plan.describe());
}

bool Runtime::Impl::adopt_bucket_order(const std::vector<std::uint32_t>& order) {
  if (order.size() != registry.trainable()) return false;
  std::vector<char> seen(registry.params().size(), 0);
  for (const auto p : order)
    if (p >= seen.size() || seen[p]++ || !registry.params()[p].requires_grad) return false;
  auto next = make_plan(order);
  rebuilt = true;
  if (!same_layout(plan, next)) install_plan(std::move(next), iterations, StateOnRebuild::loaded_next);
  return true;
}

}  // namespace shardflow
