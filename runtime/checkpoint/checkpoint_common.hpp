// What the two checkpoint layouts share (Note [Checkpoints], Note [Sharded checkpoints]): the
// names state is saved under, parameter coordinates, the metadata, and the checks every
// checkpoint call makes before it starts. (Checksums and atomic small files: safetensors_stream.hpp.)
#pragma once

#include <functional>
#include <set>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "runtime/rank/runtime_impl.hpp"
#include "runtime/checkpoint/background_save.hpp"

namespace shardflow::ckpt {

const char* safetensors_dtype(DType t);

// What slot `slot` of the shard holds for parameter p, as a checkpoint name; empty when p has none.
std::string slot_name(const std::vector<ParamSpec>& params, const Shard& shard, const OptimizerGroups& groups, const Config& cfg,
                      std::uint32_t p, std::size_t slot);
inline std::string state_key(const std::string& param, const std::string& slot) { return "optim." + param + "." + slot; }

// Parameter coordinates: where each parameter's elements start, how many, and the total (the
// order of registration, as Shard::export_state counts them).
struct Coordinates {
  std::vector<std::size_t> base, size;
  std::size_t total = 0;
  explicit Coordinates(const std::vector<ParamSpec>& params);
};

void check_cpu_params(const std::vector<ParamSpec>& params, const char* what);

// The step count, the stage, the partition and the groups' hyper-parameters, as metadata.
std::map<std::string, std::string> optimizer_metadata(int world, const Shard* shard, const Config& cfg, const OptimizerGroups* groups);
// What a checkpoint holds besides tensors and the step count, by key: the consolidated file's
// metadata "shardflow.<key>", the sharded index's "<key>"; the JSON text, or "" when absent.
//   skipped_steps  the steps each parameter sat out, unused on every rank (Note [Unused
//                  parameters]), {name: count} for the non-zero ones: each parameter resumes with
//                  its own step count, as torch.optim's per-parameter "step" does
//   frozen         parameters frozen at the save (a list): no state in it; trained now, they start
//                  afresh (zero state, their own step count from 0)
//   loss_scale     the loss scaler's scale and growth tracker (Note [Loss scaling])
using CheckpointField = std::function<std::string(const std::string& key)>;
std::set<std::string> frozen_names(const CheckpointField& field, const std::string& label);
// The per-parameter step counts and the loss scaler into `shard`, after its set_steps. `label`
// names the source in errors.
void restore_counters(Shard& shard, const std::vector<ParamSpec>& params, const Config& cfg, const std::set<std::string>& was_frozen,
                      const CheckpointField& field, const std::string& label);

// Every checkpoint call starts here: between iterations, host parameters, and the last
// iteration's parameter syncs landed. `what` names the call in errors. (A template so as not to
// name Runtime's private Impl.)
template <class RuntimeImpl>
void checkpoint_entry(RuntimeImpl& I, Runtime& rt, const char* what) {
  I.ensure_finalized();
  I.throw_if_failed();
  if (I.in_pass())
    throw UsageError(std::string(what) + " on rank " + std::to_string(I.rank) + " in the middle of a synchronised backward pass");
  check_cpu_params(I.registry.params(), what);
  rt.wait_all_params();
}

}  // namespace shardflow::ckpt
