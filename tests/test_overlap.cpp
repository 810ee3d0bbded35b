// Overlap, proven on the simulated link (the link costs time but no CPU, the synthetic trainer's
// compute sleeps): what each overlap mode hides behind backward and the next forward, read from
// Runtime::stats() and from the trace. Every check here fails when the overlap breaks (a shard that
// steps only after the last bucket leaves 0 buckets done in backward and the exposed time of
// `none`).
#include <doctest/doctest.h>
#include <nlohmann/json.hpp>
#include <malloc.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <set>

#include "examples/mlp/train.hpp"
#include "examples/synthetic/trainer.hpp"
#include "runtime/process/freed_memory.hpp"
#include "support/helpers.hpp"
#include "shardflow/sim.hpp"

using namespace shardflow;
using namespace std::chrono;

namespace {

double ms(nanoseconds t) { return double(t.count()) / 1e6; }

// 4 layers of 256 KiB over a 0.25 GB/s link with 10 us latency; backward spends 3x a bucket's link
// time (reduction + sync) per bucket, plus 0.3 ms.
synthetic::Options scenario(int world, int stage, Overlap overlap) {
  synthetic::Options o;
  o.world = world;
  o.layers = 4;
  o.numel = 65536;
  o.iterations = 12;
  o.link = SimLink{10.0, 0.25, 0};
  o.runtime.zero.stage = ZeroStage(stage);
  o.runtime.zero.overlap = overlap;
  o.runtime.timeouts.collective = seconds(30);
  o.optimizer.kind = OptimizerConfig::Kind::adamw;
  o.optimizer.lr = 1e-3f;
  const auto per_bucket = synthetic::reduce_time(o) + synthetic::sync_time(o);
  o.backward_per_layer = duration_cast<microseconds>(3 * per_bucket) + microseconds(300);
  o.forward_per_layer = microseconds(300);
  return o;
}

// Slack for message hops and thread wake-ups on a loaded 2-core machine.
constexpr double kSlackMs = 1.5;

// The last bucket's reduction, step and sync: the model's link time, or what the link took per
// bucket in this run if more (the real data movement and the peers' arrival add to it when the
// machine is busy), plus one bucket's step.
double last_bucket_ms(const synthetic::Options& o, const IterationStats& m) {
  return std::max(ms(synthetic::reduce_time(o) + synthetic::sync_time(o)), m.link_ms / double(o.layers)) + m.optimizer_ms / double(o.layers);
}

std::string trace_path(const std::string& what) {
  return "/tmp/shardflow_overlap_" + what + "_" + std::to_string(::getpid()) + ".json";
}

struct Span {
  std::string name, cat;
  int tid;
  std::int64_t ts, dur;
  nlohmann::json args;
  std::int64_t end() const { return ts + dur; }
};

// Rank r's complete spans and instants from a trace file.
std::map<int, std::vector<Span>> read_trace(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in.good());
  const auto j = nlohmann::json::parse(in);
  std::map<int, std::vector<Span>> by_rank;
  for (const auto& e : j.at("traceEvents")) {
    const std::string ph = e.at("ph");
    if (ph == "M") continue;
    by_rank[e.at("pid").get<int>()].push_back(Span{e.at("name"), e.value("cat", ""), e.at("tid").get<int>(), e.at("ts").get<std::int64_t>(),
                                                   ph == "X" ? e.at("dur").get<std::int64_t>() : 0,
                                                   e.value("args", nlohmann::json::object())});
  }
  return by_rank;
}

std::vector<Span> with_cat(const std::vector<Span>& v, const std::string& cat) {
  std::vector<Span> out;
  for (const auto& s : v)
    if (s.cat == cat) out.push_back(s);
  return out;
}

// The machine is shared: a scenario whose timing promise is missed is run again, up to three
// times in all. A broken overlap misses it every time (the mutations in the closing note of the
// issue failed all three), a busy neighbour rarely twice in a row.
template <class Ok>
synthetic::Result run_until(const synthetic::Options& o, Ok ok) {
  auto res = synthetic::run(o);
  for (int attempt = 1; attempt < 3 && !ok(res); ++attempt) {
    MESSAGE("timing promise missed on attempt " << attempt << ", running the scenario again");
    res = synthetic::run(o);
  }
  return res;
}

