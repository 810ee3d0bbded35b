// Note [Sharded checkpoints]
// Each rank writes what it owns and nothing else: for every piece of the shard plan it owns (Note
// [Owned pieces]; stage 0 and runs without the runtime's optimizer: rank 0 owns everything), the
// parameter's slice and the optimizer state's slices, in parameter coordinates, into a
// safetensors file of its own: tensors "<param>@<offset>" and "optim.<param>.<slot>@<offset>",
// each slice's CRC-32 in the file's metadata (Note [Checksums in the header]). Rank 0 knows every rank's pieces (the plan is the
// same everywhere), so it writes the index without gathering anything: world size, stage,
// partition, bucket plan, step count, groups, and every slice with the rank whose file holds it.
// A save's files carry a name of their own (rank 0's id for the save), and the index is replaced
// last, so a crash at any point leaves the previous index and the files it names in place; the
// files of older saves go once the new index is on disk.
// Loading reads the index, every parameter slice (parameters are whole on every rank), and of
// the state only the slices that overlap the pieces this rank owns under its own plan, whatever
// world, stage and partition saved them; each slice read is checked against its checksum.
#include <nlohmann/json.hpp>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <thread>
#include <utility>

#include <sys/mman.h>

#include "kernels/cpu/elementwise.hpp"
#include "runtime/checkpoint/checkpoint_common.hpp"
#include "runtime/zero/optimizer_hyper.hpp"
#include "runtime/checkpoint/safetensors_stream.hpp"
#include "runtime/bootstrap/snapshot_env.hpp"

