// Note [Comm hooks]
// A comm hook (shardflow/comm_hook.hpp) replaces how a bucket is reduced, as PyTorch's DDP
// register_comm_hook does; the schedule (which bucket when, Note [Collective schedule]) stays the
// runtime's. The bucket actor hands its BucketCollectives to the comm stream as always; when the
// bucket's reduce entry is due, the hook is asked for its first phase of collectives, which go
// out in the entry's place. When a phase's last collective completes, the hook's continuation
// runs on the backend's stream thread (the 16-bit casts, PowerSGD's orthogonalisation and
// products: never on a CAF scheduler thread) and may hand the comm stream the next phase by
// message. The comm stream issues no other entry until the bucket's last phase is out, so the
// ranks' collectives stay in one order however long a phase's arithmetic takes. The bucket is
// reduced (and, with ZeRO-1, stepped) when the last phase completed. Hooks replace an all-reduce:
// ZeRO-2's reduce-scatter keeps its own 16-bit wire (Config::precision.comm_dtype), and a hook
// beside a 16-bit comm_dtype would compress twice; both are refused. Hooks work on host buckets.
#include "runtime/rank/runtime_impl.hpp"
#include "runtime/semantics/semantics_state.hpp"

namespace shardflow {

void Runtime::register_comm_hook(std::shared_ptr<CommHook> hook) {
  auto& I = *impl_;
  std::lock_guard lock(I.finalize_mu);
  if (!hook) throw UsageError("register_comm_hook: null hook");
  if (I.finalized.load()) throw UsageError("register_comm_hook('" + hook->name() + "'): register it before training starts (finalize)");
  if (I.semantics->hook.hook) throw UsageError("register_comm_hook('" + hook->name() + "'): '" + I.semantics->hook.hook->name() + "' is registered already (one hook per Runtime)");
  if (I.cfg.zero.redundancy == 2)
    throw UsageError("register_comm_hook('" + hook->name() + "'): " + I.cfg.name_of("zero.redundancy") +
                     " = 2 feeds each twin its source's reduce-scatter slice, which a hook's own all-reduces do not produce");
  I.semantics->hook.hook = std::move(hook);
  I.remember([h = I.semantics->hook.hook](Runtime& rt) { rt.register_comm_hook(h); });
}

std::shared_ptr<CommHook> Runtime::Impl::effective_hook() const {
  const bool wire16 = cfg.precision.comm_dtype != DType::f32;
  if (!semantics->hook.hook) {
    // On GPU buckets the 16-bit wire is the shard's cast: configure_optimizer usually comes after
    // finalize() (which spawns the first actors), so the missing optimizer is an error at the
    // first backward (check_settings_used), not here.
    if (!wire16 || shard || mem->on_gpu()) return nullptr;
    return cfg.precision.comm_dtype == DType::f16 ? fp16_compress_hook() : bf16_compress_hook();
  }
  const std::string who = "comm hook '" + semantics->hook.hook->name() + "'";
  if (wire16)
    throw UsageError(who + " beside " + cfg.name_of("precision.comm_dtype") + " = " + dtype_name(cfg.precision.comm_dtype) +
                     ": the gradients would be compressed twice; use one of them");
  // Judged by the settings, not by whether this world happens to shard (world 1 does not), so a
  // run that works at one world size does not fail at another.
  if (shard && cfg.zero.stage == ZeroStage::gradients && cfg.zero.partition == Partition::flat)
    throw UsageError(who + ": ZeRO-2 with the flat partition reduce-scatters its buckets, and hooks replace an all-reduce; use " +
                     cfg.name_of("precision.comm_dtype") + " for a 16-bit wire there, ZeRO-1, or the param or bucket partition");
  if (mem->on_gpu()) throw UsageError(who + ": hooks reduce host buckets; this Runtime's parameters are on " + mem->device.str());
  return semantics->hook.hook;
}

bool Runtime::Impl::has_trainer_hook() const { return semantics->hook.hook != nullptr; }

}  // namespace shardflow