// ThreadSanitizer slows the runtime's own threads 5-15x against the simulated link's fixed times, and
// AddressSanitizer's -O1 build 2-3x, so promises about how much of the link hides behind backward
// mean nothing there (the order of collectives and the results are checked by the other suites,
// which run under both; CI's sanitize-address once missed one of these promises by 5 %).
bool timing_meaningful() {
  if (test::kSanitized) MESSAGE("skipped under a sanitizer: a timing promise");
  return !test::kSanitized;
}

}  // namespace

TEST_CASE("world 2 and 3, stages 1 and 2, interleaved: every bucket but the last is reduced, stepped and synced inside backward") {
  if (!timing_meaningful()) return;
  for (int world : {2, 3})
    for (int stage : {1, 2}) {
      auto o = scenario(world, stage, Overlap::interleaved);
      const auto res = run_until(o, [&](const synthetic::Result& x) {
        for (const auto& st : x.stats) {
          const auto& m = st.median;
          if (m.buckets_done_in_backward != 3 || m.exposed_ms > last_bucket_ms(o, m) + kSlackMs || m.hidden_ms < 0.6 * m.link_ms)
            return false;
        }
        return true;
      });
      for (int r = 0; r < world; ++r) {
        const auto& m = res.stats[std::size_t(r)].median;
        // Exposed: the last bucket's reduction, its step and its sync, and nothing more.
        const double bound = last_bucket_ms(o, m) + kSlackMs;
        INFO("world " << world << ", stage " << stage << ", rank " << r << ": exposed " << m.exposed_ms << " ms (bound " << bound
                      << "), link " << m.link_ms << " ms, hidden " << m.hidden_ms << " ms, done in backward " << m.buckets_done_in_backward);
        CHECK(m.buckets == 4);
        CHECK(m.buckets_done_in_backward == 3);
        CHECK(m.exposed_ms <= bound);
        // Most of the link time hid behind backward (3 of 4 buckets' worth).
        CHECK(m.hidden_ms >= 0.6 * m.link_ms);
      }
    }
}

// Note [The step chain, its turn aside]
TEST_CASE("interleaved, a rank late in the first backward (its peers' first reductions wait for it): the lag chosen on that "
          "iteration is chosen again on the settled fifth, and every bucket but the last is done inside backward") {
  if (!timing_meaningful()) return;
  for (int world : {2, 3})
    for (int stage : {1, 2}) {
      auto o = scenario(world, stage, Overlap::interleaved);
      o.first_backward_late = duration_cast<microseconds>(2 * (synthetic::reduce_time(o) + synthetic::sync_time(o)));
      const auto res = run_until(o, [&](const synthetic::Result& x) {
        for (const auto& st : x.stats)
          if (st.median.buckets_done_in_backward != 3) return false;
        return true;
      });
      for (int r = 0; r < world; ++r) {
        const auto& m = res.stats[std::size_t(r)].median;
        INFO("world " << world << ", stage " << stage << ", rank " << r << ": done in backward " << m.buckets_done_in_backward << ", exposed "
                      << m.exposed_ms << " ms");
        CHECK(m.buckets_done_in_backward == 3);
      }
    }
}

TEST_CASE("stats report the iteration's bound: at least the link's work, no more than the measured iteration, and interleaved comes closer to it than none") {
  if (!timing_meaningful()) return;
  auto ratio = [](const synthetic::Result& x) {
    const auto& m = x.stats[0].median;
    return m.bound_ms > 0 ? m.iteration_ms / m.bound_ms : 0.0;
  };
  const auto none_o = scenario(2, 1, Overlap::none), inter_o = scenario(2, 1, Overlap::interleaved);
  synthetic::Result none, inter;
  inter = run_until(inter_o, [&](const synthetic::Result& x) {
    none = synthetic::run(none_o);
    return ratio(x) > 0 && ratio(x) < ratio(none);
  });
  for (const auto* res : {&none, &inter})
    for (const auto& st : res->stats) {
      const auto& m = st.median;
      INFO("iteration " << m.iteration_ms << " ms, bound " << m.bound_ms << " ms, link " << m.link_ms << " ms, compute " << m.compute_ms << " ms");
      CHECK(m.bound_ms > 0);
      CHECK(m.bound_ms >= 0.98 * m.link_ms);
      CHECK(m.bound_ms <= m.iteration_ms + kSlackMs);
    }
  INFO("iteration / bound: none " << ratio(none) << ", interleaved " << ratio(inter));
  CHECK(ratio(inter) < ratio(none));
}