namespace shardflow {
namespace {

using namespace ckpt;
namespace fs = std::filesystem;

struct Slice {
  std::uint32_t param;
  std::size_t offset, length;  // elements into the parameter
};

// What rank r owns, as slices of parameters.
std::vector<Slice> owned_slices(const Shard* shard, const std::vector<ParamSpec>& params, int r) {
  std::vector<Slice> out;
  if (shard && shard->shard_plan().sharded) {
    for (const auto& b : shard->shard_plan().buckets)
      for (const auto& piece : b.pieces[std::size_t(r)])
        if (piece.len) out.push_back({piece.param, piece.param_off, piece.len});
    if (r == 0)  // frozen parameters are in no bucket and owned by no shard: rank 0 keeps them whole
      for (std::uint32_t p = 0; p < params.size(); ++p)
        if (const auto n = std::size_t(numel(params[p].shape)); n && !params[p].requires_grad) out.push_back({p, 0, n});
  } else if (r == 0) {
    for (std::uint32_t p = 0; p < params.size(); ++p)
      if (const auto n = std::size_t(numel(params[p].shape))) out.push_back({p, 0, n});
  }
  return out;
}

// Memory for a staging copy: straight from the kernel, in huge pages where it grants them (a
// first save then faults in 2 MiB at a time instead of 4 KiB), not zeroed by us (every byte is
// copied into).
std::shared_ptr<std::byte> staging_memory(std::size_t bytes) {
  bytes = std::max<std::size_t>(bytes, 1);
  void* m = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) throw Error("save_sharded_checkpoint: cannot map " + std::to_string(bytes) + " bytes for the staging copy: " + std::strerror(errno));
  ::madvise(m, bytes, MADV_HUGEPAGE);  // a hint: refused, the pages are small
  return std::shared_ptr<std::byte>(static_cast<std::byte*>(m), [bytes](std::byte* q) { ::munmap(q, bytes); });
}

std::string slice_name(const std::string& tensor, std::size_t offset) { return tensor + "@" + std::to_string(offset); }

std::string file_name(std::uint32_t id, int rank, int world) {
  char b[96];
  std::snprintf(b, sizeof b, "ckpt-%08x-rank%d-of-%d.safetensors", id, rank, world);
  return b;
}

// Note [Snapshots on the other host]: the launcher marks a rank's file once the other host holds
// it. Waited for as long as any wait on another rank.
bool await_copy(const std::string& marker, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  std::error_code ec;
  while (!fs::exists(marker, ec)) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

// (slot, checkpoint name) of each state slot parameter p has.
template <class RuntimeImpl>
std::vector<std::pair<std::size_t, std::string>> state_slots_of(const RuntimeImpl& I, std::uint32_t p) {
  std::vector<std::pair<std::size_t, std::string>> v;
  const Shard* shard = I.shard.get();
  const std::size_t slots = shard ? shard->migrate_slots() : 0;
  for (std::size_t s = 0; s < slots; ++s)
    if (auto n = slot_name(I.registry.params(), *shard, *I.groups, I.cfg, p, s); !n.empty()) v.emplace_back(s, std::move(n));
  return v;
}

// Every slice of the parameters and of each state slot that this rank owns, as a sharded
// checkpoint's file names them (name@offset, 1-D): add(name, safetensors dtype, elements, bytes,
// fill(to)) for each. The save's staging copy and shard_state_dict() both walk it.
template <class RuntimeImpl, class Add>
void for_each_own_slice(const RuntimeImpl& I, const std::vector<Slice>& mine, Add&& add) {
  const auto& params = I.registry.params();
  const Coordinates at(params);
  const Shard* shard = I.shard.get();
  for (const auto& sl : mine) {
    const auto& p = params[sl.param];
    const std::size_t es = dtype_size(p.dtype);
    add(slice_name(p.name, sl.offset), safetensors_dtype(p.dtype), sl.length, sl.length * es,
        [&](std::byte* to) { std::memcpy(to, static_cast<const std::byte*>(p.data) + sl.offset * es, sl.length * es); });
    for (const auto& [s, name] : state_slots_of(I, sl.param))
      add(slice_name(state_key(p.name, name), sl.offset), "F32", sl.length, sl.length * 4, [&, s = s](std::byte* to) {
        shard->export_state(s, at.base[sl.param] + sl.offset, reinterpret_cast<float*>(to), sl.length);
      });
  }
}

}  // namespace

StateDict Runtime::shard_state_dict() {
  auto& I = *impl_;
  checkpoint_entry(I, *this, "shard_state_dict");
  StateDict out;
  for_each_own_slice(I, owned_slices(I.shard.get(), I.registry.params(), I.rank),
                     [&](std::string name, const char* dtype, std::size_t len, std::size_t bytes, auto fill) {
                       Tensor& t = out.tensors[name];
                       t.dtype = dtype;
                       t.shape = {std::int64_t(len)};
                       t.data.resize(bytes);
                       fill(t.data.data());
                     });
  out.metadata = optimizer_metadata(I.world, I.shard.get(), I.cfg, I.groups.get());
  out.metadata["shardflow.sharded"] = "1";
  out.metadata["shardflow.rank"] = std::to_string(I.rank);
  return out;
}

void Runtime::save_sharded_checkpoint(const std::string& dir) {
  // The synchronous save is the background one, waited for: one path to get right.
  save_sharded_checkpoint_async(dir);
  impl_->finish_checkpoint();
}

namespace {

// The trainer's state is bytes (a pickle, say); the index is JSON, whose strings are UTF-8.
std::string hex(const std::string& bytes) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (const unsigned char c : bytes) out += digits[c >> 4], out += digits[c & 15];
  return out;
}

std::string unhex(const std::string& text, const std::string& where) {
  auto value = [&](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    throw UsageError("checkpoint index '" + where + "': its trainer_state is not hexadecimal");
  };
  if (text.size() % 2) throw UsageError("checkpoint index '" + where + "': its trainer_state has an odd number of digits");
  std::string out(text.size() / 2, '\0');
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = char(value(text[2 * i]) << 4 | value(text[2 * i + 1]));
  return out;
}

// The index as of this save, written by wait_checkpoint once every shard is on disk: the step
// count and the plan are this moment's, whatever training does meanwhile. Every rank knows the
// plan, so another host's first rank builds the same index for its host's copy.
template <class RuntimeImpl>
std::string sharded_index(const RuntimeImpl& I, std::uint32_t id) {
  const auto& params = I.registry.params();
  const Shard* shard = I.shard.get();
  nlohmann::json j;
  j["format"] = "shardflow-sharded-checkpoint";
  j["version"] = 1;
  j["world_size"] = I.world;
  j["zero_stage"] = int(I.cfg.zero.stage);
  j["partition"] = partition_name(I.cfg.zero.partition);
  j["steps"] = shard ? shard->steps() : 0;
  const auto meta = optimizer_metadata(I.world, shard, I.cfg, I.groups.get());
  if (const auto g = meta.find("shardflow.param_groups"); g != meta.end()) j["param_groups"] = nlohmann::json::parse(g->second);
  if (const auto k = meta.find("shardflow.skipped_steps"); k != meta.end()) j["skipped_steps"] = nlohmann::json::parse(k->second);
  if (const auto f = meta.find("shardflow.frozen"); f != meta.end()) j["frozen"] = nlohmann::json::parse(f->second);
  if (const auto l = meta.find("shardflow.loss_scale"); l != meta.end()) j["loss_scale"] = nlohmann::json::parse(l->second);
  for (const auto& p : params) j["params"].push_back({{"name", p.name}, {"dtype", safetensors_dtype(p.dtype)}, {"shape", p.shape}});
  for (const auto& b : I.plan.buckets) {
    nlohmann::json names = nlohmann::json::array();
    for (const auto& e : b.entries) names.push_back(params[e.param].name);
    j["buckets"].push_back(names);
  }
  std::vector<std::string> files;
  for (int r = 0; r < I.world; ++r) {
    const auto theirs = owned_slices(shard, params, r);
    files.push_back(theirs.empty() ? "" : file_name(id, r, I.world));
    for (const auto& sl : theirs) {
      nlohmann::json state = nlohmann::json::array();
      for (const auto& sn : state_slots_of(I, sl.param)) state.push_back(sn.second);
      j["slices"].push_back({{"param", params[sl.param].name}, {"offset", sl.offset}, {"length", sl.length}, {"rank", r}, {"state", state}});
    }
  }
  j["files"] = files;
  return j.dump(1);
}

// The staging copy of a save: every owned slice of the parameters and of each state slot.
struct Staged {
  std::vector<SafetensorsWriter::Entry> entries;
  std::vector<std::pair<std::size_t, std::size_t>> where;  // (offset into bytes, length) per entry
  std::shared_ptr<std::byte> bytes;                         // BackgroundSaveState::staging's
  std::map<std::string, std::string> meta;
};

// Training may go on once the copy is taken; the checksums are the writer's work (save_async
// blocks only for the copy: bench_checkpoint measured 0.29 s with them computed here against
// 0.014 s for a memcpy).
template <class RuntimeImpl>
std::shared_ptr<Staged> stage_own_slices(RuntimeImpl& I, const std::vector<Slice>& mine) {
  const auto& params = I.registry.params();
  auto staged = std::make_shared<Staged>();
  std::size_t total = 0;
  for (const auto& sl : mine) total += sl.length * (dtype_size(params[sl.param].dtype) + 4 * state_slots_of(I, sl.param).size());
  if (I.persistence->saves.staging_bytes < total) {
    I.persistence->saves.staging.reset();  // before mapping the larger one: never both at once
    I.persistence->saves.staging = staging_memory(total);
    I.persistence->saves.staging_bytes = total;
  }
  staged->bytes = I.persistence->saves.staging;
  if (I.cfg.snapshot.every == 0) {  // saves now and then: the memory goes with this save's writer
    I.persistence->saves.staging.reset();
    I.persistence->saves.staging_bytes = 0;
  }
  std::size_t used = 0;
  for_each_own_slice(I, mine, [&](std::string name, const char* dtype, std::size_t len, std::size_t bytes, auto fill) {
    fill(staged->bytes.get() + used);
    staged->entries.push_back({std::move(name), dtype, {std::int64_t(len)}});
    staged->where.emplace_back(used, bytes);
    used += bytes;
  });
  staged->meta = optimizer_metadata(I.world, I.shard.get(), I.cfg, I.groups.get());
  staged->meta["shardflow.sharded"] = "1";
  staged->meta["shardflow.rank"] = std::to_string(I.rank);
  return staged;
}

// Writes the staged slices to `path` on a thread of the save's own; `out` hears how it went.
std::thread start_writer(std::shared_ptr<Staged> staged, std::string path, BackgroundSaveState::Pending* out) {
  return std::thread([staged = std::move(staged), path = std::move(path), out] {
    try {
      SafetensorsWriter file(path, staged->entries, staged->meta, /*checksums=*/true);
      for (std::size_t e = 0; e < staged->entries.size(); ++e)
        file.write(staged->entries[e].name, 0, staged->bytes.get() + staged->where[e].first, staged->where[e].second);
      file.commit();
    } catch (const std::exception& e) {
      out->failure = e.what();
    }
    out->written.store(true, std::memory_order_release);
  });
}

}  // namespace

