// Note [Checkpoints]
// A checkpoint is written in parameter coordinates, not in the shards' layout: parameters under
// their names and the optimizer state as optim.<name>.exp_avg / exp_avg_sq / momentum_buffer /
// master (fp32), one safetensors file a Python user can read with the format alone, the step count
// and the groups' hyper-parameters in its metadata. Nothing in it depends on the world size, the
// stage, the partition or the bucket plan, so any run can load it: each rank reads the parameters
// and imports the state of the pieces it owns (Shard::import_state, the same path a bucket rebuild
// migrates state through), whatever layout saved it.
// Saving streams: per state slot, windows of parameter coordinates (Shard::export_state; the
// owners' pieces, summed across ranks when sharded) go to the recipient, which writes each into
// the file at its place, behind the stream (runtime/checkpoint/write_behind.hpp: the parameters and each
// half window are written while the next half is exported and reduced). No rank holds more than
// one window beyond its own state; nothing is serialised on the way. The file appears under its name only once complete and on disk (a
// temporary file, fsync, rename): a crash mid-save leaves the previous checkpoint as it was.
// The same stream goes into split files with an index past a size limit, or into memory
// (Runtime::state_dict); loading takes a file, split files or a StateDict through one path.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>
#include <nlohmann/json.hpp>

#include "kernels/cpu/elementwise.hpp"
#include "runtime/checkpoint/checkpoint_common.hpp"
#include "runtime/zero/optimizer_hyper.hpp"
#include "runtime/checkpoint/safetensors_stream.hpp"
#include "runtime/checkpoint/write_behind.hpp"