// Note [A window of another schedule]. Not a timing promise: which windows carry a bound, and
// that each window's over_bound and the medians follow from the figures.
TEST_CASE("forward prefetch, the split chosen by the runtime: the windows that hold two passes' syncs or none (where the waits change kind, where the runtime awaits a pass's syncs to choose again, and the one after) carry no bound — the others do, each with its own iteration / bound, and the median ratio is theirs") {
  auto o = scenario(2, 2, Overlap::interleaved);
  o.runtime.zero.forward_prefetch = true;  // the split chosen at iteration 1's end, again at 4's
  o.iterations = 14;
  const auto res = synthetic::run(o);
  for (const auto& st : res.stats) {
    std::vector<double> ratios, bounds;
    for (const auto& s : st.steps) {
      INFO("iteration " << s.iteration << ": " << s.iteration_ms << " ms, bound " << s.bound_ms << " ms, over_bound " << s.over_bound);
      // Iterations 0 and 1 wait for every sync (the first; the one that observes forward's
      // order), so window 2, the first whose wait returns early, holds no pass's syncs. Iteration
      // 4's wait awaits its syncs before the split is chosen again (on the settled fifth): window
      // 4 holds two passes' syncs and window 5 none.
      const bool other_schedule = s.iteration == 2 || s.iteration == 4 || s.iteration == 5;
      if (other_schedule) {
        CHECK(s.bound_ms == 0);
        CHECK(s.over_bound == 0);
        continue;
      }
      REQUIRE(s.bound_ms > 0);
      CHECK(s.over_bound == doctest::Approx(s.iteration_ms / s.bound_ms));
      if (s.iteration >= 5) {
        ratios.push_back(s.over_bound);
        bounds.push_back(s.bound_ms);
      }
    }
    REQUIRE(ratios.size() >= 7);
    std::sort(ratios.begin(), ratios.end());
    std::sort(bounds.begin(), bounds.end());
    auto median = [](const std::vector<double>& v) { return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]); };
    CHECK(st.median.over_bound == doctest::Approx(median(ratios)));
    CHECK(st.median.bound_ms == doctest::Approx(median(bounds)));
  }
}

// Under a sanitizer only what the modes guarantee is checked (none steps after every reduction,
// after_backward after backward's end, neither inside backward, the link busy after backward's end
// for the last reduction and every sync); what the link's timing makes happen besides (interleaved
// stepping inside backward, how much each mode exposes) is not.
TEST_CASE("none and after_backward keep the promises of their names — interleaved exposes less than both") {
  const bool timed = timing_meaningful();
  for (int stage : {1, 2}) {
    std::map<Overlap, double> exposed;
    for (auto overlap : {Overlap::none, Overlap::after_backward, Overlap::interleaved}) {
      auto o = scenario(2, stage, overlap);
      o.runtime.trace.path = trace_path(std::string("modes_") + overlap_name(overlap));
      // interleaved runs last: it must expose less than the two before it.
      const auto res = overlap != Overlap::interleaved || !timed ? synthetic::run(o) : run_until(o, [&](const synthetic::Result& x) {
        return x.stats[0].median.exposed_ms < std::min(exposed[Overlap::none], exposed[Overlap::after_backward]);
      });
      const auto& m = res.stats[0].median;
      exposed[overlap] = m.exposed_ms;
      INFO("stage " << stage << ", " << std::string(overlap_name(overlap)) << ": exposed " << m.exposed_ms << " ms, done in backward "
                    << m.buckets_done_in_backward);
      const auto trace = read_trace(o.runtime.trace.path);
      std::remove(o.runtime.trace.path.c_str());
      const auto& spans = trace.at(0);
      // Per iteration: when the last gradient was reported, when the last reduction completed, when
      // the first step began, when the last collective on the link ended.
      std::map<std::int64_t, std::int64_t> backward_end, last_reduce_end, last_link_end, first_step;
      for (const auto& s : spans) {
        const std::int64_t it = s.args.value("iteration", std::int64_t(-1));
        if (s.cat == "backward" && s.dur == 0) backward_end[it] = std::max(backward_end[it], s.ts);
        if (s.cat == "reduce") last_reduce_end[it] = std::max(last_reduce_end[it], s.end());
        if (s.cat == "reduce" || s.cat == "sync") last_link_end[it] = std::max(last_link_end[it], s.end());
        if (s.cat == "step" && !first_step.count(it)) first_step[it] = s.ts;
      }
      int checked = 0;
      for (std::int64_t it = 2; it < o.iterations; ++it) {
        CAPTURE(it);
        REQUIRE(first_step.count(it));
        if (overlap == Overlap::interleaved) {
          if (timed) CHECK(first_step[it] < backward_end[it]);  // stepping while backward still reports gradients
        } else if (overlap == Overlap::after_backward) {
          CHECK(first_step[it] >= backward_end[it]);                // not before backward handed everything over
          if (timed) CHECK(first_step[it] < last_reduce_end[it]);  // but before the last reduction is in
        } else {
          CHECK(first_step[it] >= last_reduce_end[it]);  // none: only once every reduction completed
        }
        if (overlap != Overlap::interleaved) {
          // Every sync waits for backward's end, so the link is busy after it for at least the last
          // reduction and all four syncs. Measured on the link's own spans, not by the trainer's
          // exposed time: a slow build (sanitizers at -O1) makes the trainer reach wait() later,
          // which hides link time behind the trainer's own work without any overlap by the runtime.
          CHECK(ms(microseconds(last_link_end[it] - backward_end[it])) >= 0.9 * ms(synthetic::reduce_time(o) + 4 * synthetic::sync_time(o)));
        }
        ++checked;
      }
      CHECK(checked == o.iterations - 2);
      if (overlap != Overlap::interleaved) {
        CHECK(m.buckets_done_in_backward == 0);
      }
    }
    if (!timed) continue;
    CHECK(exposed[Overlap::interleaved] < exposed[Overlap::after_backward]);
    CHECK(exposed[Overlap::interleaved] < exposed[Overlap::none]);
  }
}