void Runtime::save_sharded_checkpoint_async(const std::string& dir) {
  auto& I = *impl_;
  if (dir.empty()) throw UsageError("save_sharded_checkpoint: the directory is empty");
  checkpoint_entry(I, *this, "save_sharded_checkpoint");
  if (I.persistence->saves.pending) I.finish_checkpoint();  // one save in flight at a time
  // This save's name: rank 0's, so that no file of the checkpoint the index names is overwritten.
  // With it goes rank 0's word on whether the launcher wants the ranks in its next round (Note [A
  // node joins live]): one broadcast, which a snapshot pays anyway.
  const bool regroup_check = std::exchange(I.persistence->saves.next_regroup_check, false);
  // Rank 0 says too whether a regroup waits for this snapshot's trainer state (Note [The trainer's
  // state in a snapshot]), so that every rank leaves at the same iteration whatever its own Config.
  const bool trainer_state = std::exchange(I.persistence->saves.next_trainer_state, false);
  std::uint32_t words[2] = {I.rank == 0 ? std::uint32_t(std::random_device{}()) : 0, 0};
  if (I.rank == 0 && regroup_check) {
    std::error_code ec;
    words[1] = (fs::exists(fs::path(I.persistence->snapshots.memory_dir) / snapshot_env::kRegroup, ec) ? 1 : 0) | (trainer_state ? 2 : 0);
  }
  I.control_collective(CollectiveKind::broadcast, words, 2, "sharded checkpoint: save id");
  const std::uint32_t id = words[0];
  I.persistence->saves.regroup_asked = regroup_check && (words[1] & 1) != 0;
  I.persistence->saves.regroup_after_completion = (words[1] & 2) != 0;
  auto pending = std::make_unique<BackgroundSaveState::Pending>();
  pending->dir = dir;
  pending->step = I.persistence->snapshots.base + I.iterations;
  pending->awaits_trainer_state = trainer_state;
  const bool mirrored = std::exchange(I.persistence->saves.next_mirrored, false), host_index = std::exchange(I.persistence->saves.next_host_index, false);
  if (I.rank == 0 || host_index) pending->index = sharded_index(I, id);
  const auto mine = owned_slices(I.shard.get(), I.registry.params(), I.rank);
  pending->slices = mine.size();
  std::shared_ptr<Staged> staged;
  try {
    fs::create_directories(dir);
    staged = stage_own_slices(I, mine);
  } catch (const std::exception& e) {
    pending->failure = e.what();
  }
  if (!mine.empty() && pending->failure.empty()) {
    const std::string path = dir + "/" + file_name(id, I.rank, I.world);
    if (mirrored) pending->mirrored_marker = path + std::string(snapshot_env::kMirroredSuffix);
    pending->writer = start_writer(std::move(staged), path, pending.get());
  } else {
    pending->written.store(true, std::memory_order_release);  // nothing in the background
  }
  I.persistence->saves.pending = std::move(pending);
}

