// Note [Snapshots]
// A job that restarts (shardflow run --max-restarts, torchrun's restarts) should go on where it
// was without the trainer saving and finding checkpoints itself. With Config::snapshot the runtime
// takes a sharded checkpoint every `every` synchronised iterations into dir/step-<N>/ in the
// background (save_sharded_checkpoint_async: training waits only while each rank stages its
// slices), and completes it, writing the index last, at the end of the first iteration by which
// every rank's files are written (or at wait_checkpoint()). A snapshot without its index is incomplete and never loaded: a rank killed in
// the middle of a write leaves the one before as the newest. resumed_step(), once before the first
// forward, loads the newest complete snapshot. Rank 0 looks, and its choice is broadcast, so every
// rank loads the same one (across hosts the directory must be one every host sees). The trainer's
// data position follows the step it returns; with batches that depend only on the step, the run
// then ends where an uninterrupted one ends (bit for bit at the same world size on shm: the
// restart scenarios check it). Rank 0 removes every snapshot older than the newest `keep` complete
// ones once a newer one is complete.
//
// Note [Snapshots in memory]
// A snapshot on disk costs the disk's time and, on a small machine, the cores that copy it into
// the page cache and flush it (measured: the mean step of a 64 MiB model at K = 10 went from 61
// to 156 ms on a 2-core VM, 84-89 ms with the same files on tmpfs, which has no flush). A rank's
// death kills its process, not its host's memory: `shardflow run` creates a tmpfs
// directory that outlives every generation of ranks, removes it when the job ends, and names it
// in SHARDFLOW_SNAPSHOT_MEMORY. With Config::snapshot.memory (the default) the snapshots go there,
// and only every `disk_every` iterations one goes to `dir`, the fallback for the launcher's or
// the host's loss (or a job started again by hand). In memory the newest complete snapshot and the
// one being written stay (double-buffered: a write in flight never replaces the last complete
// one, since a snapshot counts only once its index is written). resumed_step() takes the newest
// complete snapshot of either place. The ranks decide together whether the memory is used: every
// host must have room for two snapshots of the whole model; otherwise every snapshot goes to
// disk, and the rank that lacks it says why. Across nodes each launcher copies its host's files
// into the next host's memory, the nodes taken as a ring (Note [Snapshots on the other host],
// runtime/launch/snapshot_mirror.hpp): a file counts as written once its copy is there, and the
// first rank of each host writes the index into its host's memory too. So one host's loss leaves
// a copy of every file. A snapshot in memory is loaded only when every host holds it whole (its
// index and every file it names): with two nodes each host holds every file anyway; with more,
// the launchers fetch what their host lacks from the others before a restart's ranks start.
//
// Note [The trainer's state in a snapshot]
// A snapshot brings the model and the optimizer back to its step; the trainer's own state must
// come back with them, or it goes on from where the process left it: an LR scheduler's counter
// after recover() (the survivors' scheduler stepped past the snapshot), or at 0 in a restarted
// process (silently another learning rate from there on). With Config::snapshot.trainer_state
// each snapshot waits for the trainer's state (bytes it encodes) and its index keeps it. The
// state must be the one that goes with the snapshot's step: after the trainer's code that follows
// the step (scheduler.step() comes after optimizer.step()), which has not run when the snapshot
// is staged at the iteration's end. So the trainer hands it over at the next iteration's start
// (trainer_state_wanted() / set_trainer_state(); shardflow.torch does it at each forward), and
// the snapshot completes no earlier than the end of that iteration in any case. A snapshot that
// completes without it (wait_checkpoint() before the next iteration, the run's end) carries none,
// and the trainer refuses to go on from it rather than guess (shardflow.torch says so, naming
// the object). A node that joins live (Note [A node joins live]) at such a snapshot waits for the
// trainer's state, and the ranks leave the next iteration as soon as they have handed it over
// (Note [A join from memory]).
#include <sys/statvfs.h>

#include <algorithm>
#include <charconv>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>

#include <nlohmann/json.hpp>

#include "runtime/bootstrap/snapshot_env.hpp"
#include "runtime/rank/runtime_impl.hpp"
#include "runtime/checkpoint/background_save.hpp"

