// Note [Changing hyper-parameters]
// Between iterations any hyper-parameter of a group may change (a schedule of lr, weight decay,
// betas, momentum), and groups may be added (add_param_group, as torch.optim has it). The runtime's
// copy changes at once; the shard gets an immutable snapshot for the iterations from the next one
// on (Note [Hyper-parameter snapshots]), so a step already running under forward prefetch keeps
// the values it started with. What cannot change between iterations is the shape of the state:
// the optimizer kind, and SGD momentum appearing where no group had it (or going from every
// group), which would add or drop a state slot.
#include "runtime/rank/runtime_impl.hpp"
#include "runtime/semantics/semantics_state.hpp"
#include "runtime/zero/optimizer_hyper.hpp"

namespace shardflow {

void Runtime::configure_optimizer(std::vector<ParamGroup> groups) {
  auto& I = *impl_;
  I.ensure_finalized();
  I.throw_if_failed();
  if (I.in_pass() || (I.shard && I.shard->steps() > 0))
    throw UsageError("configure_optimizer on rank " + std::to_string(I.rank) + ": call it once, before training starts");
  if (groups.empty()) throw UsageError("configure_optimizer: no parameter groups");
  auto og = std::make_shared<OptimizerGroups>();
  og->group_of.assign(I.registry.size(), ~0u);
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const auto& oc = groups[g].optimizer;
    oc.validate();
    if (oc.kind != groups[0].optimizer.kind)
      throw UsageError("configure_optimizer: group " + std::to_string(g) + " uses another optimizer kind than group 0");
    for (Param p : groups[g].params) {
      const auto i = I.check_handle(p, "configure_optimizer");
      if (og->group_of[i] != ~0u)
        throw UsageError("configure_optimizer: parameter '" + I.name_of(i) + "' is in groups " +
                         std::to_string(og->group_of[i]) + " and " + std::to_string(g));
      og->group_of[i] = std::uint32_t(g);
    }
    og->groups.push_back(oc);
  }
  I.semantics->grouping.explicitly_grouped.assign(I.registry.size(), 0);
  for (std::size_t i = 0; i < I.registry.size(); ++i) {
    I.semantics->grouping.explicitly_grouped[i] = og->group_of[i] != ~0u;
    if (og->group_of[i] == ~0u) og->group_of[i] = 0;
  }
  I.groups = std::move(og);
  I.remember([groups](Runtime& rt) { rt.configure_optimizer(groups); });
  I.shard.reset();
  // The optimizer may change the caps (stage 2's memory budget): the buckets anew, in the order
  // the current ones were made in (no iteration has run yet: the registration order reversed).
  I.install_plan(I.make_plan(reverse_registration_order(I.registry.params())), I.iterations);
}

// Note [What the last step left, under prefetch]: both are counted at the last step's end.
float Runtime::loss_scale() const {
  impl_->settle_last_step(Impl::LastStep::whole);
  return impl_->shard ? impl_->shard->loss_scale() : 1.0f;
}
bool Runtime::last_step_skipped() const {
  impl_->settle_last_step(Impl::LastStep::whole);
  return impl_->shard && impl_->shard->last_skipped();
}

void Runtime::Impl::publish_groups(std::shared_ptr<OptimizerGroups> next, const char* what) {
  if (next->state_slots() != groups->state_slots())
    throw UsageError(std::string(what) + ": the change makes the optimizer keep " + std::to_string(next->state_slots()) +
                     " state word(s) per element instead of " + std::to_string(groups->state_slots()) +
                     " (SGD momentum added where no group had it, or removed from every group); set it at configure_optimizer");
  groups = next;
  if (shard_actor_h)
    caf::anon_send(shard_actor_h, msg::set_groups_atom::value, std::uint64_t(iterations), std::shared_ptr<const OptimizerGroups>(next));
}

void Runtime::set_hyperparameters(std::size_t group, const OptimizerConfig& h) {
  auto& I = *impl_;
  if (!I.groups) throw UsageError("set_hyperparameters: no optimizer configured (configure_optimizer)");
  if (group >= I.groups->groups.size())
    throw UsageError("set_hyperparameters: group " + std::to_string(group) + " does not exist (" + std::to_string(I.groups->groups.size()) +
                     " group(s))");
  I.require_between_iterations("set_hyperparameters", "change hyper-parameters between iterations");
  h.validate();
  if (h.kind != I.groups->groups[group].kind)
    throw UsageError("set_hyperparameters: group " + std::to_string(group) + " uses " + kind_name(I.groups->groups[group].kind) +
                     "; the optimizer kind cannot change during training");
  if (h.kind == OptimizerConfig::Kind::custom && h.rule->state_names() != I.groups->groups[group].rule->state_names())
    throw UsageError("set_hyperparameters: step rule '" + h.rule->name() + "' keeps other state tensors than group " + std::to_string(group) +
                     "'s rule; the state cannot change shape during training");
  auto next = std::make_shared<OptimizerGroups>(*I.groups);
  next->groups[group] = h;
  I.publish_groups(std::move(next), "set_hyperparameters");
}

void Runtime::set_lr(std::size_t group, float lr) {
  auto& I = *impl_;
  if (!I.groups) throw UsageError("set_lr: no optimizer configured (configure_optimizer)");
  if (group >= I.groups->groups.size())
    throw UsageError("set_lr: group " + std::to_string(group) + " does not exist (" + std::to_string(I.groups->groups.size()) +
                     " group(s))");
  if (!(lr >= 0.0f)) throw UsageError("set_lr: lr must be >= 0");
  auto h = I.groups->groups[group];
  h.lr = lr;
  set_hyperparameters(group, h);
}

OptimizerConfig Runtime::hyperparameters(std::size_t group) const {
  const auto& I = *impl_;
  if (!I.groups || group >= I.groups->groups.size())
    throw UsageError("hyperparameters: group " + std::to_string(group) + " does not exist");
  return I.groups->groups[group];
}

std::size_t Runtime::add_param_group(const ParamGroup& g) {
  auto& I = *impl_;
  if (!I.groups) throw UsageError("add_param_group: no optimizer configured (configure_optimizer)");
  I.require_between_iterations("add_param_group", "add groups between iterations");
  if (g.params.empty()) throw UsageError("add_param_group: the group has no parameters");
  g.optimizer.validate();
  if (g.optimizer.kind != I.groups->groups[0].kind)
    throw UsageError(std::string("add_param_group: every group uses one optimizer kind (") + kind_name(I.groups->groups[0].kind) + ")");
  auto next = std::make_shared<OptimizerGroups>(*I.groups);
  const auto index = std::uint32_t(next->groups.size());
  for (Param p : g.params) {
    const auto i = I.check_handle(p, "add_param_group");
    if (I.semantics->grouping.explicitly_grouped[i])
      throw UsageError("add_param_group: parameter '" + I.name_of(i) + "' is already in group " + std::to_string(next->group_of[i]) +
                       " (a parameter belongs to one group)");
    next->group_of[i] = index;
  }
  next->groups.push_back(g.optimizer);
  I.publish_groups(std::move(next), "add_param_group");
  if (I.iterations == 0)
    I.remember([g](Runtime& rt) { rt.add_param_group(g); });
  else
    I.remember_change("add_param_group() after iteration " + std::to_string(I.iterations));
  for (Param p : g.params) I.semantics->grouping.explicitly_grouped[p.index] = 1;
  return index;
}

}  // namespace shardflow
