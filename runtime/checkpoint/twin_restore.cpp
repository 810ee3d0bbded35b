// Note [Going on from the twins]
// With mirrored shards (Note [Mirrored shards]) a lost rank's optimizer state still exists at the
// step the job stopped in: its twin holds it one step behind, with the slice of the step in
// flight. resumed_step() then restores from memory, the survivors' and the twins', instead of
// going back to the newest snapshot: no completed step is lost, and no file is read.
// - What each rank kept: recover() hands the old round's shard (stopped, its buckets gone) to the
//   new Runtime. A process started afresh (a replacement) kept nothing.
// - The census: every rank says its old rank, its old shard's step count, the old world, whose
//   shard its twin mirrors and how its step count maps to iterations. The step to go on from is
//   the smallest step count among the survivors (a survivor that finished the failed step on its
//   side but not on every rank's undoes it: the owner keeps its pieces as they were before the
//   step in flight). Every old rank's shard needs a provider: itself if it survived, else the
//   survivor whose twin mirrors it; if some shard has neither (a rank and its twin both lost), or
//   a provider cannot reach that step, every rank goes back to the snapshot instead (the same
//   answer everywhere, from the same census).
// - The old round's buckets are adopted, as a snapshot's are (Note [No state moved before a load]).
// - The state then moves in windows of parameter coordinates: each provider writes its pieces
//   into the window, and each piece goes once to the ranks that need it (Note [Pieces to their
//   new owners]): the moments to the new owner and its twin, the values to every rank whose
//   parameters do not already hold them (Note [Values the ranks hold already]). The new
//   shard takes its own pieces (and its twin's), and every rank writes all parameters from the
//   values as the owners' step writes them (rounded to a 16-bit storage or wire), so no parameter
//   sync follows; frozen parameters come from the first survivor. Over two levels, which shift
//   only inside the hosts and by whole hosts, the pieces take those shifts (Note [Pieces over
//   two levels]), and a window with a piece that neither carries is summed instead, as a rebuild
//   sums them (Note [State migration]): each element one value and zeros, so exact too.
// - Either way each element arrives as it left: the restored state is the old one bit for bit.
//
// Note [Twins kept in place]
// A survivor's old twin holds its source's moments at the step gone on from, once reach() has
// applied the slice it held. Where the new round's twin on that rank mirrors the very same
// pieces (the same plan and distance: a lost rank replaced at the same world), they do not cross
// again: the rank gives the spans it keeps (all-gathered, so every rank leaves them out of its
// needs), and copies them from the old twin into its windows, where nothing arrives. A window
// that is summed takes them from the sum as before. At 2 hosts x 2 ranks with one rank replaced
// that is a quarter of the model's moments fewer into each host.
//
// Note [A join from memory]
// A node taken in live (Note [A node joins live]) used to get the whole snapshot of the join's
// step copied into its host's memory by its predecessor's launcher, and every rank then loaded
// it: the newcomer's ranks could start only once the whole snapshot had crossed the link (every
// rank's parameters and moments at the old world, 192 MiB for a 64 MiB model with AdamW, 1.6 s
// at 1 Gbit/s), although at the new world they own only part of the moments. Nobody is lost at a
// join, so every shard of the old round still exists, live, on its rank, at the join's step:
// recover() keeps it (as it keeps a shard with a twin), and the restore above goes on from the
// ranks' memory, each old rank its own provider. Each piece crosses once, to the rank that owns
// it at the new world (the newcomer's part of the moments, and the parameters' values where a
// rank's differ), and nothing is read from a file. The newcomer kept nothing and cannot tell on
// its own that this is a join: every rank learns it from resumed_step()'s all-reduce, which
// counts the ranks that kept a shard. The launcher then sends the newcomer only the snapshot's
// index (runtime/launch/grow_round.cpp), so that a later round can still fetch the files from
// the other hosts (SnapshotMirror::assemble); the ranks say they go on from memory by writing
// snapshot_env::kJoinFromMemory next to their snapshots. With Config::snapshot.trainer_state the
// join's snapshot waits for the trainer's state of its step, handed over at the next iteration's
// start (Note [The trainer's state in a snapshot]); the ranks leave that iteration right there,
// before any of its work, each keeping the state it was handed, so the census finds the
// trainer's state of the step it goes on from, as with the twins (below). (Had the ranks gone on
// to that iteration's end, as such a join once did, their shards would be a step past the
// trainer's state, and only a load of the snapshot could bring the two together.) If a rank of
// the old round was lost meanwhile, or no rank holds the trainer's state, the restore says so
// and the ranks load the snapshot. What it costs: until the restore ends a running rank holds its old
// shard beside the new one (at a join from world 1, the whole optimizer state once more), where
// the load held only the new one.
//
// Note [The trainer's state with the twins]
// With Config::snapshot.trainer_state the trainer's own state (an LR scheduler's counter) must go
// back to the step the model goes on from (Note [The trainer's state in a snapshot]); the twins go
// on from a step no snapshot may hold. So each rank also keeps that state in memory, for the last
// two steps: trainer_state_wanted() asks for it at every iteration's start (the state after the
// step just done, once the trainer's code after the step has run), not only for a snapshot. The
// census says which steps each rank holds. A failure can leave survivors one iteration apart (with
// forward prefetch one rank may have begun the next iteration, and handed over its state, while
// another failed in the wait of the last), so the state comes from any survivor that holds the
// step gone on from, broadcast to every rank (a replacement included), and trainer_state() then
// says it, as after a snapshot's load. If no survivor holds it (the trainer did not hand it over),
// every rank goes back to the snapshot, which carries its own: never a model at one step and a
// schedule at another.
#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <optional>
#include <functional>
#include <string>