namespace shardflow {
namespace {

namespace fs = std::filesystem;
constexpr std::string_view kPrefix = "step-";
std::string memory_offered() {
  const char* m = std::getenv(snapshot_env::kMemory);
  return m ? m : "";
}

// The newest complete snapshot in `dir`, 0 when none.
std::uint64_t newest_complete(const std::string& dir);

std::string snapshot_dir(const std::string& dir, std::uint64_t step) {
  return (fs::path(dir) / (std::string(kPrefix) + std::to_string(step))).string();
}

// The snapshots in `dir` by step, and whether each is complete (its index written).
std::vector<std::pair<std::uint64_t, bool>> snapshots_in(const std::string& dir) {
  std::vector<std::pair<std::uint64_t, bool>> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const auto name = e.path().filename().string();
    if (name.size() <= kPrefix.size() || name.compare(0, kPrefix.size(), kPrefix) != 0) continue;
    std::uint64_t step = 0;
    const char* end = name.data() + name.size();
    const auto [at, err] = std::from_chars(name.data() + kPrefix.size(), end, step);
    if (err != std::errc() || at != end) continue;
    found.emplace_back(step, fs::exists(e.path() / "index.json", ec));
  }
  std::sort(found.begin(), found.end());
  return found;
}

std::uint64_t newest_complete(const std::string& dir) {
  std::uint64_t newest = 0;
  for (const auto& [step, done] : snapshots_in(dir))
    if (done) newest = step;
  return newest;
}

void remove_snapshot(const std::string& dir, std::uint64_t step, spdlog::logger& log) {
  // Up to three tries: the launcher's mirror may still be marking a file of the snapshot as
  // copied, or receiving one into it, while it goes (remove_all then meets "Directory not empty");
  // the mirror skips what vanished.
  std::error_code ec;
  for (int attempt = 0; attempt < 3; ++attempt) {
    ec.clear();
    fs::remove_all(snapshot_dir(dir, step), ec);
    if (!ec) break;
  }
  if (ec) log.warn("snapshots: could not remove {}: {}", snapshot_dir(dir, step), ec.message());
}

// Rank 0, after a snapshot completed: everything older than the newest `keep` complete ones goes.
void prune(const std::string& dir, int keep, spdlog::logger& log) {
  const auto found = snapshots_in(dir);
  std::vector<std::uint64_t> complete;
  for (const auto& [step, done] : found)
    if (done) complete.push_back(step);
  if (complete.size() <= std::size_t(keep)) return;
  const std::uint64_t oldest_kept = complete[complete.size() - std::size_t(keep)];
  for (const auto& [step, done] : found) {
    if (step >= oldest_kept) break;
    remove_snapshot(dir, step, log);
  }
}

// Note [Snapshots of a timeline left behind]
// A rank lost while its step's snapshot was being written or copied leaves that snapshot without
// its index in the hosts' memory: never to be loaded, since the ranks go back to an older one and
// do its step again, writing it anew under new names. Its files were still going to the other
// host, though: the launcher's mirror sends every file not yet copied (Note [Snapshots on the
// other host]), and a 96 MiB file of the 64 MiB MLP took the link's whole rate for 1.3 s after the
// recovery, the first step after it at 1.1-1.2 s against 0.63 steady (2 hosts x 1 rank, 1 Gbit/s,
// bench/restart_time.py, whose kill falls right after a snapshot). So once the ranks have chosen
// the step they resume from, each host's first rank removes from its host's memory every
// snapshot newer than it that has no index; the mirror stops a file that was removed while it
// was on its way (SnapshotMirror::send_files). A snapshot with its index stays: it is complete,
// and a newer complete one than the step chosen is one the ranks could not load on every host.
void drop_left_behind(const std::string& memory, std::uint64_t resumed, spdlog::logger& log) {
  std::vector<std::uint64_t> dropped;
  for (const auto& [step, done] : snapshots_in(memory))
    if (step > resumed && !done) {
      remove_snapshot(memory, step, log);
      dropped.push_back(step);
    }
  if (!dropped.empty())
    log.info("snapshots: {} snapshot(s) newer than step {} without their index dropped from this host's memory (from step {}), "
             "and their copies to the other host with them",
             dropped.size(), resumed, dropped.front());
}

// A snapshot this host can load by itself: its index, and every file the index names.
bool whole(const std::string& snapshot) {
  std::ifstream in(snapshot + "/index.json");
  if (!in) return false;
  try {
    std::error_code ec;
    const auto index = nlohmann::json::parse(in);  // named: a range-for over parse(in).at(...) would dangle
    for (const auto& f : index.at("files"))
      if (const auto name = f.get<std::string>(); !name.empty() && !fs::exists(snapshot + "/" + name, ec)) return false;
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

std::uint64_t newest_whole(const std::string& dir) {
  const auto found = snapshots_in(dir);
  for (auto it = found.rbegin(); it != found.rend(); ++it)
    if (it->second && whole(snapshot_dir(dir, it->first))) return it->first;
  return 0;
}

// Whether this host's memory has room for `need` bytes, and why not when it has not (`disk`:
// where the snapshots go instead, for the message).
bool memory_room(int rank, const std::string& memory, std::size_t need, const std::string& disk, spdlog::logger& log) {
  if (memory.empty()) {
    log.warn("snapshots: rank {} was given no memory ({} is not set) while rank 0 was: every snapshot goes to {}", rank,
             snapshot_env::kMemory, disk);
    return false;
  }
  struct statvfs vfs {};
  if (::statvfs(memory.c_str(), &vfs) != 0) {
    log.warn("snapshots: rank {}: {} '{}' cannot be used ({}); every snapshot goes to {}", rank, snapshot_env::kMemory, memory,
             std::strerror(errno), disk);
    return false;
  }
  if (const std::size_t room = std::size_t(vfs.f_bavail) * vfs.f_frsize; room < need) {
    log.warn("snapshots: rank {}: {} MiB free in '{}' ({}), two snapshots of this model need {} MiB: every snapshot goes to {}", rank,
             room >> 20, memory, snapshot_env::kMemory, need >> 20, disk);
    return false;
  }
  return true;
}

}  // namespace

// The saved run's buckets (its index lists them), so that the resumed run adds its gradients up
// in the same order as an uninterrupted one would (Runtime::Impl::adopt_bucket_order).
void Runtime::Impl::adopt_saved_buckets(const std::string& snapshot) {
  auto& I = *this;
  std::ifstream in(snapshot + "/index.json");
  std::vector<std::uint32_t> order;
  try {
    const auto j = nlohmann::json::parse(in);
    std::map<std::string, std::uint32_t> by_name;
    for (std::uint32_t p = 0; p < I.registry.params().size(); ++p) by_name[I.registry.params()[p].name] = p;
    for (const auto& bucket : j.at("buckets"))
      for (const auto& name : bucket) {
        const auto it = by_name.find(name.get<std::string>());
        if (it == by_name.end()) return;  // another model: load_checkpoint names it
        order.push_back(it->second);
      }
  } catch (const std::exception&) {
    return;  // unreadable: load_checkpoint says why
  }
  if (!I.adopt_bucket_order(order))
    I.log->warn("snapshot '{}': its buckets hold other parameters than this run trains; the buckets are rebuilt after the first "
                "iteration instead (the sums' last bits may differ from an uninterrupted run's at world 3 and more)", snapshot);
}

void Runtime::Impl::check_resumed() const {
  if (cfg.snapshot.dir.empty() || persistence->snapshots.resumed) return;
  throw UsageError("rank " + std::to_string(rank) + ": " + cfg.name_of("snapshot.dir") + " is set, but resumed_step() was not called " +
                   "before the first backward: call it once after configure_optimizer, before the first forward, and start the "
                   "data at the step it returns");
}

std::uint64_t Runtime::resumed_step() {
  auto& I = *impl_;
  if (I.persistence->snapshots.resumed) return I.persistence->snapshots.base;
  I.ensure_finalized();
  I.throw_if_failed();
  if (I.in_pass() || I.iterations > 0)
    throw UsageError("resumed_step() on rank " + std::to_string(I.rank) + " after training started: call it once before the first forward");
  const auto& dir = I.cfg.snapshot.dir;
  if (!dir.empty()) {
    if (!I.groups)
      throw UsageError("resumed_step() on rank " + std::to_string(I.rank) + ": " + I.cfg.name_of("snapshot.dir") +
                       " snapshots the runtime's optimizer state, and this Runtime has no optimizer yet: call configure_optimizer "
                       "first (a trainer that steps its own optimizer keeps its own checkpoints)");
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw UsageError(I.cfg.name_of("snapshot.dir") + " '" + dir + "' cannot be created on rank " + std::to_string(I.rank) + ": " + ec.message());
  }
  // Only past the refusals: a refused call leaves the first backward refused too (check_resumed),
  // so the start-up broadcast left to this call (Note [Rank 0's state everywhere]) is never skipped.
  I.persistence->snapshots.resumed = true;
  if (dir.empty()) return 0;
  // The ranks decide together (Note [Snapshots in memory]): rank 0 names the newest complete
  // snapshot on disk and the newest whole one in its host's memory; every rank says whether its
  // host has room for memory snapshots and holds that one whole; the memory is used only if every
  // host has room, and its snapshot only if every host holds it.
  const std::string memory = I.cfg.snapshot.memory ? memory_offered() : "";
  std::uint32_t words[5] = {0, 0, 0, 0, 0};  // newest on disk (low, high), newest whole in memory (low, high), memory used
  if (I.rank == 0) {
    if (memory.empty() && I.cfg.snapshot.memory)
      I.log->info("snapshots: on disk only, in '{}' (no memory offered: {} is set by shardflow run)", dir,
                  snapshot_env::kMemory);
    const std::uint64_t on_disk = newest_complete(dir), in_memory = memory.empty() ? 0 : newest_whole(memory);
    words[0] = std::uint32_t(on_disk), words[1] = std::uint32_t(on_disk >> 32);
    words[2] = std::uint32_t(in_memory), words[3] = std::uint32_t(in_memory >> 32);
    words[4] = !memory.empty();
  }
  I.control_collective(CollectiveKind::broadcast, words, 5, "snapshot: the newest complete steps");
  const std::uint64_t on_disk = words[0] | (std::uint64_t(words[1]) << 32), in_memory = words[2] | (std::uint64_t(words[3]) << 32);
  // Ranks whose host cannot keep memory snapshots; ranks whose host lacks rank 0's newest; ranks
  // that kept their shard at a join (Note [A join from memory]: the newcomer kept nothing and
  // learns it here).
  float missing[3] = {0.0f, 0.0f, 0.0f};
  const auto& kept = I.persistence->snapshots.salvage.shard;  // with a twin: Note [Going on from the twins]
  missing[2] = kept && !kept->mirror() ? 1.0f : 0.0f;
  if (words[4]) {
    // Across nodes each host holds every rank's files once a restart assembled them: room for two
    // snapshots of the whole model.
    std::size_t need = 0;
    const std::size_t slots = I.shard ? I.shard->migrate_slots() : 0;
    for (const auto& p : I.registry.params()) need += std::size_t(numel(p.shape)) * (dtype_size(p.dtype) + 4 * slots);
    missing[0] = memory_room(I.rank, memory, 2 * need, I.cfg.name_of("snapshot.dir") + " '" + dir + "'", *I.log) ? 0.0f : 1.0f;
    missing[1] = in_memory != 0 && (missing[0] > 0 || !whole(snapshot_dir(memory, in_memory))) ? 1.0f : 0.0f;
  }
  I.control_collective(CollectiveKind::allreduce, missing, 3, "snapshot: every host holds the newest in memory");
  const bool use_memory = words[4] && missing[0] == 0;
  // The first rank of this host (the one rank without a launcher's LOCAL_RANK: rank 0): it writes
  // the index into the host's memory and drops what a lost round left there.
  const char* local = std::getenv("LOCAL_RANK");
  const bool host_first = local ? std::string(local) == "0" : I.rank == 0;
  if (use_memory) {
    I.persistence->snapshots.memory_dir = memory;
    std::ofstream(fs::path(memory) / snapshot_env::kInUse) << "the ranks keep their snapshots here\n";  // Note [A node joins live]
    std::ofstream(fs::path(memory) / snapshot_env::kJoinFromMemory) << "a node taken in gets its state from the ranks' memory\n";  // Note [A join from memory]
    const auto every = std::uint64_t(I.cfg.snapshot.every);
    I.persistence->snapshots.disk_every = I.cfg.snapshot.disk_every > 0 ? std::uint64_t(I.cfg.snapshot.disk_every) : 10 * every;
    // Note [Snapshots on the other host]: the launcher copies this host's files to the other node's memory.
    if (const char* m = std::getenv(snapshot_env::kMirror); m && *m) {
      I.persistence->snapshots.mirror = m;
      I.persistence->snapshots.host_index = I.rank != 0 && host_first;
    }
  }
  const bool from_memory = use_memory && in_memory != 0 && missing[1] == 0 && in_memory >= on_disk;
  const std::uint64_t step = from_memory ? in_memory : on_disk;
  if (const auto kept = I.restore_from_memory(step, missing[2] > 0)) return *kept;
  if (use_memory && host_first) drop_left_behind(memory, step, *I.log);  // Note [Snapshots of a timeline left behind]
  if (use_memory && in_memory != 0 && missing[1] > 0 && I.rank == 0)
    I.log->warn("snapshots: the snapshot of step {} in memory is not whole on every host ({} rank(s) lack files of it there): "
                "resuming from the disk's newest instead", in_memory, int(missing[1]));
  if (step == 0) {
    I.finish_initial_sync(false);
    I.persistence->snapshots.step_offset = 0 - (I.shard ? I.shard->steps() : 0);
    return 0;
  }
  const std::string from = snapshot_dir(from_memory ? I.persistence->snapshots.memory_dir : dir, step);
  I.adopt_saved_buckets(from);
  load_checkpoint(from);
  I.finish_initial_sync(true);
  I.persistence->snapshots.base = step;
  I.persistence->snapshots.step_offset = std::int64_t(step) - (I.shard ? I.shard->steps() : 0);
  I.log->info("resumed from the snapshot of step {} {} ({})", step, from_memory ? "in memory" : "on disk", from);
  return step;
}

void Runtime::Impl::snapshot_if_due() {
  auto& I = *this;
  const auto every = std::uint64_t(I.cfg.snapshot.every);
  if (every == 0) return;
  const std::uint64_t step = I.persistence->snapshots.base + I.iterations;
  // Completed as soon as every rank's files are written: while one is pending the ranks agree on
  // that after each iteration (one word), so that completing it never waits for a disk (waiting at
  // the next iteration measured 70 -> 140 ms a step at K = 10 for a 64 MiB model), and a rank lost
  // after that costs at most `every` steps. Only a snapshot still unwritten when the next is due
  // is waited for.
  auto& snaps = I.persistence->snapshots;
  // Note [The written word behind the syncs]
  // With forward prefetch wait() returns while the iteration's parameter syncs are still on the
  // comm stream, and a control word run at once waits for them (Note [Control words after
  // prefetched syncs]): the "every rank's files written" word of each iteration a snapshot is being
  // written then took the syncs' overlap with the next forward away (measured, world 2 at 0.5 GB/s,
  // a snapshot every 5 steps: 33.9 ms a step against 30.4 without snapshots, 34.6 without prefetch).
  // So there the word goes out on the comm stream behind the syncs, as a trainer's own collective
  // does (Runtime::collective), and is read at the next iteration's end: the snapshot completes one
  // iteration later, the same iteration on every rank, and nothing waits for the syncs.
  bool complete = false;
  if (snaps.word_done.valid()) {
    snaps.word_done.get();  // rethrows the word's failure (a lost peer), as a control word would
    complete = *snaps.word == float(I.world);
    snaps.word.reset();
  }
  if (I.persistence->saves.pending && snaps.started > 0) {
    const bool due = step % every == 0;
    // Across nodes a file counts once the next host holds its copy too (Note [Snapshots on the other host]).
    const auto& marker = I.persistence->saves.pending->mirrored_marker;
    std::error_code ec;
    float written = I.persistence->saves.pending->written.load(std::memory_order_acquire) && (marker.empty() || fs::exists(marker, ec)) ? 1.0f : 0.0f;
    if (!due && !complete && I.prefetching() && I.world > 1) {
      snaps.word = std::make_shared<float>(written);
      auto op = control_op(CollectiveKind::allreduce, snaps.word.get(), 1, "snapshot: every rank's files written");
      op.keep_alive = snaps.word;  // the runtime may go (a recovery) while the word is in flight
      snaps.word_done = facade->collective(std::move(op));
    } else if (!due && !complete) {
      I.control_collective(CollectiveKind::allreduce, &written, 1, "snapshot: every rank's files written");
      complete = written == float(I.world);
    }
    if (due || complete) {
      const std::uint64_t completed = snaps.started;
      complete_snapshot();
      if (std::exchange(snaps.regroup_at_completion, false)) regroup_at(completed);
    }
  }
  if (step % every != 0) return;
  const bool to_memory = !I.persistence->snapshots.memory_dir.empty() && step % I.persistence->snapshots.disk_every != 0;
  // The launcher stops copying when the job goes on without the other host (Note [A lost host
  // healed in place]): this process was started with a copy to wait for, and would wait in vain.
  std::error_code no_copies_ec;
  const bool copies = !I.persistence->snapshots.mirror.empty() &&
                      !fs::exists(fs::path(I.persistence->snapshots.memory_dir) / snapshot_env::kNoCopies, no_copies_ec);
  I.persistence->saves.next_mirrored = to_memory && copies;
  I.persistence->saves.next_host_index = to_memory && copies && I.persistence->snapshots.host_index;
  I.persistence->saves.next_regroup_check = to_memory;
  I.persistence->saves.next_trainer_state = I.cfg.snapshot.trainer_state;
  facade->save_sharded_checkpoint_async(snapshot_dir(to_memory ? I.persistence->snapshots.memory_dir : I.cfg.snapshot.dir, step));
  I.persistence->snapshots.started = step;
  I.persistence->snapshots.started_in_memory = to_memory;
  if (!std::exchange(I.persistence->saves.regroup_asked, false)) return;
  // Note [A node joins live]: the launcher takes a node in. This snapshot completes now, on every
  // rank alike (rank 0's word came with the save's id), and the iteration ends in the error every
  // in-place trainer already answers with recover(rejoin_process_group(...)): the next round's
  // world goes on from this very step, so no step is lost. A snapshot that waits for the trainer's
  // state (Note [The trainer's state in a snapshot]) completes once the trainer hands it over at the
  // next iteration's start, and the regroup happens there (regroup_with_trainer_state); should it
  // complete first (due at a later iteration's end), the regroup happens then, that iteration done
  // again in the next round.
  if (std::exchange(I.persistence->saves.regroup_after_completion, false)) {
    snaps.regroup_at_completion = true;
    return;
  }
  complete_snapshot();
  regroup_at(step);
}

// Note [A join from memory], with the trainer's state: the trainer handed over the state of the
// snapshot's step at this iteration's start, every rank alike (rank 0's word said the regroup
// waits for it). The snapshot completes here and every rank keeps that state in memory, where the
// restore's census finds it, so the join goes on from the ranks' memory at this very step, and
// the iteration just begun is left before any of its work.
void Runtime::Impl::regroup_with_trainer_state(std::uint64_t step, const std::string& state) {
  auto& snaps = persistence->snapshots;
  snaps.trainer_states[step] = state;
  while (snaps.trainer_states.size() > 2) snaps.trainer_states.erase(snaps.trainer_states.begin());
  complete_snapshot();
  regroup_at(step);
}

void Runtime::Impl::regroup_at(std::uint64_t step) {
  auto& I = *this;
  I.persistence->snapshots.regrouping = true;
  I.log->info("the launcher takes a node into the job: snapshot of step {} complete, going on in its next round", step);
  throw CommError("rank " + std::to_string(I.rank) + ": the launcher takes a node into the job after step " + std::to_string(step) +
                  " (Note [A node joins live]): recover in place (Runtime::recover(rejoin_process_group(...))) to go on at the larger "
                  "world from this step's snapshot");
}

// A snapshot is complete once every rank's files and its index are written.
void Runtime::Impl::complete_snapshot() {
  auto& I = *this;
  finish_checkpoint();
  I.persistence->snapshots.started = 0;
  // In memory the newest complete one stays (the one written next is the second buffer), pruned on
  // each host by the rank that writes its index there. Complete means every file is on two hosts
  // (Note [Snapshots on the other host]); with more than two nodes no host holds it whole until a
  // restart assembles it. On disk the newest `keep` stay, pruned by rank 0.
  if (I.rank == 0 || (I.persistence->snapshots.started_in_memory && I.persistence->snapshots.host_index))
    prune(I.persistence->snapshots.started_in_memory ? I.persistence->snapshots.memory_dir : I.cfg.snapshot.dir,
          I.persistence->snapshots.started_in_memory ? 1 : I.cfg.snapshot.keep, *I.log);
}

}  // namespace shardflow