// log_loss: a trainer that all-reduces its loss after every step (Runtime::collective, read after
// the next wait()) keeps the overlap: its collective queues behind the syncs on the comm stream
// instead of waiting for them on the trainer's thread (wait_all_params did that before).
TEST_CASE("forward prefetch, every sync after backward: the syncs of later layers complete during the next forward, loss logged or not") {
  if (!timing_meaningful()) return;
  for (const auto& [stage, log_loss] : {std::pair{1, false}, {2, false}, {1, true}, {2, true}}) {
    auto o = scenario(2, stage, Overlap::interleaved);
    o.log_loss = log_loss;
    o.runtime.zero.forward_prefetch = true;
    o.runtime.zero.prefetch_syncs_in_backward = 0;
    o.forward_per_layer = duration_cast<microseconds>(2 * synthetic::sync_time(o)) + microseconds(300);
    o.runtime.trace.path = trace_path("prefetch");
    int in_forward = 0, syncs = 0, stepped_in_backward = 0;
    // Each bucket steps as soon as it is reduced, whatever the syncs' order (Note [Which bucket
    // steps next]). This model is too small for stage 2 to pool its buckets (shardflow plan), so
    // stage 2's staging does not hold steps back either.
    const int steps_expected = (o.iterations - 3) * (o.layers - 1);
    auto count = [&](const synthetic::Result& x) {
      const auto trace = read_trace(o.runtime.trace.path);
      const auto& spans = trace.at(0);
      std::vector<Span> forwards, backwards;
      for (const auto& s : spans) {
        if (s.cat == "forward" && s.dur > 0) forwards.push_back(s);
        if (s.cat == "backward" && s.dur > 0) backwards.push_back(s);
      }
      in_forward = syncs = stepped_in_backward = 0;
      for (const auto& s : with_cat(spans, "sync")) {
        if (s.tid != 2) continue;  // the comm stream's sync collectives (not the unpacks)
        ++syncs;
        for (const auto& f : forwards)
          if (s.end() > f.ts && s.end() <= f.end()) ++in_forward;
      }
      for (const auto& s : with_cat(spans, "step"))
        for (const auto& b : backwards)
          if (s.ts >= b.ts && s.end() <= b.end()) ++stepped_in_backward;
      return in_forward >= (o.iterations - 3) * (o.layers - 1) && stepped_in_backward >= steps_expected &&
             x.stats[0].median.exposed_ms <= last_bucket_ms(o, x.stats[0].median) + kSlackMs;
    };
    const auto res = run_until(o, count);
    count(res);
    std::remove(o.runtime.trace.path.c_str());
    const auto& m = res.stats[0].median;
    INFO("stage " << stage << (log_loss ? ", loss logged" : "") << ": " << in_forward << " of " << syncs << " syncs completed inside a forward; " << stepped_in_backward
                  << " steps inside a backward; exposed " << m.exposed_ms << " ms, hidden " << m.hidden_ms << " of " << m.link_ms << " ms");
    // From the third iteration on (the first waits fully, the second records forward's order) the
    // syncs go out in forward order after backward: every layer but the first arrives in forward.
    CHECK(in_forward >= (o.iterations - 3) * (o.layers - 1));
    // The buckets reduced inside backward are stepped there, not held back behind the bucket the
    // next forward needs first (which is reduced last).
    CHECK(stepped_in_backward >= steps_expected);
    CHECK(m.exposed_ms <= last_bucket_ms(o, m) + kSlackMs);
  }
}

