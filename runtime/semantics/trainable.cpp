// Note [Changing the trainable set]
// Fine-tuning freezes and unfreezes parts of a model between phases. A frozen parameter
// (ParamSpec::requires_grad false) is in no bucket: it costs no reduction, no step, no sync and no
// optimizer state. set_requires_grad() only records the wish; refresh_trainable(), a collective
// between iterations, checks that every rank wants the same set and re-plans: new buckets (from
// the registration order, then rebuilt once from the next iteration's observed order, unless
// buckets.rebuild is off), a new shard into which the state of the parameters that stay trainable migrates
// through parameter coordinates (Note [State migration]) while that of newly frozen parameters is
// dropped. A parameter trained again starts afresh, as one just added to a torch.optim optimizer
// would: zero state, its own step count from 0 (Shard::skipped). The forward-prefetch order and
// the interleave lag, measured on the old buckets, are measured anew.
#include "runtime/rank/runtime_impl.hpp"
#include "runtime/semantics/semantics_state.hpp"

namespace shardflow {

void Runtime::set_requires_grad(Param p, bool on) {
  auto& I = *impl_;
  const auto i = I.check_handle(p, "set_requires_grad");
  I.require_between_iterations("set_requires_grad('" + I.name_of(i) + "')", "freeze or unfreeze between iterations");
  std::lock_guard lock(I.finalize_mu);
  if (I.iterations == 0) I.remember([p, on](Runtime& rt) { rt.set_requires_grad(p, on); });
  if (!I.finalized.load()) {  // still registering: the plan is made with it
    I.registry.set_requires_grad(i, on);
    return;
  }
  I.semantics->trainable.wanted.resize(I.registry.size(), -1);
  I.semantics->trainable.wanted[i] = on ? 1 : 0;
}

void Runtime::refresh_trainable() {
  auto& I = *impl_;
  I.ensure_finalized();
  I.throw_if_failed();
  I.require_between_iterations("refresh_trainable()", "call it between iterations");
  if (I.iterations == 0)
    I.remember([](Runtime& rt) { rt.refresh_trainable(); });
  else
    I.remember_change("refresh_trainable() after iteration " + std::to_string(I.iterations));
  wait_all_params();
  const auto& params = I.registry.params();
  std::vector<std::uint32_t> thawed;
  for (std::uint32_t p = 0; p < I.semantics->trainable.wanted.size(); ++p) {
    if (I.semantics->trainable.wanted[p] < 0 || bool(I.semantics->trainable.wanted[p]) == params[p].requires_grad) continue;
    if (I.semantics->trainable.wanted[p]) thawed.push_back(p);
    I.registry.set_requires_grad(p, I.semantics->trainable.wanted[p] != 0);
  }
  I.semantics->trainable.wanted.clear();
  if (I.registry.trainable() == 0)
    throw UsageError("refresh_trainable() on rank " + std::to_string(I.rank) + ": every parameter is frozen; keep at least one trainable");
  // Every rank must train the same set (the buckets and the collectives follow from it).
  try {
    I.collectives->record(CollectiveOp{CollectiveKind::allgather, DType::f32, nullptr, nullptr, 4, 0, 1.0f, "verify trainable sets", {}});
    verify_same_params(*I.comm, I.registry.signature(), I.cfg.timeouts.collective);
  } catch (const MismatchError& e) {
    I.fail(MismatchError(std::string("refresh_trainable: ") + e.what()));
  }
  // What was measured on the old buckets is measured again on the new ones.
  I.forget_overlap_choices();
  I.rebuilt = false;
  I.install_plan(I.make_plan(reverse_registration_order(params)), I.iterations);
  if (I.shard) {
    auto skipped = I.shard->skipped();
    for (auto p : thawed) skipped[p] = I.shard->steps();  // its own step count starts over
    I.shard->set_skipped(std::move(skipped));
  }
  I.log->info("trainable set refreshed: {} of {} parameters trainable, {} bucket(s)", I.registry.trainable(), params.size(),
              I.plan.buckets.size());
}

}  // namespace shardflow
