// A sharded checkpoint saved in the background (Runtime::save_sharded_checkpoint_async): this
// rank's file is written by `writer` from a staged copy; wait_checkpoint() joins it, and then the
// ranks agree and rank 0 writes the index (Note [Sharded checkpoints], sharded_checkpoint.cpp).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>

namespace shardflow {

struct BackgroundSaveState {
  struct Pending {
    std::string dir;
    std::uint64_t step = 0;  // synchronised iterations from the start of training when it was taken
    std::string index;  // the index as of the save, on the rank that writes it (rank 0; Note [Snapshots on the other host])
    std::string mirrored_marker;  // exists once the other host holds this rank's file; empty: no copy awaited
    std::thread writer;
    std::string failure;
    std::size_t slices = 0;
    std::atomic<bool> written{false};  // the writer is done (or had nothing to write): joining will not wait
    bool awaits_trainer_state = false;  // Note [The trainer's state in a snapshot]: not handed over yet
  };
  std::unique_ptr<Pending> pending;
  // The staging copy's memory, kept from one save to the next while the runtime takes snapshots:
  // fresh memory for a 64 MiB model's shard (~100 MB with AdamW's state) cost 300-450 ms of page
  // faults at every save on a 2-core VM, reused memory ~10 ms. One save is in flight at a time,
  // so the writer is done with it before the next save copies into it.
  std::shared_ptr<std::byte> staging;
  std::size_t staging_bytes = 0;
  // For the next save only (a snapshot into memory copied to the other host): this rank writes the
  // index into its host's copy too, and its file counts as written once the copy is there.
  bool next_host_index = false;
  bool next_mirrored = false;
  // For the next save only (a snapshot into memory): rank 0 asks its host's memory whether the
  // launcher wants the ranks in its next round (snapshot_env::kRegroup), and every rank learns the
  // answer with the save's id (regroup_asked).
  bool next_regroup_check = false;
  bool regroup_asked = false;
  // For the next save only (a snapshot, Config::snapshot.trainer_state): it waits for the
  // trainer's state; and rank 0's word on whether a regroup waits for the snapshot to complete.
  bool next_trainer_state = false;
  bool regroup_after_completion = false;
  // The runtime ends: a write in flight finishes first. With no wait_checkpoint() its index is
  // never written, so the previous checkpoint stays the one the directory names.
  void finish_writer() {
    if (pending && pending->writer.joinable()) pending->writer.join();
  }
};

// Note [Snapshots] (snapshots.cpp): where the runtime's own snapshots stand.
class Shard;

// Note [Going on from the twins]: what a recovering rank kept of the old round (no shard: nothing).
struct TwinSalvage {
  std::shared_ptr<Shard> shard;  // stopped, its buckets gone
  int rank = -1;                 // in the old round
  std::int64_t offset = 0;       // iteration = optimizer steps + offset there
  std::map<std::uint64_t, std::string> trainer_states;  // by step, as SnapshotState's
};

struct SnapshotState {
  bool resumed = false;       // resumed_step() ran (it must, before the first backward, with snapshots)
  std::uint64_t base = 0;     // the step resumed at: snapshot N is taken after base + iterations = N
  std::uint64_t started = 0;  // the step of the snapshot last started
  bool started_in_memory = false;
  // Note [Snapshots in memory]: where memory snapshots go (empty: none, every snapshot to disk),
  // and every how many iterations one goes to disk instead. Chosen by resumed_step().
  std::string memory_dir;
  std::uint64_t disk_every = 0;
  // Note [Snapshots on the other host]: the launcher copies this host's files to that node (its
  // label; empty: no copies), and whether this rank writes the index into this host's memory.
  std::string mirror;
  bool host_index = false;
  // Note [The written word behind the syncs]: with forward prefetch, the last iteration's "every
  // rank's files written" word, in flight on the comm stream behind that iteration's syncs; `word`
  // holds its sum once `word_done` is ready.
  std::shared_ptr<float> word;
  std::future<void> word_done;
  // Note [A node joins live]: this rank left its iteration for the launcher's next round (not a
  // failure: recover() tells the subscribers so).
  bool regrouping = false;
  // Note [The trainer's state in a snapshot]: a regroup asked at a snapshot that waits for the
  // trainer's state happens once it completes; and what the snapshot last loaded carried.
  bool regroup_at_completion = false;
  std::optional<std::string> loaded_trainer_state;
  // Note [Going on from the twins]: the iteration a step count of the shard is (set by
  // resumed_step), what recover() kept for the next resumed_step(), and whether that one restored
  // from the twins.
  std::int64_t step_offset = 0;
  TwinSalvage salvage;
  bool from_memory = false;
  // With Config::snapshot.trainer_state too: the trainer's state after the last two steps, handed
  // over at each iteration's start (Note [The trainer's state with the twins], twin_restore.cpp).
  std::map<std::uint64_t, std::string> trainer_states;
};

// All of the folder's state on a rank. Runtime::Impl holds it through a pointer (`persistence`,
// made by make_persistence_state), so the rank's floor never includes this header.
struct PersistenceState {
  BackgroundSaveState saves;  // Note [Sharded checkpoints]
  SnapshotState snapshots;    // Note [Snapshots]
};

}  // namespace shardflow