TEST_CASE("forward prefetch, split chosen by the runtime: backward has idle link time, so syncs go there and little is left to wait for") {
  if (!timing_meaningful()) return;
  for (int stage : {1, 2}) {
    auto o = scenario(2, stage, Overlap::interleaved);
    o.runtime.zero.forward_prefetch = true;  // prefetch_syncs_in_backward -1: measured in iteration 2
    const auto res = run_until(o, [&](const synthetic::Result& x) {
      for (const auto& st : x.stats)
        if (st.median.buckets_done_in_backward != 2 || st.median.exposed_ms > last_bucket_ms(o, st.median) + kSlackMs) return false;
      return true;
    });
    for (int r = 0; r < 2; ++r) {
      const auto& m = res.stats[std::size_t(r)].median;
      INFO("stage " << stage << ", rank " << r << ": exposed " << m.exposed_ms << " ms, hidden " << m.hidden_ms << " of " << m.link_ms
                    << " ms, done in backward " << m.buckets_done_in_backward);
      // Backward spends 3x the link time per bucket: every sync fits between the reductions; each
      // follows the next bucket's reduction, so the last two buckets' syncs are left for after
      // backward, and forward waits only for the last bucket's reduction, step and sync.
      CHECK(m.buckets_done_in_backward == 2);
      CHECK(m.exposed_ms <= last_bucket_ms(o, m) + kSlackMs);
    }
  }
}

TEST_CASE("clipping: reductions overlap backward — steps and syncs wait for the global norm after it") {
  auto o = scenario(2, 1, Overlap::interleaved);
  o.runtime.zero.clip_grad_norm = 1.0f;
  o.runtime.trace.path = trace_path("clip");
  // Per iteration from the third on: how many reductions completed while backward ran.
  std::map<std::int64_t, int> reduced_in_backward;
  auto all_but_last_reduced = [&](const synthetic::Result&) {
    const auto trace = read_trace(o.runtime.trace.path);
    std::map<std::int64_t, std::int64_t> backward_end;
    reduced_in_backward.clear();
    for (const auto& s : trace.at(0))
      if (s.cat == "backward" && s.dur > 0) backward_end[s.args.value("iteration", std::int64_t(-1))] = s.end();
    for (const auto& s : with_cat(trace.at(0), "reduce")) {
      const auto it = s.args.value("iteration", std::int64_t(-1));
      if (s.args.contains("bucket") && s.end() <= backward_end[it]) ++reduced_in_backward[it];
    }
    for (std::int64_t it = 2; it < o.iterations; ++it)
      if (reduced_in_backward[it] != 3) return false;
    return true;
  };
  const bool timing = timing_meaningful();  // when the reductions end against backward's end is one
  const auto res = run_until(o, [&](const synthetic::Result& x) { return !timing || all_but_last_reduced(x); });
  all_but_last_reduced(res);
  std::remove(o.runtime.trace.path.c_str());
  const auto& m = res.stats[0].median;
  INFO("exposed " << m.exposed_ms << " ms, done in backward " << m.buckets_done_in_backward);
  // Every step needs the norm, which needs every reduction: nothing is stepped inside backward ...
  CHECK(m.buckets_done_in_backward == 0);
  // ... but the reductions of all buckets but the last completed while backward ran.
  for (std::int64_t it = 2; timing && it < o.iterations; ++it) {
    CAPTURE(it);
    CHECK(reduced_in_backward[it] == 3);
  }
}