// A request to the rank actor (Note [The rank actor]), which runs finish_checkpoint() on its thread.
void Runtime::wait_checkpoint() {
  if (!impl_->persistence->saves.pending) return;
  if (impl_->client.on_rank_thread()) return impl_->finish_checkpoint();  // a RankCall (Note [The rank actor])
  impl_->client.ask<rank_api::checkpoint_done_atom, std::string, std::uint64_t>("wait_checkpoint()", rank_api::checkpoint_atom::value);
}

void Runtime::Impl::finish_checkpoint() {
  auto& I = *this;
  if (!I.persistence->saves.pending) return;
  auto pending = std::move(I.persistence->saves.pending);
  if (pending->writer.joinable()) pending->writer.join();
  if (!pending->mirrored_marker.empty() && pending->failure.empty() && !await_copy(pending->mirrored_marker, I.cfg.timeouts.collective))
    I.log->warn("snapshot '{}': the copy of rank {}'s file did not reach {} within {} s: this snapshot is whole on this host only, and "
                "a restart after this host's loss resumes from an older one (or the disk's)",
                pending->dir, I.rank, I.persistence->snapshots.mirror, std::chrono::duration_cast<std::chrono::seconds>(I.cfg.timeouts.collective).count());
  finish_sharded_checkpoint(pending->dir, pending->index, pending->failure, pending->slices);
  I.client.subscribers->checkpoint_done(pending->dir, pending->step);
}