namespace shardflow {
namespace ckpt {

const char* safetensors_dtype(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    default: return "?";
  }
}

std::string slot_name(const std::vector<ParamSpec>& params, const Shard& shard, const OptimizerGroups& groups, const Config& cfg,
                      std::uint32_t p, std::size_t slot) {
  if (!params[p].requires_grad) return "";  // frozen: no optimizer state, no master
  if (slot == shard.state_slots())  // the fp32 masters (Note [Master weights])
    return params[p].dtype != DType::f32 || cfg.precision.comm_dtype != DType::f32 ? "master" : "";
  const auto& h = groups.groups[groups.group_of[p]];
  if (h.kind == OptimizerConfig::Kind::custom) return h.rule->state_names().at(slot);
  if (h.kind != OptimizerConfig::Kind::sgd) return slot == 0 ? "exp_avg" : "exp_avg_sq";
  return slot == 0 && h.momentum != 0.0f ? "momentum_buffer" : "";
}

Coordinates::Coordinates(const std::vector<ParamSpec>& params) {
  for (const auto& p : params) {
    base.push_back(total);
    size.push_back(std::size_t(numel(p.shape)));
    total += size.back();
  }
}

void check_cpu_params(const std::vector<ParamSpec>& params, const char* what) {
  for (const auto& p : params)
    if (p.device.kind != Device::Kind::cpu)
      throw UsageError(std::string(what) + ": parameter '" + p.name +
                       "' lives on a GPU; checkpoints of device parameters are not supported yet (copy them to the host)");
}

std::map<std::string, std::string> optimizer_metadata(int world, const Shard* shard, const Config& cfg, const OptimizerGroups* opt) {
  std::map<std::string, std::string> meta{{"format", "pt"}, {"shardflow.checkpoint", "1"}, {"shardflow.world_size", std::to_string(world)}};
  if (!shard) return meta;
  meta["shardflow.steps"] = std::to_string(shard->steps());
  meta["shardflow.zero_stage"] = std::to_string(int(cfg.zero.stage));
  meta["shardflow.partition"] = partition_name(cfg.zero.partition);
  nlohmann::json groups = nlohmann::json::array();
  for (const auto& h : opt->groups) {
    groups.push_back({{"kind", kind_name(h.kind)}, {"lr", h.lr}, {"momentum", h.momentum}, {"dampening", h.dampening},
                      {"nesterov", h.nesterov}, {"beta1", h.beta1}, {"beta2", h.beta2}, {"eps", h.eps},
                      {"weight_decay", h.effective_weight_decay()}});
    if (h.rule) groups.back()["rule"] = h.rule->name();
  }
  meta["shardflow.param_groups"] = groups.dump();
  nlohmann::json skipped = nlohmann::json::object();
  const auto& params = shard->params();
  for (std::size_t p = 0; p < params.size(); ++p)
    if (shard->skipped()[p] != 0) skipped[params[p].name] = shard->skipped()[p];
  if (!skipped.empty()) meta["shardflow.skipped_steps"] = skipped.dump();
  nlohmann::json frozen = nlohmann::json::array();
  for (const auto& p : params)
    if (!p.requires_grad) frozen.push_back(p.name);
  if (!frozen.empty()) meta["shardflow.frozen"] = frozen.dump();
  if (cfg.precision.dynamic_loss_scale)
    meta["shardflow.loss_scale"] = nlohmann::json{{"scale", shard->loss_scale()}, {"growth_tracker", shard->growth_tracker()}}.dump();
  return meta;
}

namespace {

void restore_loss_scale(Shard& shard, const std::string& json, const std::string& label) {
  if (json.empty()) return;  // saved without loss scaling: this run's starts at its init_scale
  try {
    const auto j = nlohmann::json::parse(json);
    shard.set_loss_scale(j.at("scale").get<float>(), j.at("growth_tracker").get<int>());
  } catch (const nlohmann::json::exception& e) {
    throw UsageError(label + ": shardflow.loss_scale is malformed: " + e.what());
  }
}

}  // namespace

std::set<std::string> frozen_names(const CheckpointField& field, const std::string& label) {
  const auto json = field("frozen");
  if (json.empty()) return {};
  try {
    return nlohmann::json::parse(json).get<std::set<std::string>>();
  } catch (const nlohmann::json::exception& e) {
    throw UsageError(label + ": shardflow.frozen is malformed: " + e.what());
  }
}

void restore_counters(Shard& shard, const std::vector<ParamSpec>& params, const Config& cfg, const std::set<std::string>& was_frozen,
                      const CheckpointField& field, const std::string& label) {
  if (cfg.precision.dynamic_loss_scale) restore_loss_scale(shard, field("loss_scale"), label);
  const auto json = field("skipped_steps");
  std::vector<std::int64_t> skipped(params.size(), 0);
  if (!json.empty()) try {
      const auto j = nlohmann::json::parse(json);
      for (std::size_t p = 0; p < params.size(); ++p)
        if (const auto it = j.find(params[p].name); it != j.end()) skipped[p] = it->get<std::int64_t>();
    } catch (const nlohmann::json::exception& e) {
      throw UsageError(label + ": shardflow.skipped_steps is malformed: " + e.what());
    }
  for (std::size_t p = 0; p < params.size(); ++p)
    if (skipped[p] < 0 || skipped[p] > shard.steps())
      throw UsageError(label + ": parameter '" + params[p].name + "' sat out " + std::to_string(skipped[p]) + " of " +
                       std::to_string(shard.steps()) + " steps (shardflow.skipped_steps): the file is inconsistent");
  for (std::size_t p = 0; p < params.size(); ++p)
    if (was_frozen.count(params[p].name)) skipped[p] = shard.steps();
  shard.set_skipped(std::move(skipped));
}

}  // namespace ckpt

namespace {

using namespace ckpt;

// Every parameter overlapping the window [begin, begin + n) of parameter coordinates: (parameter,
// first element within it, first element within the window, length).
template <class Fn>
void for_params_in(const std::vector<std::size_t>& base, const std::vector<std::size_t>& size, std::size_t begin, std::size_t n, Fn fn) {
  for (std::uint32_t p = 0; p < base.size(); ++p) {
    const std::size_t lo = std::max(base[p], begin), hi = std::min(base[p] + size[p], begin + n);
    if (lo < hi) fn(p, lo - base[p], lo - begin, hi - lo);
  }
}

}  // namespace