TEST_CASE("the trace of a world-2 run parses, has every category, and its spans agree with stats()") {
  mlp::TrainOptions opt;
  opt.sizes = {64, 128, 128, 128, 10};
  opt.steps = 10;
  opt.global_batch = 16;
  opt.world_size = 2;
  opt.optimizer.kind = OptimizerConfig::Kind::adamw;
  opt.runtime.zero.stage = ZeroStage::optimizer_state;
  opt.runtime.zero.overlap = Overlap::interleaved;
  opt.runtime.precision.comm_dtype = DType::bf16;  // casts
  opt.runtime.buckets.first_cap_bytes = 16384;
  opt.runtime.buckets.cap_bytes = 65536;
  opt.runtime.trace.path = trace_path("world2");
  opt.sim = SimLink{5.0, 1.0, 0};
  const auto res = mlp::train(opt);
  const auto trace = read_trace(opt.runtime.trace.path);
  {
    std::ifstream in(opt.runtime.trace.path);
    const auto j = nlohmann::json::parse(in);
    std::set<std::pair<int, int>> named;  // Perfetto needs numeric tids with thread names
    for (const auto& e : j.at("traceEvents"))
      if (e.at("name") == "thread_name") named.insert({e.at("pid").get<int>(), e.at("tid").get<int>()});
    for (const auto& [rank, spans] : trace)
      for (const auto& s : spans) CHECK(named.count({rank, s.tid}));
  }
  std::remove(opt.runtime.trace.path.c_str());
  REQUIRE(trace.size() == 2);
  for (const auto& [rank, spans] : trace) {
    CAPTURE(rank);
    std::set<std::string> cats;
    for (const auto& s : spans) cats.insert(s.cat);
    for (const char* c : {"forward", "backward", "reduce", "cast", "step", "sync", "wait", "rebuild", "iteration"}) {
      CAPTURE(c);
      CHECK(cats.count(c));
    }
    // No partially overlapping complete slices on one lane (nesting is fine).
    std::map<int, std::vector<Span>> lanes;
    for (const auto& s : spans)
      if (s.dur > 0) lanes[s.tid].push_back(s);
    for (auto& [tid, v] : lanes) {
      std::sort(v.begin(), v.end(), [](const Span& a, const Span& b) { return a.ts < b.ts || (a.ts == b.ts && a.dur > b.dur); });
      std::vector<std::int64_t> open;  // ends of the enclosing slices
      for (const auto& s : v) {
        while (!open.empty() && open.back() <= s.ts) open.pop_back();
        CAPTURE(tid);
        CAPTURE(s.name);
        if (!open.empty()) CHECK(s.end() <= open.back());
        open.push_back(s.end());
      }
    }
  }
  // Rank 0's spans, summed per iteration window, give the figures stats() computed.
  const auto& spans = trace.at(0);
  auto sum_in = [&](const std::string& cat, int tid, std::int64_t lo, std::int64_t hi) {
    std::int64_t t = 0;
    for (const auto& s : spans)
      if (s.cat == cat && s.tid == tid && s.dur > 0) t += std::max<std::int64_t>(0, std::min(hi, s.end()) - std::max(lo, s.ts));
    return double(t) / 1e3;
  };
  int compared = 0;
  for (const auto& it : with_cat(spans, "iteration")) {
    const auto k = std::size_t(it.args.at("iteration").get<std::int64_t>());
    REQUIRE(k < res.stats.steps.size());
    const auto& st = res.stats.steps[k];
    CAPTURE(k);
    CHECK(double(it.dur) / 1e3 == doctest::Approx(st.iteration_ms).epsilon(0.001));
    CHECK(sum_in("wait", 1, it.ts, it.end()) == doctest::Approx(st.exposed_ms).epsilon(0.01));
    CHECK(sum_in("reduce", 2, it.ts, it.end()) + sum_in("sync", 2, it.ts, it.end()) == doctest::Approx(st.link_ms).epsilon(0.01));
    CHECK(sum_in("step", 3, it.ts, it.end()) == doctest::Approx(st.optimizer_ms).epsilon(0.01));
    ++compared;
  }
  CHECK(compared == opt.steps);
}

TEST_CASE("an unwritable trace path is an error at start, naming the path") {
  auto world = InProcessWorld::create(1);
  Config cfg;
  cfg.trace.path = "/nonexistent-dir/trace.json";
  CHECK_THROWS_WITH_AS(Runtime(world->communicator(0), cfg), doctest::Contains("/nonexistent-dir/trace.json"), UsageError);
}