void Runtime::Impl::finish_sharded_checkpoint(const std::string& dir, const std::string& index, const std::string& written, std::size_t slices) {
  auto& I = *this;
  float failed = written.empty() ? 0.0f : 1.0f;
  I.control_collective(CollectiveKind::allreduce, &failed, 1, "sharded checkpoint: shards written");
  if (failed > 0)
    throw Error(written.empty() ? "save_sharded_checkpoint: " + std::to_string(int(failed)) + " rank(s) could not write their shard in '" +
                                      dir + "' (their errors say why); the previous checkpoint there is untouched"
                                : "save_sharded_checkpoint: rank " + std::to_string(I.rank) + ": " + written +
                                      "; the previous checkpoint in '" + dir + "' is untouched");
  std::string failure;
  float index_failed = 0.0f;
  if (I.rank == 0 || !index.empty()) try {
      // Test hook (tests/test_launch.cpp): SHARDFLOW_TEST_KILL_BEFORE_INDEX=N kills this process
      // at its N-th sharded save, every shard file written and the index not: a crash at the
      // worst moment, after which the previous checkpoint must still load.
      static std::atomic<int> saves{0};
      if (const char* k = std::getenv("SHARDFLOW_TEST_KILL_BEFORE_INDEX"); I.rank == 0 && k && std::atoi(k) == ++saves) ::raise(SIGKILL);
      write_file_atomically(dir + "/index.json", index);
      // The index names this save's files now: earlier saves' files go.
      const auto files = nlohmann::json::parse(index).at("files").get<std::vector<std::string>>();
      for (const auto& e : fs::directory_iterator(dir)) {
        const auto name = e.path().filename().string();
        if (name.rfind("ckpt-", 0) == 0 && e.path().extension() == ".safetensors" &&
            std::find(files.begin(), files.end(), name) == files.end())
          fs::remove(e.path());
      }
    } catch (const std::exception& e) {
      failure = e.what();
      index_failed = 1.0f;
    }
  I.control_collective(CollectiveKind::allreduce, &index_failed, 1, "sharded checkpoint: index written");
  if (index_failed > 0)
    throw Error(!failure.empty() ? "save_sharded_checkpoint: rank " + std::to_string(I.rank) + " writing '" + dir + "/index.json': " + failure
                                 : "save_sharded_checkpoint: the index of '" + dir + "' could not be written (rank 0's error, or that of "
                                   "another host's first rank for its copy, says why)");
  I.log->info("sharded checkpoint written to '{}' ({} slice(s) from this rank)", dir, slices);
}