namespace {

// Where consolidated state goes on its recipient(s): a file (or split files), or memory.
struct ConsolidatedSink {
  virtual ~ConsolidatedSink() = default;
  virtual void write(const std::string& name, std::uint64_t offset, const void* data, std::uint64_t n) = 0;
  virtual void commit() {}
};
using OpenSink = std::function<std::unique_ptr<ConsolidatedSink>(const std::vector<SafetensorsWriter::Entry>&,
                                                                 const std::map<std::string, std::string>&)>;

// The file left from a save of the other kind under the same name goes once this one is in
// place: a split save's index and its files after a single-file save, the single file after a
// split save (loading `path` or `path`.index.json must not find an older checkpoint).
void remove_other_kind(const std::string& path, bool split) {
  namespace fs = std::filesystem;
  if (split) {
    fs::remove(path);
    return;
  }
  const auto index = path + ".index.json";
  if (!fs::exists(index)) return;
  for (const auto& f : safetensors_split_files(index)) fs::remove(f);
  fs::remove(index);
}

// One file, or (past max_file_bytes) files with an index.
struct FileSink : ConsolidatedSink {
  std::string path;
  std::unique_ptr<SafetensorsWriter> one;
  std::unique_ptr<SafetensorsSplitWriter> split;
  std::shared_ptr<spdlog::logger> log;
  // Test hook (tests/test_checkpoint.cpp): SHARDFLOW_TEST_FAIL_WRITE=K fails this save's K-th
  // write as a full disk would, in the middle of the stream.
  long fail_at = 0, writes = 0;
  FileSink(std::string p, const std::vector<SafetensorsWriter::Entry>& entries, const std::map<std::string, std::string>& meta,
           std::uint64_t max_file_bytes, std::shared_ptr<spdlog::logger> l)
      : path(std::move(p)), log(std::move(l)) {
    if (const char* k = std::getenv("SHARDFLOW_TEST_FAIL_WRITE")) fail_at = std::atol(k);
    std::uint64_t bytes = 0;
    for (const auto& e : entries) bytes += std::uint64_t(numel(e.shape)) * safetensors_element_size(e.dtype);
    if (max_file_bytes > 0 && bytes > max_file_bytes)
      split = std::make_unique<SafetensorsSplitWriter>(path + ".index.json", entries, meta, max_file_bytes, /*checksums=*/true);
    else
      one = std::make_unique<SafetensorsWriter>(path, entries, meta, /*checksums=*/true);
  }
  void write(const std::string& name, std::uint64_t offset, const void* data, std::uint64_t n) override {
    if (++writes == fail_at) throw Error("writing '" + path + "', tensor '" + name + "' failed: No space left on device (injected)");
    one ? one->write(name, offset, data, n) : split->write(name, offset, data, n);
  }
  void commit() override {
    one ? one->commit() : split->commit();
    try {
      remove_other_kind(path, bool(split));
    } catch (const std::exception& e) {  // the new checkpoint stands; what is left is only clutter
      log->warn("checkpoint '{}' written, but removing the earlier one of the other layout failed: {}", path, e.what());
    }
  }
};

// Straight into a StateDict's tensors, allocated at their full size up front.
struct MemorySink : ConsolidatedSink {
  StateDict& out;
  MemorySink(StateDict& o, const std::vector<SafetensorsWriter::Entry>& entries, const std::map<std::string, std::string>& meta) : out(o) {
    out.tensors.clear();
    out.metadata = meta;
    for (const auto& e : entries) {
      Tensor t;
      t.dtype = e.dtype;
      t.shape = e.shape;
      t.data.resize(std::size_t(numel(e.shape)) * safetensors_element_size(e.dtype));
      out.tensors.emplace(e.name, std::move(t));
    }
  }
  void write(const std::string& name, std::uint64_t offset, const void* data, std::uint64_t n) override {
    auto& t = out.tensors.at(name);
    std::memcpy(t.data.data() + offset, data, n);
  }
};

// Every rank's state, in parameter coordinates, to `recipient` (every rank with -1): the
// parameters whole, then per state slot windows summed across ranks (Note [Checkpoints]). Every
// rank hears whether the recipients could open their sink and whether they finished. `what`
// names the operation in errors. (A template so as not to name Runtime's private Impl.)
template <class RuntimeImpl>
void consolidate(RuntimeImpl& I, int recipient, const char* what, const std::string& target, const OpenSink& open) {
  const auto& params = I.registry.params();
  const Coordinates at(params);
  const std::size_t slots = I.shard ? I.shard->migrate_slots() : 0;
  const bool me = recipient < 0 || I.rank == recipient;
  std::unique_ptr<ConsolidatedSink> out;
  std::string failure;
  if (me) try {
      std::vector<SafetensorsWriter::Entry> entries;
      for (const auto& p : params) entries.push_back({p.name, safetensors_dtype(p.dtype), p.shape});
      for (std::size_t s = 0; s < slots; ++s)
        for (std::uint32_t p = 0; p < params.size(); ++p)
          if (const auto n = slot_name(params, *I.shard, *I.groups, I.cfg, p, s); !n.empty()) entries.push_back({state_key(params[p].name, n), "F32", params[p].shape});
      out = open(entries, optimizer_metadata(I.world, I.shard.get(), I.cfg, I.groups.get()));
    } catch (const std::exception& e) {
      failure = e.what();
    }
  // The recipients' verdict, on every rank: a rank that cannot take the state must not leave the
  // others waiting in the state's collectives.
  auto agree = [&](const char* tag) {
    float bad = failure.empty() ? 0.0f : 1.0f;
    I.control_collective(recipient >= 0 ? CollectiveKind::broadcast : CollectiveKind::allreduce, &bad, 1, tag, std::max(recipient, 0));
    return bad == 0.0f;
  };
  auto fail = [&](const char* doing) {
    throw Error(!failure.empty() ? std::string(what) + ": " + failure
                                 : std::string(what) + ": " + (recipient >= 0 ? "rank " + std::to_string(recipient) : std::string("a rank")) +
                                       " failed " + doing + " '" + target + "' (its error says why)");
  };
  if (!agree("checkpoint: recipient ready")) fail("opening");
  // The recipient's writes run behind the stream, two half windows in turn: while one is being
  // written the next is exported and reduced, in the memory of the one window the save may use.
  // The parameters go first, from where they live (nothing changes them while every rank is in
  // this call). A failed write leaves the stream running to its end (WriteBehind).
  constexpr std::size_t kHalf = RuntimeImpl::kStateWindow / 2;
  std::vector<float> windows[2];
  std::uint64_t written[2] = {0, 0};  // the ticket of each half's last write
  std::optional<WriteBehind> behind;
  if (me) behind.emplace();
  auto write = [&](const std::string& name, std::uint64_t offset, const void* data, std::uint64_t n) {
    return behind->submit([&out, name, offset, data, n] { out->write(name, offset, data, n); });
  };
  try {
    if (me)
      for (std::size_t p = 0; p < params.size(); ++p) write(params[p].name, 0, params[p].data, at.size[p] * dtype_size(params[p].dtype));
    std::size_t turn = 0;
    for (std::size_t s = 0; s < slots; ++s)
      for (std::size_t begin = 0; begin < at.total; begin += kHalf, turn ^= 1) {
        auto& window = windows[turn];
        if (me) behind->wait_done(written[turn]);
        window.resize(std::min(kHalf, at.total - begin));
        I.state_window(*I.shard, s, begin, window, "checkpoint: state", false);
        if (!me || behind->failed()) continue;
        for_params_in(at.base, at.size, begin, window.size(), [&](std::uint32_t p, std::size_t off, std::size_t w, std::size_t n) {
          if (const auto name = slot_name(params, *I.shard, *I.groups, I.cfg, p, s); !name.empty())
            written[turn] = write(state_key(params[p].name, name), off * 4, window.data() + w, n * 4);
        });
      }
    if (me) {
      behind->finish();
      out->commit();
    }
  } catch (const std::exception& e) {
    if (!me) throw;
    failure = e.what();
  }
  behind.reset();  // before the windows it may still read go
  if (!agree("checkpoint: written")) fail("writing");
}

// Consolidated state (a file's index and a reader of its tensors, or a StateDict's) into this
// rank's parameters and the state of the pieces it owns, whatever layout saved it. `label`
// names the source in errors.
template <class RuntimeImpl>
void import_consolidated(RuntimeImpl& I, const SafetensorsIndex& file, const std::string& label,
                         const std::function<void(const std::string&, std::uint64_t, void*, std::uint64_t)>& read) {
  const auto& params = I.registry.params();
  auto where = [&](const std::string& tensor) { return label + ", tensor '" + tensor + "'"; };
  const Coordinates at(params);
  for (const auto& p : params) {
    const auto it = file.tensors.find(p.name);
    if (it == file.tensors.end())
      throw UsageError(label + " has no tensor '" + p.name + "' (a parameter of this run): a checkpoint of another model?");
    if (it->second.shape != p.shape)
      throw UsageError(where(p.name) + " has shape " + shape_str(it->second.shape) + ", this run's parameter " + shape_str(p.shape));
    if (it->second.dtype != safetensors_dtype(p.dtype))
      throw UsageError(where(p.name) + " is " + it->second.dtype + ", this run's parameter " + safetensors_dtype(p.dtype));
  }
  for (std::uint32_t p = 0; p < params.size(); ++p) read(params[p].name, 0, params[p].data, at.size[p] * dtype_size(params[p].dtype));
  if (!I.shard) return;

  bool has_state = false;
  for (const auto& [name, e] : file.tensors) has_state |= name.rfind("optim.", 0) == 0;
  const CheckpointField field = [&](const std::string& key) {
    const auto it = file.metadata.find("shardflow." + key);
    return it == file.metadata.end() ? std::string() : it->second;
  };
  const auto was_frozen = frozen_names(field, label);
  const std::size_t slots = I.shard->migrate_slots();
  std::vector<float> window;
  for (std::size_t s = 0; s < slots; ++s) {
    const bool masters = s == I.shard->state_slots();
    if (!has_state && !masters) continue;  // a state dict of parameters alone: the state starts anew
    for (std::size_t begin = 0; begin < at.total; begin += RuntimeImpl::kStateWindow) {
      window.assign(std::min(RuntimeImpl::kStateWindow, at.total - begin), 0.0f);
      for_params_in(at.base, at.size, begin, window.size(), [&](std::uint32_t p, std::size_t off, std::size_t w, std::size_t n) {
        const auto name = slot_name(params, *I.shard, *I.groups, I.cfg, p, s);
        if (name.empty()) return;
        const auto key = state_key(params[p].name, name);
        const auto it = file.tensors.find(key);
        if (it != file.tensors.end()) {
          if (it->second.dtype != "F32" || it->second.shape != params[p].shape)
            throw UsageError(where(key) + " is " + it->second.dtype + " " + shape_str(it->second.shape) + ", expected F32 " +
                             shape_str(params[p].shape));
          read(key, off * 4, window.data() + w, n * 4);
        } else if (masters) {  // saved without masters: they start from the parameters just loaded
          kernels::convert_to_f32(params[p].dtype, window.data() + w,
                                  static_cast<const std::byte*>(params[p].data) + off * dtype_size(params[p].dtype), n);
        } else if (was_frozen.count(params[p].name)) {  // frozen when saved: its state starts afresh (zeros)
        } else {
          throw UsageError(label + " has no '" + key + "' for this run's optimizer (" +
                           kind_name(I.groups->groups[I.groups->group_of[p]].kind) + "): saved with another optimizer?");
        }
      });
      I.shard->import_state(s, begin, window);
    }
  }
  if (has_state) {
    const auto it = file.metadata.find("shardflow.steps");
    if (it == file.metadata.end()) throw UsageError(label + " has optimizer state but no shardflow.steps in its metadata");
    I.shard->set_steps(std::stoll(it->second));
    restore_counters(*I.shard, params, I.cfg, was_frozen, field, label);
  }
  I.shard->loaded();
}

}  // namespace