// Note [Keeping the trainer's freed memory]: a tensor the size of an activation, freed and asked
// for again, is served from the heap (no mapping of its own) and the heap is not trimmed under it,
// so the next forward does not fault its pages in again.
TEST_CASE("a Runtime keeps the trainer's freed memory for reuse: a 16 MiB block freed comes back from the heap, not a new mapping") {
  if (std::getenv("SHARDFLOW_KEEP_FREED_MEMORY") || std::getenv("GLIBC_TUNABLES") || std::getenv("MALLOC_MMAP_THRESHOLD_") ||
      std::getenv("MALLOC_TRIM_THRESHOLD_"))
    return;  // the environment chose for this process (the cases below cover those choices)
  auto world = InProcessWorld::create(1);
  Runtime rt(world->communicator(0));
  const auto& kept = keep_freed_memory(true);
#if defined(__SANITIZE_ADDRESS__)
  // AddressSanitizer's allocator stands in for glibc's and refuses its settings: the runtime
  // says so instead of claiming them. (ThreadSanitizer's lets glibc take them, unused, and
  // glibc's figures below stay still either way.)
  CHECK_FALSE(kept.keep);
  CHECK(kept.why == "glibc's mallopt refused the thresholds");
  return;
#endif
  REQUIRE(kept.keep);
  constexpr std::size_t bytes = std::size_t{16} << 20;
  const auto mapped_before = mallinfo2().hblkhd;
  char* raw = static_cast<char*>(std::malloc(bytes));
  REQUIRE(raw != nullptr);
  volatile char* block = raw;
  for (std::size_t i = 0; i < bytes; i += 4096) block[i] = 1;  // its pages in, as a tensor's
  CHECK(mallinfo2().hblkhd == mapped_before);                 // from the heap, not a mapping
  const auto heap_in_use = mallinfo2().arena;
  std::free(raw);
  CHECK(mallinfo2().arena == heap_in_use);  // not trimmed: the next forward finds it there
  // The setting is the process's: a later Runtime that asks otherwise is refused, not ignored.
  Config off;
  off.keep_freed_memory = false;
  try {
    Runtime other(world->communicator(0), off);
    FAIL("no error");
  } catch (const UsageError& e) {
    CHECK(std::string(e.what()).find("Config::keep_freed_memory = false cannot be honoured: it is process-wide") != std::string::npos);
  }
}

TEST_CASE("freed memory is left to malloc where the user chose (the Config, SHARDFLOW_KEEP_FREED_MEMORY=0, glibc's own settings), "
          "and a switch other than 0 or 1 is refused by name") {
  CHECK(choose_freed_memory(true, nullptr, nullptr, nullptr, nullptr).keep);
  CHECK(choose_freed_memory(true, "1", "glibc.malloc.tcache_count=0", nullptr, nullptr).keep);
  auto left = [](FreedMemoryChoice c, const std::string& why) {
    CHECK_FALSE(c.keep);
    CHECK(c.why.find(why) != std::string::npos);
  };
  left(choose_freed_memory(false, nullptr, nullptr, nullptr, nullptr), "Config::keep_freed_memory = false");
  left(choose_freed_memory(true, "0", nullptr, nullptr, nullptr), "SHARDFLOW_KEEP_FREED_MEMORY=0");
  left(choose_freed_memory(true, nullptr, "glibc.malloc.check=0:glibc.malloc.trim_threshold=0", nullptr, nullptr),
       "GLIBC_TUNABLES sets glibc.malloc.trim_threshold");
  left(choose_freed_memory(true, nullptr, "glibc.malloc.mmap_threshold=65536", nullptr, nullptr), "glibc.malloc.mmap_threshold");
  left(choose_freed_memory(true, nullptr, nullptr, "131072", nullptr), "MALLOC_MMAP_THRESHOLD_");
  left(choose_freed_memory(true, nullptr, nullptr, nullptr, "0"), "MALLOC_TRIM_THRESHOLD_");
  try {
    (void)choose_freed_memory(true, "yes", nullptr, nullptr, nullptr);
    FAIL("no error");
  } catch (const UsageError& e) {
    CHECK(std::string(e.what()).find("SHARDFLOW_KEEP_FREED_MEMORY must be 0") != std::string::npos);
    CHECK(std::string(e.what()).find("got 'yes'") != std::string::npos);
  }
}
