// Note [Unused parameters]
// With Config::buckets.find_unused_parameters a parameter that got no gradient on a rank is
// reduced as zeros there (so the collectives still match), as PyTorch's DDP does. What a rank cannot
// know alone is whether *any* rank used it: a parameter no rank used must be left as torch.optim
// leaves a parameter whose grad is None (no weight decay, no momentum, no Adam step; its own step
// count stays), and the trainer must be able to ask which they were. So once backward ends each
// rank hands the comm stream a count per parameter (1: it reported a gradient, or accumulated one
// in a no_sync pass), all-reduced right after the last reduction (Note [Collective schedule]: U).
// The shard steps no bucket before the counts are in, the way clipping waits for the norm, and
// skips the pieces of parameters with a count of 0 (Shard::skip_unused); Runtime::unused_parameters()
// reads them after wait(). The exchange costs one all-reduce of 4 bytes per parameter, and the
// syncs of ZeRO then follow all reductions instead of interleaving with them: the price PyTorch's
// find_unused_parameters also pays, for models whose graph changes between iterations.
#include "runtime/rank/runtime_impl.hpp"
#include "runtime/semantics/semantics_state.hpp"

namespace shardflow {

void Runtime::Impl::send_used_counts() {
  auto& counts = *semantics->unused.used_counts;
  for (std::size_t p = 0; p < counts.size(); ++p) counts[p] = marked[p].load(std::memory_order_acquire) || touched[p] ? 1.0f : 0.0f;
  CollectiveIssue issue;
  CollectiveOp op;
  op.kind = CollectiveKind::allreduce;
  op.dtype = DType::f32;
  op.send = op.recv = counts.data();
  op.count = counts.size();
  op.tag = "used counts, iteration " + std::to_string(iterations);
  op.keep_alive = semantics->unused.used_counts;
  issue.ops.push_back(std::move(op));
  hand_over(ScheduledCollective::unused, std::move(issue));
}

std::vector<Param> Runtime::unused_parameters() const {
  const auto& I = *impl_;
  if (!I.cfg.buckets.find_unused_parameters && !I.cfg.buckets.static_graph)
    throw UsageError("unused_parameters(): set Config::buckets.find_unused_parameters = true (or static_graph); without it every parameter must get a gradient");
  I.require_between_iterations("unused_parameters()", "the counts are not in yet: ask after wait()");
  std::vector<Param> out;
  if (!I.semantics->unused.used_counts || I.iterations == 0) return out;
  for (std::uint32_t p = 0; p < I.semantics->unused.used_counts->size(); ++p)
    if ((*I.semantics->unused.used_counts)[p] == 0.0f && I.registry.params()[p].requires_grad) out.push_back(Param{p, I.owner});
  return out;
}

bool Runtime::Impl::finds_unused() const {
  return cfg.buckets.static_graph ? !semantics->graph.learnt : cfg.buckets.find_unused_parameters;
}

std::shared_ptr<std::vector<float>> Runtime::Impl::used_counts_for_shard() const {
  return finds_unused() ? semantics->unused.used_counts : nullptr;
}

const std::vector<float>& Runtime::Impl::used_counts() const { return *semantics->unused.used_counts; }

}  // namespace shardflow