namespace {

nlohmann::json read_sharded_index(const std::string& index_path) {
  nlohmann::json j;
  std::ifstream in(index_path);
  if (!in) throw UsageError("checkpoint index '" + index_path + "' cannot be read: " + std::strerror(errno));
  try {
    j = nlohmann::json::parse(in);
    if (j.at("format") != "shardflow-sharded-checkpoint") throw std::runtime_error("its format is not shardflow-sharded-checkpoint");
  } catch (const std::exception& e) {
    throw UsageError("checkpoint index '" + index_path + "' is not a shardflow sharded checkpoint index: " + e.what());
  }
  return j;
}

// The index's parameters are this run's, by name, shape and dtype; their indices by name.
std::map<std::string, std::uint32_t> match_index_params(const nlohmann::json& j, const std::vector<ParamSpec>& params, const std::string& index_path) {
  std::map<std::string, std::uint32_t> by_name;
  for (std::uint32_t p = 0; p < params.size(); ++p) by_name[params[p].name] = p;
  std::map<std::string, const nlohmann::json*> saved;
  for (const auto& p : j.at("params")) saved[p.at("name").get<std::string>()] = &p;
  for (const auto& p : params) {
    const auto it = saved.find(p.name);
    if (it == saved.end())
      throw UsageError("checkpoint '" + index_path + "' has no parameter '" + p.name + "' (a parameter of this run): a checkpoint of another model?");
    const auto shape = it->second->at("shape").get<Shape>();
    const auto dtype = it->second->at("dtype").get<std::string>();
    if (shape != p.shape || dtype != safetensors_dtype(p.dtype))
      throw UsageError("checkpoint '" + index_path + "', parameter '" + p.name + "' is " + dtype + " " + shape_str(shape) +
                       ", this run's " + safetensors_dtype(p.dtype) + " " + shape_str(p.shape));
  }
  for (const auto& [name, _] : saved)
    if (!by_name.count(name))
      throw UsageError("checkpoint '" + index_path + "' has a parameter '" + name + "' this run does not register: a checkpoint of another model?");
  return by_name;
}

// The ranks' files of one sharded checkpoint, each opened at its first use: a whole slice tensor
// read and its checksum checked.
class ShardFiles {
 public:
  ShardFiles(std::string index_path, std::vector<std::string> files)
      : index_path_(std::move(index_path)), dir_(fs::path(index_path_).parent_path().string()), files_(std::move(files)) {}

  void read(int r, const std::string& tensor, void* out, std::size_t bytes) {
    const auto& f = open(r, tensor);
    const auto e = f.index.tensors.find(tensor);
    if (e == f.index.tensors.end()) throw UsageError("checkpoint shard '" + f.index.path + "' has no tensor '" + tensor + "'");
    if (e->second.bytes != bytes)
      throw UsageError("checkpoint shard '" + f.index.path + "', tensor '" + tensor + "' holds " + std::to_string(e->second.bytes) +
                       " bytes, the index says " + std::to_string(bytes));
    f.index.read(tensor, 0, out, bytes);
    if (!f.crcs.count(tensor) || f.crcs.at(tensor) != crc32_update(0, out, bytes))
      throw UsageError("checkpoint shard '" + f.index.path + "', tensor '" + tensor + "': checksum mismatch (the file is damaged)");
  }

