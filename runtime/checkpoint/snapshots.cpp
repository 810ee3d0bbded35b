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
#include <algorithm>
#include <charconv>
#include <filesystem>

#include "runtime/runtime_impl.hpp"

namespace shardflow {
namespace {

namespace fs = std::filesystem;
constexpr std::string_view kPrefix = "step-";

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
    std::error_code ec;
    fs::remove_all(snapshot_dir(dir, step), ec);
    if (ec) log.warn("snapshots: could not remove {}: {}", snapshot_dir(dir, step), ec.message());
  }
}

}  // namespace

void Runtime::Impl::check_resumed() const {
  if (cfg.snapshot.dir.empty() || snapshots.resumed) return;
  throw UsageError("rank " + std::to_string(rank) + ": " + cfg.name_of("snapshot.dir") + " is set, but resumed_step() was not called " +
                   "before the first backward: call it once after configure_optimizer, before the first forward, and start the "
                   "data at the step it returns");
}

std::uint64_t Runtime::resumed_step() {
  auto& I = *impl_;
  if (I.snapshots.resumed) return I.snapshots.base;
  I.ensure_finalized();
  I.throw_if_failed();
  if (I.in_pass() || I.iterations > 0)
    throw UsageError("resumed_step() on rank " + std::to_string(I.rank) + " after training started: call it once before the first forward");
  I.snapshots.resumed = true;
  const auto& dir = I.cfg.snapshot.dir;
  if (dir.empty()) return 0;
  if (!I.groups)
    throw UsageError("resumed_step() on rank " + std::to_string(I.rank) + ": " + I.cfg.name_of("snapshot.dir") +
                     " snapshots the runtime's optimizer state, and this Runtime has no optimizer yet: call configure_optimizer "
                     "first (a trainer that steps its own optimizer keeps its own checkpoints)");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw UsageError(I.cfg.name_of("snapshot.dir") + " '" + dir + "' cannot be created on rank " + std::to_string(I.rank) + ": " + ec.message());
  std::uint32_t newest[2] = {0, 0};  // rank 0's newest complete step, low and high words
  if (I.rank == 0)
    for (const auto& [step, done] : snapshots_in(dir))
      if (done) newest[0] = std::uint32_t(step), newest[1] = std::uint32_t(step >> 32);
  I.control_collective(CollectiveKind::broadcast, newest, 2, "snapshot: the newest complete step");
  const std::uint64_t step = newest[0] | (std::uint64_t(newest[1]) << 32);
  if (step == 0) return 0;
  load_checkpoint(snapshot_dir(dir, step));
  I.snapshots.base = step;
  I.log->info("resumed from the snapshot of step {} ({})", step, snapshot_dir(dir, step));
  return step;
}

void Runtime::snapshot_if_due() {
  auto& I = *impl_;
  const auto every = std::uint64_t(I.cfg.snapshot.every);
  if (every == 0) return;
  const std::uint64_t step = I.snapshots.base + I.iterations;
  // Completed as soon as every rank's files are written: while one is pending the ranks agree on
  // that after each iteration (one word), so that completing it never waits for a disk (waiting at
  // the next iteration measured 70 -> 140 ms a step at K = 10 for a 64 MiB model), and a rank lost
  // after that costs at most `every` steps. Only a snapshot still unwritten when the next is due
  // is waited for.
  if (I.saves.pending && I.snapshots.started > 0) {
    const bool due = step % every == 0;
    float written = I.saves.pending->written.load(std::memory_order_acquire) ? 1.0f : 0.0f;
    if (!due) I.control_collective(CollectiveKind::allreduce, &written, 1, "snapshot: every rank's files written");
    if (due || written == float(I.world)) {
      wait_checkpoint();
      I.snapshots.started = 0;
      if (I.rank == 0) prune(I.cfg.snapshot.dir, I.cfg.snapshot.keep, *I.log);
    }
  }
  if (step % every != 0) return;
  save_sharded_checkpoint_async(snapshot_dir(I.cfg.snapshot.dir, step));
  I.snapshots.started = step;
}

}  // namespace shardflow
