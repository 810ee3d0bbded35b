// Note [Pieces to their new owners] (piece_exchange.hpp).
#include "runtime/checkpoint/piece_exchange.hpp"

#include <algorithm>
#include <cstring>
#include <future>

#include "shardflow/errors.hpp"

namespace shardflow {

namespace {

Spans merged(Spans s) {
  std::sort(s.begin(), s.end(), [](const Span& a, const Span& b) { return a.lo < b.lo; });
  Spans out;
  for (const auto& x : s) {
    if (x.lo >= x.hi) continue;
    if (!out.empty() && x.lo <= out.back().hi)
      out.back().hi = std::max(out.back().hi, x.hi);
    else
      out.push_back(x);
  }
  return out;
}

// Copies the window's elements on `spans` (window coordinates from `begin`) into `packed` in
// order, or back the other way.
void pack(const Spans& spans, std::size_t begin, const float* window, float* packed) {
  for (const auto& s : spans) packed = std::copy(window + (s.lo - begin), window + (s.hi - begin), packed);
}
void unpack(const Spans& spans, std::size_t begin, const float* packed, float* window) {
  for (const auto& s : spans) {
    std::memcpy(window + (s.lo - begin), packed, (s.hi - s.lo) * sizeof(float));
    packed += s.hi - s.lo;
  }
}

struct Window {
  std::vector<Spans> holds, needs;  // [rank], clipped to the window
};

Window clipped(const PieceExchange& x, std::size_t begin, std::size_t n) {
  Window w;
  for (int r = 0; r < x.world; ++r) {
    w.holds.push_back(clip(x.holds[std::size_t(r)], begin, begin + n));
    w.needs.push_back(clip(x.needs[std::size_t(r)], begin, begin + n));
  }
  return w;
}

// The pack every rank sends at distance d: as long as the longest (the same on every rank).
std::size_t shift_count(const Window& w, int world, int d) {
  std::size_t most = 0;
  for (int r = 0; r < world; ++r)
    most = std::max(most, length(intersect(w.holds[std::size_t(r)], w.needs[std::size_t((r + d) % world)])));
  return most;
}

}  // namespace

Spans owned_spans(const ShardPlan& sp, const std::vector<std::size_t>& param_base, int rank) {
  Spans s;
  for (const auto& bk : sp.buckets)
    for (const auto& piece : bk.pieces[std::size_t(rank)]) {
      const std::size_t at = param_base[piece.param] + piece.param_off;
      s.push_back({at, at + piece.len});
    }
  return merged(std::move(s));
}

Spans unite(const Spans& a, const Spans& b) {
  Spans s = a;
  s.insert(s.end(), b.begin(), b.end());
  return merged(std::move(s));
}

Spans intersect(const Spans& a, const Spans& b) {
  Spans out;
  std::size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const std::size_t lo = std::max(a[i].lo, b[j].lo), hi = std::min(a[i].hi, b[j].hi);
    if (lo < hi) out.push_back({lo, hi});
    (a[i].hi < b[j].hi) ? ++i : ++j;
  }
  return out;
}

Spans clip(const Spans& a, std::size_t lo, std::size_t hi) {
  Spans out;
  auto it = std::upper_bound(a.begin(), a.end(), lo, [](std::size_t v, const Span& s) { return v < s.hi; });
  for (; it != a.end() && it->lo < hi; ++it) out.push_back({std::max(it->lo, lo), std::min(it->hi, hi)});
  return out;
}

std::size_t length(const Spans& a) {
  std::size_t n = 0;
  for (const auto& s : a) n += s.hi - s.lo;
  return n;
}

WindowInFlight start_window(const PieceExchange& x, std::size_t begin, const std::vector<float>& window,
                            const std::function<Communicator::Started(const CollectiveOp&)>& start, const std::string& tag) {
  const Window w = clipped(x, begin, window.size());
  const auto me = std::size_t(x.rank);
  // Every element a rank needs has a holder: a plan that misses one would leave zeros as state.
  // Checked for every rank, from the spans every rank has, so that all of them stop here together.
  for (int t = 0; t < x.world; ++t) {
    std::size_t covered = 0;
    for (int r = 0; r < x.world; ++r) covered += length(intersect(w.holds[std::size_t(r)], w.needs[std::size_t(t)]));
    if (covered != length(w.needs[std::size_t(t)]))
      throw Error(tag + ": rank " + std::to_string(t) + " needs " + std::to_string(length(w.needs[std::size_t(t)]) - covered) +
                  " element(s) of [" + std::to_string(begin) + ", " + std::to_string(begin + window.size()) +
                  ") that no rank holds (Note [Pieces to their new owners])");
  }
  // Every pack is taken from what this rank holds, and every arrival goes where it holds nothing:
  // the shifts of all distances can be in flight together.
  WindowInFlight f;
  f.begin = begin;
  f.shifts.reserve(std::size_t(x.world));
  for (int d = 1; d < x.world; ++d) {
    const std::size_t count = shift_count(w, x.world, d);
    if (count == 0) continue;  // the same answer on every rank: nobody needs anything from d back
    const auto to = std::size_t((x.rank + d) % x.world), from = std::size_t((x.rank - d + x.world) % x.world);
    auto& s = f.shifts.emplace_back();
    const Spans sends = intersect(w.holds[me], w.needs[to]);
    s.takes = intersect(w.holds[from], w.needs[me]);
    s.out.assign(x.unequal ? length(sends) : count, 0.0f);
    s.in.resize(x.unequal ? length(s.takes) : count);
    pack(sends, begin, window.data(), s.out.data());
    CollectiveOp op;
    op.kind = CollectiveKind::shift;
    op.send = s.out.data();
    op.recv = s.in.data();
    op.count = s.out.size();
    if (x.unequal) op.recv_count = s.in.size();
    op.distance = d;
    op.tag = tag + " by " + std::to_string(d);
    s.started = start(op);
  }
  return f;
}

void finish_window(WindowInFlight& f, std::vector<float>& window, const std::function<void(Communicator::Started&)>& wait) {
  for (auto& s : f.shifts) {
    wait(s.started);
    unpack(s.takes, f.begin, s.in.data(), window.data());
  }
  f.shifts.clear();
}

void settle_window(WindowInFlight& f, const std::function<void(Communicator::Started&)>& wait) noexcept {
  for (auto& s : f.shifts) try {
      if (s.started.done.valid()) wait(s.started);
    } catch (...) {
      // the exception that unwinds is the caller's; this one only had to end
    }
  f.shifts.clear();
}

void exchange_window(const PieceExchange& x, std::size_t begin, std::vector<float>& window,
                     const std::function<void(const CollectiveOp&)>& run, const std::string& tag) {
  // Each shift run at once, a future already done standing for it.
  auto f = start_window(x, begin, window, [&](const CollectiveOp& op) {
    std::promise<void> done;
    run(op);
    done.set_value();
    return Communicator::Started{done.get_future(), op.tag};
  }, tag);
  finish_window(f, window, [](Communicator::Started& s) { s.done.get(); });
}

std::size_t exchange_elements(const PieceExchange& x, std::size_t total, std::size_t window) {
  std::size_t n = 0;
  for (std::size_t begin = 0; begin < total; begin += window) {
    const Window w = clipped(x, begin, std::min(window, total - begin));
    for (int d = 1; d < x.world; ++d)
      n += x.unequal ? length(intersect(w.holds[std::size_t(x.rank)], w.needs[std::size_t((x.rank + d) % x.world)])) : shift_count(w, x.world, d);
  }
  return n;
}

}  // namespace shardflow