 private:
  struct Open {
    SafetensorsIndex index;
    std::map<std::string, std::uint32_t> crcs;
  };
  const Open& open(int r, const std::string& tensor) {
    if (r < 0 || std::size_t(r) >= files_.size() || files_[std::size_t(r)].empty())
      throw UsageError("checkpoint '" + index_path_ + "' names no file for rank " + std::to_string(r) + " (tensor '" + tensor + "')");
    auto it = opened_.find(r);
    if (it == opened_.end()) {
      Open o{read_safetensors_index(dir_ + "/" + files_[std::size_t(r)]), {}};
      o.crcs = safetensors_checksums(o.index);
      if (o.crcs.empty()) throw UsageError("checkpoint shard '" + o.index.path + "' has no checksums in its metadata");
      it = opened_.emplace(r, std::move(o)).first;
    }
    return it->second;
  }
  std::string index_path_, dir_;
  std::vector<std::string> files_;
  std::map<int, Open> opened_;
};

struct SlicePos {
  std::uint32_t param;
  std::size_t offset, length;
  int rank;
};
SlicePos slice_pos(const nlohmann::json& sl, const std::map<std::string, std::uint32_t>& by_name) {
  return {by_name.at(sl.at("param").get<std::string>()), sl.at("offset").get<std::size_t>(), sl.at("length").get<std::size_t>(),
          sl.at("rank").get<int>()};
}

// Every parameter slice into the trainer's parameters; true when the slices carry optimizer state.
bool load_param_slices(const nlohmann::json& j, const std::vector<ParamSpec>& params, const std::map<std::string, std::uint32_t>& by_name,
                       ShardFiles& files, const std::string& index_path) {
  const Coordinates at(params);
  bool has_state = false;
  for (const auto& sl : j.at("slices")) {
    const auto pos = slice_pos(sl, by_name);
    if (pos.offset + pos.length > at.size[pos.param])
      throw UsageError("checkpoint '" + index_path + "': a slice of '" + params[pos.param].name + "' lies outside it");
    const std::size_t es = dtype_size(params[pos.param].dtype);
    files.read(pos.rank, slice_name(params[pos.param].name, pos.offset), static_cast<std::byte*>(params[pos.param].data) + pos.offset * es,
               pos.length * es);
    has_state |= !sl.at("state").empty();
  }
  return has_state;
}

// Each state slot's slices that overlap rank `rank`'s pieces, read into its shard: saved state as
// it was, masters from the parameters just loaded when saved without them, a parameter frozen when
// saved starting afresh.
void load_owned_state(const nlohmann::json& j, const std::vector<ParamSpec>& params, const std::map<std::string, std::uint32_t>& by_name,
                      ShardFiles& files, bool has_state, Shard& shard, const OptimizerGroups& groups, const Config& cfg, int rank,
                      const std::string& index_path) {
  const Coordinates at(params);
  // The pieces this rank owns under its own plan, in parameter coordinates: only the slices
  // that overlap them are read.
  std::vector<std::pair<std::size_t, std::size_t>> owned;  // [begin, end)
  for (const auto& sl : owned_slices(&shard, params, shard.shard_plan().sharded ? rank : 0))
    owned.emplace_back(at.base[sl.param] + sl.offset, at.base[sl.param] + sl.offset + sl.length);
  if (const auto* mirror = shard.mirror())  // Note [Mirrored shards]: the twin's source's pieces too
    for (const auto& sl : owned_slices(&shard, params, mirror->source()))
      owned.emplace_back(at.base[sl.param] + sl.offset, at.base[sl.param] + sl.offset + sl.length);
  auto overlaps = [&](std::size_t b, std::size_t e) {
    for (const auto& [ob, oe] : owned)
      if (ob < e && b < oe) return true;
    return false;
  };
  const CheckpointField field = [&](const std::string& key) { return j.contains(key) ? j.at(key).dump() : std::string(); };
  const auto was_frozen = frozen_names(field, "checkpoint '" + index_path + "'");
  std::vector<float> values;
  for (std::size_t s = 0; s < shard.migrate_slots(); ++s) {
    const bool masters = s == shard.state_slots();
    if (!has_state && !masters) continue;  // parameters alone: the state starts anew
    for (const auto& sl : j.at("slices")) {
      const auto [p, off, len, r] = slice_pos(sl, by_name);
      const std::size_t begin = at.base[p] + off;
      if (!overlaps(begin, begin + len)) continue;
      const auto name = slot_name(params, shard, groups, cfg, p, s);
      if (name.empty()) continue;
      values.assign(len, 0.0f);
      const auto saved_state = sl.at("state").get<std::vector<std::string>>();
      if (std::find(saved_state.begin(), saved_state.end(), name) != saved_state.end()) {
        files.read(r, slice_name(state_key(params[p].name, name), off), values.data(), len * 4);
      } else if (masters) {  // saved without masters: they start from the parameters just loaded
        kernels::convert_to_f32(params[p].dtype, values.data(), static_cast<const std::byte*>(params[p].data) + off * dtype_size(params[p].dtype), len);
      } else if (was_frozen.count(params[p].name)) {  // frozen when saved: its state starts afresh (zeros)
      } else {
        throw UsageError("checkpoint '" + index_path + "' has no '" + state_key(params[p].name, name) + "' for this run's optimizer (" +
                         kind_name(groups.groups[groups.group_of[p]].kind) + "): saved with another optimizer?");
      }
      shard.import_state(s, begin, values);
    }
  }
  if (has_state) {
    shard.set_steps(j.at("steps").get<std::int64_t>());
    restore_counters(shard, params, cfg, was_frozen, field, "checkpoint '" + index_path + "'");
  }
  shard.loaded();
}

}  // namespace

