// Note [Uneven inputs]
// The last epoch of a real data set rarely splits evenly over the ranks: some run out of batches
// first. As PyTorch's Join does, each synchronised iteration then starts with an all-reduce of
// how many ranks still train (1 from each training rank, 0 from a joined one), taken on the
// trainer's thread before the pass's first gradient goes to its bucket (no collective of the
// runtime's is in flight then: the previous iteration is complete, which is why forward prefetch
// is refused with it). The reductions average over that count instead of the world size. A rank
// out of data calls join(): it keeps taking part in the others' iterations with zero gradients
// (reduced as zeros, so the collectives match; with ZeRO it still steps and syncs the shard it
// owns) until the count is 0, when every rank has joined and all leave together. The average of
// iteration k is therefore the sum of the contributing ranks' gradients over their number, which
// is what a single process computes over the same batches.
// Without the runtime's optimizer the trainer steps after wait(), and a joined rank takes no more
// steps: its parameters fall behind. When everyone has joined, the parameters are therefore
// broadcast from the rank that joined last (the lowest such rank), as PyTorch's DDP does at the end
// of Join; with the runtime's optimizer every rank stepped every iteration and nothing is needed.
#include <algorithm>

#include "runtime/rank/runtime_impl.hpp"
#include "runtime/semantics/semantics_state.hpp"

namespace shardflow {

void Runtime::Impl::count_training_ranks() {
  // Called by every grad_ready: one acquire load once counted. Backward threads that report at
  // the same moment wait for the count (the lock) rather than send their gradients before it.
  if (!cfg.join.uneven_inputs || !require_sync.load(std::memory_order_relaxed) || semantics->join.counted.load(std::memory_order_acquire)) return;
  std::lock_guard lock(semantics->join.count_mu);
  if (semantics->join.counted.load(std::memory_order_relaxed)) return;
  float training = semantics->join.joined ? 0.0f : 1.0f;
  control_collective(CollectiveKind::allreduce, &training, 1, "join: ranks still training");
  semantics->join.training_ranks = int(training);
  semantics->join.divisor->store(semantics->join.training_ranks > 0 ? 1.0f / float(semantics->join.training_ranks) : 0.0f, std::memory_order_release);
  semantics->join.counted.store(true, std::memory_order_release);
}

void Runtime::join() {
  auto& I = *impl_;
  I.ensure_finalized();
  I.throw_if_failed();
  if (!I.cfg.join.uneven_inputs)
    throw UsageError("join() on rank " + std::to_string(I.rank) + ": set " + I.cfg.name_of("join.uneven_inputs") +
                     " = true, so that every iteration counts the ranks still training");
  I.require_between_iterations("join()", "call it after wait()");
  I.semantics->join.joined = true;
  const auto joined_at = float(I.iterations);
  for (;;) {
    I.count_training_ranks();
    if (I.semantics->join.training_ranks == 0) {  // every rank has joined: all leave on this count
      I.semantics->join.recount();
      break;
    }
    zero_grad();  // a shadow iteration: every gradient zero
    finish_backward();
    wait();
  }
  if (!I.shard && I.world > 1) {
    std::vector<float> at(std::size_t(I.world), 0.0f);
    at[std::size_t(I.rank)] = joined_at;
    I.control_collective(CollectiveKind::allreduce, at.data(), at.size(), "join: when each rank joined");
    const int last = int(std::max_element(at.begin(), at.end()) - at.begin());
    I.broadcast_params(last, "join: final parameters");
  }
  I.log->info("joined: every rank is out of data after iteration {}", I.iterations);
}

int Runtime::training_ranks() const { return impl_->cfg.join.uneven_inputs ? impl_->semantics->join.training_ranks : impl_->world; }

void Runtime::Impl::recount_training_ranks() { semantics->join.recount(); }

bool Runtime::Impl::has_joined() const { return semantics->join.joined; }

std::shared_ptr<std::atomic<float>> Runtime::Impl::join_divisor() const {
  return cfg.join.uneven_inputs ? semantics->join.divisor : nullptr;
}

}  // namespace shardflow