#include "kernels/cpu/elementwise.hpp"
#include "runtime/checkpoint/background_save.hpp"
#include "runtime/checkpoint/piece_exchange.hpp"
#include "runtime/rank/runtime_impl.hpp"
#include "runtime/zero/shard.hpp"
#include "shardflow/errors.hpp"

namespace shardflow {

namespace {

// What one rank says in the census.
struct Said {
  int old_rank = -1;   // -1: a process that kept nothing
  std::int64_t steps = 0;
  int old_world = 0;
  int twin_of = -1;    // the old rank whose shard its twin mirrors
  std::int64_t offset = 0;  // iteration = steps + offset
  std::int64_t held[2] = {-1, -1};  // the steps whose trainer state it holds (-1: none)
};
constexpr std::size_t kWords = 7;
constexpr std::int64_t kExact = std::int64_t(1) << 24;  // integers an fp32 word carries exactly

// The restore's windows (Note [Windows in flight]).
constexpr std::size_t kWindow = std::size_t{1} << 19;  // elements: 2 MiB of fp32
constexpr std::size_t kWindowsInFlight = 8;
// Test hook (tests/test_recovery.cpp): SHARDFLOW_TEST_RESTORE_WINDOW=N makes the windows N elements,
// so that a test's small model crosses in many windows, several of them in flight. A value that is
// not a positive count is refused, not taken for the default.
std::size_t restore_window() {
  const char* v = std::getenv("SHARDFLOW_TEST_RESTORE_WINDOW");
  if (!v) return kWindow;
  std::size_t n = 0;
  const auto [end, ec] = std::from_chars(v, v + std::strlen(v), n);
  if (ec != std::errc{} || *end != '\0' || n == 0)
    throw UsageError(std::string("SHARDFLOW_TEST_RESTORE_WINDOW = '") + v + "': must be a positive count of elements");
  return n;
}

// Every rank's spans, from each rank's own (Note [Pieces to their new owners]): the number of
// spans, then the spans as 32-bit halves of their ends, padded to the most any rank has. The
// words travel as an all-gather's copies, never summed, so any bit pattern arrives as it left.
std::vector<Spans> gather_spans(const Spans& mine, int rank, int world, const std::function<void(const CollectiveOp&)>& run,
                                const std::string& what = "holds") {
  const auto gather = [&](std::vector<std::uint32_t>& send, std::size_t count, const std::string& tag) {
    std::vector<std::uint32_t> all(count * std::size_t(world));
    CollectiveOp op;
    op.kind = CollectiveKind::allgather;
    op.send = send.data();
    op.recv = all.data();
    op.count = count;
    op.tag = tag;
    run(op);
    return all;
  };
  std::vector<std::uint32_t> n{std::uint32_t(mine.size())};
  const auto counts = gather(n, 1, "restore from memory: how many spans each rank " + what);
  const std::size_t most = *std::max_element(counts.begin(), counts.end());
  std::vector<std::uint32_t> words(4 * most, 0u);
  for (std::size_t i = 0; i < mine.size(); ++i) {
    const std::uint64_t ends[2] = {mine[i].lo, mine[i].hi};
    for (int k = 0; k < 2; ++k) words[4 * i + 2 * k] = std::uint32_t(ends[k]), words[4 * i + 2 * k + 1] = std::uint32_t(ends[k] >> 32);
  }
  const auto all = most ? gather(words, 4 * most, "restore from memory: the spans each rank " + what) : std::vector<std::uint32_t>{};
  std::vector<Spans> out(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r)
    for (std::size_t i = 0; i < counts[std::size_t(r)]; ++i) {
      const std::uint32_t* w = all.data() + 4 * (most * std::size_t(r) + i);
      out[std::size_t(r)].push_back({std::size_t(w[0] | std::uint64_t(w[1]) << 32), std::size_t(w[2] | std::uint64_t(w[3]) << 32)});
    }
  return out;
}

}  // namespace

// Who holds what before the restore, and who needs which moments after it: the new owner and the
// new owner's twin. (The values: values_to_take, from the same holders.)
PieceExchange Runtime::Impl::twin_exchange(Shard* old, int old_rank, const std::vector<int>& twin_gives, std::int64_t steps, Spans& kept) {
  Spans mine;
  if (old) {
    mine = owned_spans(old->shard_plan(), old->param_base(), old_rank);
    for (const int x : twin_gives) mine = unite(mine, owned_spans(old->shard_plan(), old->param_base(), x));
  }
  const auto run = [&](const CollectiveOp& op) { run_now(op); };
  PieceExchange state{rank, world, gather_spans(mine, rank, world, run), {}, comm->shifts_unequal()};
  state.unequal_in_host = comm->shifts_unequal(/*in_host=*/true);
  const auto& sp = shard->shard_plan();
  const auto& base = shard->param_base();
  const auto* twin = shard->mirror();
  // Note [Twins kept in place]: the old twin's pieces where the new twin wants the same ones.
  kept.clear();
  if (old && old->mirror() && twin) {
    const Spans want = owned_spans(sp, base, shift_source(rank, world, twin->distance()));
    if (owned_spans(old->shard_plan(), old->param_base(), old->mirror()->source()) == want && old->mirror()->reach(steps)) kept = want;
  }
  const auto keeps = gather_spans(kept, rank, world, run, "keeps of its twin");
  for (int t = 0; t < world; ++t) {
    Spans need = owned_spans(sp, base, t);
    if (twin) need = unite(need, subtract(owned_spans(sp, base, shift_source(t, world, twin->distance())), keeps[std::size_t(t)]));
    state.needs.push_back(std::move(need));
  }
  return state;
}

std::optional<std::uint64_t> Runtime::Impl::restore_from_memory(std::uint64_t snapshot_step, bool kept_at_join) {
  auto& snap = persistence->snapshots;
  const auto kept = std::move(snap.salvage);
  snap.salvage = {};
  const Shard* old = kept.shard.get();
  // A survivor left alone (world 1: a lost host of two) keeps no twin from now on, but the one it
  // kept holds the lost shard: it goes on from that, as any round does (its collectives are the
  // identity there).
  if (!shard || !(shard->mirror() || (world == 1 && old && old->mirror()) || kept_at_join)) return std::nullopt;
  const bool twins = !kept_at_join;  // else every old rank its own provider
  const std::string from = twins ? "twins: " : "a join: ";
  const auto run_or_alone = [&](const CollectiveOp& op) {
    if (world > 1) run_now(op);
  };
  std::vector<float> words(kWords * std::size_t(world), 0.0f);
  {
    float* w = words.data() + kWords * std::size_t(rank);
    w[0] = old ? float(kept.rank) : -1.0f;
    w[1] = old ? float(old->steps()) : 0.0f;
    w[2] = old ? float(old->shard_plan().world) : 0.0f;
    w[3] = old && old->mirror() ? float(old->mirror()->source()) : -1.0f;
    w[4] = old ? float(kept.offset) : 0.0f;
    w[5] = w[6] = -1.0f;
    std::size_t k = 0;
    for (auto it = kept.trainer_states.rbegin(); it != kept.trainer_states.rend() && k < 2; ++it)
      w[5 + k++] = it->first < std::uint64_t(kExact) ? float(it->first) : -1.0f;
    CollectiveOp op;
    op.kind = CollectiveKind::allgather;
    op.send = w;
    op.recv = words.data();
    op.count = kWords;
    op.tag = from + "what each rank kept";
    run_or_alone(op);
  }
  std::vector<Said> said(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) {
    const float* w = words.data() + kWords * std::size_t(r);
    said[std::size_t(r)] = Said{int(w[0]), std::int64_t(w[1]), int(w[2]), int(w[3]), std::int64_t(w[4]), {std::int64_t(w[5]), std::int64_t(w[6])}};
  }
  // The same decision on every rank, from the same words.
  int old_world = 0, first_survivor = -1;
  std::int64_t steps = -1, offset = 0;
  for (int r = 0; r < world; ++r) {
    const auto& s = said[std::size_t(r)];
    if (s.old_rank < 0) continue;
    if (first_survivor < 0) first_survivor = r, old_world = s.old_world, offset = s.offset;
    if (s.old_world != old_world || s.offset != offset || s.old_rank >= old_world) return std::nullopt;  // not one old round
    // The census travels as fp32 words: exact up to 2^24 steps; past that, the snapshot.
    if (s.steps >= kExact || s.offset >= kExact || -s.offset >= kExact) {
      if (rank == 0) log->warn("{}a step count past 2^24 does not travel in the census; going back to the snapshot of step {}", from, snapshot_step);
      return std::nullopt;
    }
    steps = steps < 0 ? s.steps : std::min(steps, s.steps);
  }
  if (first_survivor < 0) return std::nullopt;  // a start: nothing kept anywhere
  if (std::uint64_t(steps + offset) < snapshot_step) return std::nullopt;  // a newer snapshot (not expected: the twins are never behind it)
  std::vector<int> provider(static_cast<std::size_t>(old_world), -1);  // [old rank] the new rank that gives its shard
  for (int r = 0; r < world; ++r)
    if (said[std::size_t(r)].old_rank >= 0) provider[std::size_t(said[std::size_t(r)].old_rank)] = r;
  std::vector<int> twin_gives;  // the lost old ranks whose shard this rank's twin gives
  for (int x = 0; x < old_world; ++x) {
    if (provider[std::size_t(x)] >= 0) continue;
    for (int r = 0; r < world; ++r)
      if (said[std::size_t(r)].old_rank >= 0 && said[std::size_t(r)].twin_of == x) provider[std::size_t(x)] = r;
    if (provider[std::size_t(x)] < 0) {
      if (rank == 0)
        log->warn("{}rank {} of the old round was lost{}; going back to the snapshot of step {}", from, x, twins ? " with its twin" : "",
                  snapshot_step);
      return std::nullopt;
    }
    if (provider[std::size_t(x)] == rank) twin_gives.push_back(x);
  }
  // Can each provider give its shards at `at`? (A twin brought there applies its held slice.) The
  // number of ranks that cannot, the same on every rank.
  const auto cannot_reach = [&](std::int64_t at) {
    float cannot = 0.0f;
    if (old) {
      std::vector<float> probe(1);
      cannot = old->export_at(at, 0, 0, probe.data(), 0) ? 0.0f : 1.0f;
      if (!twin_gives.empty() && !old->mirror()->reachable(at)) cannot = 1.0f;
    }
    control_collective(CollectiveKind::allreduce, &cannot, 1, from + "every provider reaches the step");
    return cannot;
  };
  float cannot = cannot_reach(steps);
  // Note [Syncs from the twin]: a twin fed by the syncs lacks the slice of a step whose syncs were
  // cut off, which its source's owner may have finished on every survivor. That step is then
  // discarded everywhere, as a step some rank had not finished is (the owners kept their pieces
  // from before it).
  if (cannot > 0.0f && steps > 0 && std::uint64_t(steps - 1 + offset) >= snapshot_step && cannot_reach(steps - 1) == 0.0f) {
    if (rank == 0) log->info("{}step {} stepped on every survivor, but its syncs to the twins were cut off; it is done again", from, steps + offset);
    --steps;
    cannot = 0.0f;
  }
  const std::uint64_t step = std::uint64_t(steps + offset);
  if (cannot > 0.0f) {
    if (rank == 0)
      log->warn("{}{} rank(s) cannot give their shards as they were after step {}; going back to the snapshot of step {}", from,
                int(cannot), step, snapshot_step);
    return std::nullopt;
  }
  // Note [The trainer's state with the twins]: a survivor that holds it for that step.
  int state_from = -1;
  if (cfg.snapshot.trainer_state && step > 0) {
    for (int r = 0; r < world && state_from < 0; ++r)
      for (const auto h : said[std::size_t(r)].held)
        if (said[std::size_t(r)].old_rank >= 0 && h == std::int64_t(step)) state_from = r;
    if (state_from < 0) {
      if (rank == 0)
        log->warn("{}no survivor holds the trainer's state of step {} (set_trainer_state at the iteration's start); going back "
                  "to the snapshot of step {}, which carries its own", from, step, snapshot_step);
      return std::nullopt;
    }
  }
  if (!twin_gives.empty() && !old->mirror()->reach(steps))  // reachable said it would
    throw Error(from + "rank " + std::to_string(rank) + "'s twin cannot be brought to step " + std::to_string(step) + " after all");

  // The old round's buckets first (rank 0's order, as the first survivor kept it), for the reason
  // a snapshot's are adopted (Note [No state moved before a load]): the next sums are then taken
  // over the same slices, in the same order, as the uninterrupted run's.
  {
    std::vector<float> order(registry.trainable(), 0.0f);
    if (rank == first_survivor) {
      std::size_t i = 0;
      for (const auto& bk : old->plan().buckets)
        for (const auto& e : bk.entries)
          if (i < order.size()) order[i++] = float(e.param);
    }
    control_collective(CollectiveKind::broadcast, order.data(), order.size(), from + "the old round's buckets", first_survivor);
    std::vector<std::uint32_t> params_in_order(order.begin(), order.end());
    if (!adopt_bucket_order(params_in_order))
      log->warn("{}the old round's buckets hold other parameters than this run trains; they are rebuilt after the first iteration", from);
  }
  // The state and the values, window by window: each element once, to where it is needed (Note
  // [Pieces to their new owners]; over two levels inside the hosts and by whole hosts, Note
  // [Pieces over two levels]), or summed as a rebuild sums them (Note [State migration]) where
  // the backend has neither, or a window holds a piece that no shift of two levels carries.
  const std::size_t total = shard->total_elements(), values = shard->state_slots();
  const std::size_t window_elements = restore_window();  // Note [Windows in flight], below
  const auto& params = registry.params();
  std::vector<float> part;
  bool by_every = true;
  for (int d = 1; d < world && by_every; ++d) by_every = comm->shifts_by(d);
  const int L = comm->in_host_ranks();
  const int host_ranks = !by_every && L > 1 && world % L == 0 && comm->shifts_by(L) ? L : 0;
  const bool shifts = world > 1 && (by_every || host_ranks > 0);
  const auto provide = [&](std::size_t slot, std::size_t begin, std::vector<float>& into) {  // what this rank holds, zeros elsewhere
    if (!old) return;
    old->export_at(steps, slot, begin, into.data(), into.size());
    if (twin_gives.empty()) return;
    part.resize(into.size());
    old->mirror()->export_state(slot, begin, part.data(), part.size());
    for (std::size_t i = 0; i < into.size(); ++i) into[i] += part[i];  // disjoint pieces: one of the two is zero
  };
  PieceExchange moments, values_moved;  // Note [Pieces to their new owners]
  Spans from_params;                     // values this rank gives from its parameters (Note [Values the ranks hold already])
  Spans twin_kept;  // Note [Twins kept in place]
  // [window] summed, not shifted: the moments' windows (every slot's alike) and the values'. Every
  // window at world 1 or without shifts; over two levels those with a piece no shift reaches.
  const std::size_t windows = (total + window_elements - 1) / window_elements;
  std::vector<char> moments_whole(windows, 1), values_whole(windows, 1);
  if (shifts) {
    moments = twin_exchange(kept.shard.get(), kept.rank, twin_gives, steps, twin_kept);
    moments.host_ranks = host_ranks;
    // Note [Values the ranks hold already]: the values only where a rank's parameters differ; the
    // fp32 masters of 16-bit parameters to their new owner and its twin whatever they hold.
    const bool masters = shard->migrate_slots() > values;
    auto held = values_to_take(moments, [&](std::size_t begin, std::vector<float>& w) { provide(values, begin, w); }, !masters);
    values_moved = PieceExchange{rank, world, std::move(held.holds), std::move(held.needs), moments.unequal, host_ranks, moments.unequal_in_host};
    from_params = std::move(held.from_params);
    if (masters)
      for (int t = 0; t < world; ++t)
        values_moved.needs[std::size_t(t)] = unite(values_moved.needs[std::size_t(t)], moments.needs[std::size_t(t)]);
    const auto mib = [](double elements) { return elements * sizeof(float) / double(1 << 20); };
    const auto sent = values * exchange_elements(moments, total, window_elements) + exchange_elements(values_moved, total, window_elements);
    std::size_t summed = 0;  // windows that no shift of two levels carries whole (Note [Pieces over two levels])
    for (std::size_t k = 0, begin = 0; k < windows; ++k, begin += window_elements) {
      const std::size_t n = std::min(window_elements, total - begin);
      moments_whole[k] = !routable(moments, begin, n);
      values_whole[k] = !routable(values_moved, begin, n);
      summed += values * std::size_t(moments_whole[k]) + std::size_t(values_whole[k]);
    }
    log->info("{}the state moves each piece once{}: this rank sends {:.1f} MiB{}{}, where summing it sends {:.1f} MiB", from,
              host_ranks ? " (inside the hosts and by whole hosts)" : "", mib(double(sent)),
              !moments.unequal                            ? " (the shifts padded to their longest pack)"
              : host_ranks && !moments.unequal_in_host    ? " (the shifts inside the hosts padded to their longest pack)"
                                                          : "",
              summed ? ", " + std::to_string(summed) + " window(s) of " + std::to_string((values + 1) * windows) +
                           " summed, a piece of each going to another host and local index"
                     : std::string(),
              mib(double((values + 1) * total) * 2.0 * double(world - 1) / double(world)));
  }
  // Note [Windows in flight]: the windows are small and several cross at once. Each is made (its
  // pieces copied out of the old shard and packed) while those before it cross the link, and
  // written into the new shard once it arrived, while those after it cross. One window of 16 MiB
  // at a time left the link idle for every copy (a join at 1 Gbit/s moved 128 MiB at 95 MB/s that
  // way); two of 16 MiB still lost a window's time at each end of the stream and a gap between
  // windows (the comm stream runs one collective after another, so a window's shift starts only
  // once the one before ended on both sides). kWindowsInFlight windows of kWindow elements (16
  // MiB in flight, half of what the two held) moved the same 128 MiB in 1.24-1.27 s against
  // 1.65-1.68 s (bench/RESULTS.md, "A node joins live"). Every rank starts the windows'
  // collectives in the same order, and two windows never share a coordinate, so what one writes
  // no other reads.
  struct Pending {
    std::size_t slot = 0, begin = 0;
    std::vector<float> window;
    bool whole = true;                  // the window ends whole on every rank: summed, or world 1
    WindowInFlight shifted;             // by shifts
    std::optional<Communicator::Started> summed;  // else, at world > 1: the window's all-reduce
  };
  std::deque<Pending> in_flight;
  const auto wait = [&](Communicator::Started& s) { comm->wait(s, cfg.timeouts.collective); };
  const auto finish = [&](Pending& p) {
    if (p.summed) wait(*p.summed);
    else finish_window(p.shifted, p.window, wait);
    if (p.slot < values || shard->migrate_slots() > values) shard->import_state(p.slot, p.begin, p.window);
    // The parameters in the window, as the owner's step leaves the trainer's storage: those this
    // rank took, or all of them after a sum.
    if (p.slot == values) write_values(p.begin, p.window, p.whole ? Spans{{0, total}} : values_moved.needs[std::size_t(rank)]);
  };
  try {
    for (std::size_t slot = 0; slot <= values; ++slot) {
      for (std::size_t begin = 0; begin < total; begin += window_elements) {
        Pending& p = in_flight.emplace_back();
        p.slot = slot, p.begin = begin;
        p.window.assign(std::min(window_elements, total - begin), 0.0f);
        const bool moment = slot < values;
        const PieceExchange& x = moment ? moments : values_moved;
        p.whole = (moment ? moments_whole : values_whole)[begin / window_elements] != 0;
        // A sum takes each element from one rank, zeros elsewhere: the holders' alone.
        provide(slot, begin, p.window);
        if (slot == values && !p.whole) values_from_params(begin, p.window, from_params);
        // The old twin's pieces where the new one takes them (Note [Twins kept in place]): moments,
        // and fp32 masters, which the twin imports too.
        if ((slot < values || shard->migrate_slots() > values) && !p.whole && !twin_kept.empty()) {
          part.resize(p.window.size());
          old->mirror()->export_state(slot, begin, part.data(), part.size());
          for (const auto& k : clip(twin_kept, begin, begin + part.size()))
            std::copy(part.begin() + std::ptrdiff_t(k.lo - begin), part.begin() + std::ptrdiff_t(k.hi - begin), p.window.begin() + std::ptrdiff_t(k.lo - begin));
        }
        const std::string tag = from + "restore state " + std::to_string(slot) + " from element " + std::to_string(begin);
        if (!p.whole) {
          p.shifted = start_window(x, begin, p.window, [&](const CollectiveOp& op) { return start_now(op); }, tag);
        } else if (world > 1) {
          CollectiveOp op;
          op.kind = CollectiveKind::allreduce;
          op.send = op.recv = p.window.data();
          op.count = p.window.size();
          op.tag = tag;
          p.summed = start_now(op);
        }
        if (in_flight.size() >= kWindowsInFlight) {
          finish(in_flight.front());
          in_flight.pop_front();
        }
      }
    }
    for (; !in_flight.empty(); in_flight.pop_front()) finish(in_flight.front());
  } catch (...) {
    // The windows still in flight hold the buffers their collectives write: they end first.
    for (auto& p : in_flight) {
      settle_window(p.shifted, wait);
      if (p.summed && p.summed->done.valid()) try {
          wait(*p.summed);
        } catch (...) {
        }
    }
    throw;
  }
  // Frozen parameters and the counters every rank shares, from the first survivor.
  if (world > 1) broadcast_params(first_survivor, (from + "frozen").c_str(), /*frozen_only=*/true);
  std::vector<float> counters(2 + params.size(), 0.0f);
  if (rank == first_survivor) {
    const auto [scale, tracker] = old->loss_scale_at(steps);
    counters[0] = scale, counters[1] = float(tracker);
    const auto sat_out = old->skipped_at(steps);
    for (std::size_t p = 0; p < params.size(); ++p) counters[2 + p] = float(sat_out[p]);
  }
  control_collective(CollectiveKind::broadcast, counters.data(), counters.size(), from + "step counters", first_survivor);
  if (state_from >= 0) {
    std::string blob;
    if (rank == state_from) blob = kept.trainer_states.at(step);
    std::uint32_t size = std::uint32_t(blob.size());
    control_collective(CollectiveKind::broadcast, &size, 1, from + "the trainer's state, its size", state_from);
    std::vector<std::uint32_t> words((std::size_t(size) + 3) / 4, 0u);
    std::memcpy(words.data(), blob.data(), blob.size());
    if (!words.empty()) control_collective(CollectiveKind::broadcast, words.data(), words.size(), from + "the trainer's state", state_from);
    blob.assign(reinterpret_cast<const char*>(words.data()), size);
    snap.trainer_states[step] = blob;  // held again here, should this round fail before the next hand-over
    snap.loaded_trainer_state = std::move(blob);
  }
  shard->set_steps(steps);
  std::vector<std::int64_t> sat_out(params.size());
  for (std::size_t p = 0; p < params.size(); ++p) sat_out[p] = std::int64_t(counters[2 + p]);
  shard->set_skipped(std::move(sat_out));
  shard->set_loss_scale(counters[0], int(counters[1]));
  shard->loaded();
  finish_initial_sync(true);
  snap.base = step;
  snap.step_offset = offset;
  snap.from_memory = true;
  int lost = 0;
  for (int x = 0; x < old_world; ++x) lost += said[std::size_t(provider[std::size_t(x)])].old_rank != x;
  if (twins)
    log->warn("twins: resumed after step {} from memory ({} of the old round's {} shard(s) from their twins), no step rolled back", step,
              lost, old_world);
  else
    log->info("a join: resumed after step {} from the ranks' memory (the old round's {} shard(s) from their ranks), no file read", step,
              old_world);
  return step;
}

namespace {
// Note [The trainer's state with the twins]: kept at every step only where a twin is kept.
bool twins_keep_trainer_state(const Config& cfg, const Shard* shard) { return cfg.snapshot.trainer_state && shard && shard->mirror(); }
}  // namespace

std::uint64_t Runtime::Impl::twin_trainer_state_wanted() const {
  if (!twins_keep_trainer_state(cfg, shard.get())) return 0;
  const auto& snap = persistence->snapshots;
  const std::uint64_t step = snap.base + iterations;
  return step > 0 && !snap.trainer_states.count(step) ? step : 0;
}

bool Runtime::Impl::hold_trainer_state(std::uint64_t step, const std::string& state) {
  if (!twins_keep_trainer_state(cfg, shard.get())) return false;
  auto& snap = persistence->snapshots;
  if (step == 0 || step != snap.base + iterations) return false;
  snap.trainer_states[step] = state;
  while (snap.trainer_states.size() > 2) snap.trainer_states.erase(snap.trainer_states.begin());
  return true;
}

}  // namespace shardflow