void Runtime::Impl::load_sharded_checkpoint(const std::string& index_path) {  // after load_checkpoint's checkpoint_entry
  const auto j = read_sharded_index(index_path);
  try {
    if (j.contains("trainer_state"))
      persistence->snapshots.loaded_trainer_state = unhex(j.at("trainer_state").at("hex").get<std::string>(), index_path);
    const auto by_name = match_index_params(j, registry.params(), index_path);
    ShardFiles files(index_path, j.at("files").get<std::vector<std::string>>());
    const bool has_state = load_param_slices(j, registry.params(), by_name, files, index_path);
    if (!shard) return;
    load_owned_state(j, registry.params(), by_name, files, has_state, *shard, *groups, cfg, rank, index_path);
  } catch (const nlohmann::json::exception& e) {
    throw UsageError("checkpoint index '" + index_path + "' is malformed: " + e.what());
  }
  log->info("sharded checkpoint '{}' loaded ({} optimizer step(s))", index_path, shard ? shard->steps() : 0);
}

// ---- Note [The trainer's state in a snapshot] (snapshots.cpp) -------------------------------------
std::uint64_t Runtime::trainer_state_wanted() const {
  const auto& pending = impl_->persistence->saves.pending;
  if (pending && pending->awaits_trainer_state) return pending->step;
  return impl_->twin_trainer_state_wanted();  // Note [The trainer's state with the twins]
}

void Runtime::set_trainer_state(std::uint64_t step, const std::string& state) {
  auto& I = *impl_;
  const bool held = I.hold_trainer_state(step, state);
  auto* pending = I.persistence->saves.pending.get();
  if (!pending || !pending->awaits_trainer_state || pending->step != step) {
    if (held) return;
    throw UsageError("set_trainer_state(step " + std::to_string(step) + ") on rank " + std::to_string(I.rank) + ": " +
                     (pending && pending->awaits_trainer_state ? "the snapshot waiting for it is step " + std::to_string(pending->step)
                                                               : std::string("no snapshot is waiting for the trainer's state")) +
                     " (trainer_state_wanted() says which)");
  }
  pending->awaits_trainer_state = false;
  if (!pending->index.empty()) {  // a rank that writes no index keeps none
    auto j = nlohmann::json::parse(pending->index);
    j["trainer_state"] = {{"step", step}, {"hex", hex(state)}};
    pending->index = j.dump(1);
  }
  // Note [A join from memory]: a node joins at this snapshot. Its step's state, the trainer's
  // included, is all there is now, on every rank: the join goes on from it, before this
  // iteration does anything.
  if (std::exchange(I.persistence->snapshots.regroup_at_completion, false)) I.regroup_with_trainer_state(step, state);
}

std::optional<std::string> Runtime::trainer_state() const { return impl_->persistence->snapshots.loaded_trainer_state; }

std::optional<std::pair<std::string, std::uint64_t>> Runtime::Impl::pending_checkpoint() const {
  const auto& pending = persistence->saves.pending;
  if (!pending) return std::nullopt;
  return std::pair{pending->dir, pending->step};
}

}  // namespace shardflow