void Runtime::save_checkpoint(const std::string& path, int recipient, std::uint64_t max_file_bytes) {
  auto& I = *impl_;
  if (recipient < 0 || recipient >= I.world)
    throw UsageError("save_checkpoint: recipient " + std::to_string(recipient) + " is not a rank of this world of " + std::to_string(I.world));
  checkpoint_entry(I, *this, "save_checkpoint");
  consolidate(I, recipient, "save_checkpoint", path, [&](const auto& entries, const auto& meta) {
    return std::make_unique<FileSink>(path, entries, meta, max_file_bytes, I.log);
  });
  I.log->info("checkpoint '{}' written by rank {}", path, recipient);
}

StateDict Runtime::state_dict(int recipient) {
  auto& I = *impl_;
  if (recipient < -1 || recipient >= I.world)
    throw UsageError("state_dict: recipient " + std::to_string(recipient) + " is not a rank of this world of " + std::to_string(I.world) +
                     " (or -1: every rank)");
  checkpoint_entry(I, *this, "state_dict");
  StateDict out;
  consolidate(I, recipient, "state_dict", "the state dict",
              [&](const auto& entries, const auto& meta) { return std::make_unique<MemorySink>(out, entries, meta); });
  return out;
}

void Runtime::load_state_dict(const StateDict& state) {
  auto& I = *impl_;
  checkpoint_entry(I, *this, "load_state_dict");
  SafetensorsIndex index;  // the state dict seen as a file's index
  index.path = "state dict";
  index.metadata = state.metadata;
  for (const auto& [name, t] : state.tensors) {
    if (t.data.size() != t.numel() * safetensors_element_size(t.dtype))
      throw UsageError("load_state_dict: tensor '" + name + "' holds " + std::to_string(t.data.size()) + " bytes, its shape " +
                       shape_str(t.shape) + " " + t.dtype + " needs " + std::to_string(t.numel() * safetensors_element_size(t.dtype)));
    index.tensors[name] = SafetensorsIndex::Entry{t.dtype, t.shape, 0, t.data.size(), {}};
  }
  import_consolidated(I, index, "state dict", [&](const std::string& name, std::uint64_t offset, void* out, std::uint64_t n) {
    std::memcpy(out, state.tensors.at(name).data.data() + offset, n);
  });
  I.log->info("state dict loaded ({} optimizer step(s))", I.shard ? I.shard->steps() : 0);
}

void Runtime::load_checkpoint(const std::string& path) {
  auto& I = *impl_;
  checkpoint_entry(I, *this, "load_checkpoint");
  I.persistence->snapshots.loaded_trainer_state.reset();  // a sharded index's is read below; a file carries none
  auto ends_with = [&](const char* s) { const std::size_t n = std::strlen(s); return path.size() >= n && path.compare(path.size() - n, n, s) == 0; };
  const bool split = ends_with(".safetensors.index.json");
  if (std::filesystem::is_directory(path)) return I.load_sharded_checkpoint(path + "/index.json");
  if (!split && ends_with(".json")) return I.load_sharded_checkpoint(path);
  const auto file = split ? read_safetensors_split(path) : read_safetensors_index(path);
  const std::string label = "checkpoint '" + path + "'";
  // Each tensor is read front to back (the parameters whole, the state window by window): its
  // CRC runs along and is checked once its last byte is in, when the file has checksums (files
  // from elsewhere, torch's among them, have none).
  const auto crcs = safetensors_checksums(file);
  std::map<std::string, std::pair<std::uint32_t, std::uint64_t>> running;  // crc, bytes read in order
  import_consolidated(I, file, label, [&](const std::string& key, std::uint64_t offset, void* out, std::uint64_t n) {
    file.read(key, offset, out, n);
    const auto want = crcs.find(key);
    if (want == crcs.end()) return;
    auto& [crc, done] = running[key];
    if (offset != done) throw Error(label + ", tensor '" + key + "': read out of order (a bug in shardflow)");
    crc = crc32_update(crc, out, n);
    done += n;
    if (done == file.tensors.at(key).bytes && crc != want->second)
      throw UsageError(label + ", tensor '" + key + "': checksum mismatch (the file is damaged)");
  });
  I.log->info("checkpoint '{}' loaded ({} optimizer step(s))", path, I.shard ? I.shard->steps() : 0);
}

std::int64_t Runtime::optimizer_steps() const {
  impl_->settle_last_step(Impl::LastStep::whole);  // Note [What the last step left, under prefetch]
  const auto& I = *impl_;
  return I.shard ? I.shard->steps() : 0;
}

}  // namespace shardflow
