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

// One shift of the exchange: by `distance` ranks, or inside each host (Note [Pieces over two levels]).
struct Route {
  int distance = 0;
  bool in_host = false;
};

std::vector<Route> routes(const PieceExchange& x) {
  std::vector<Route> out;
  const int L = x.host_ranks;
  if (L <= 0) {
    for (int d = 1; d < x.world; ++d) out.push_back({d, false});
    return out;
  }
  if (x.world % L != 0)
    throw Error("piece exchange: " + std::to_string(L) + " ranks a host do not divide the world of " + std::to_string(x.world));
  for (int d = 1; d < L; ++d) out.push_back({d, true});
  for (int d = L; d < x.world; d += L) out.push_back({d, false});
  return out;
}

// Whether a route's shift takes each rank's own count (Communicator::shifts_unequal): nothing padded.
bool unequal(const PieceExchange& x, const Route& s) { return s.in_host ? x.unequal_in_host : x.unequal; }

// Where rank r's pack goes, and where its arrival comes from.
int to_of(const PieceExchange& x, const Route& s, int r) {
  if (!s.in_host) return (r + s.distance) % x.world;
  const int L = x.host_ranks;
  return r / L * L + (r % L + s.distance) % L;
}
int from_of(const PieceExchange& x, const Route& s, int r) {
  if (!s.in_host) return (r - s.distance + x.world) % x.world;
  const int L = x.host_ranks;
  return r / L * L + (r % L - s.distance + L) % L;
}

// Whether ranks a and b take part in one sub-collective of a route: over two levels, one host's
// shift inside it, or one local index's lane for a shift by whole hosts; on one level, the world.
bool one_group(const PieceExchange& x, const Route& s, int a, int b) {
  const int L = x.host_ranks;
  return L <= 0 || (s.in_host ? a / L == b / L : a % L == b % L);
}

// The pack `rank` sends on a route, padded to the longest of its group's (the same for every rank
// of it, its source and its destination included): each sub-collective pads only to its own.
// Over two levels a lane whose ranks keep what they need sends less than one that carries a lost
// rank's state (Note [Twins kept in place], twin_restore.cpp).
std::size_t shift_count(const Window& w, const PieceExchange& x, const Route& s, int rank) {
  std::size_t most = 0;
  for (int r = 0; r < x.world; ++r)
    if (one_group(x, s, r, rank)) most = std::max(most, length(intersect(w.holds[std::size_t(r)], w.needs[std::size_t(to_of(x, s, r))])));
  return most;
}

// Whether any rank sends on a route (the same answer on every rank).
bool used(const Window& w, const PieceExchange& x, const Route& s) {
  for (int r = 0; r < x.world; ++r)
    if (!intersect(w.holds[std::size_t(r)], w.needs[std::size_t(to_of(x, s, r))]).empty()) return true;
  return false;
}

bool routable(const PieceExchange& x, const Window& w) {
  for (int r = 0; r < x.world; ++r)
    for (int t = 0; t < x.world; ++t)
      if (!reaches(x, r, t) && !intersect(w.holds[std::size_t(r)], w.needs[std::size_t(t)]).empty()) return false;
  return true;
}

}  // namespace

bool reaches(const PieceExchange& x, int from, int to) {
  const int L = x.host_ranks;
  return from == to || L <= 0 || from / L == to / L || from % L == to % L;
}

bool routable(const PieceExchange& x, std::size_t begin, std::size_t n) { return routable(x, clipped(x, begin, n)); }

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

Spans subtract(const Spans& a, const Spans& b) {
  Spans out;
  std::size_t j = 0;
  for (const auto& x : a) {
    std::size_t lo = x.lo;
    while (j < b.size() && b[j].hi <= lo) ++j;
    for (std::size_t k = j; k < b.size() && b[k].lo < x.hi; ++k) {
      if (b[k].lo > lo) out.push_back({lo, b[k].lo});
      lo = std::max(lo, b[k].hi);
    }
    if (lo < x.hi) out.push_back({lo, x.hi});
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
  if (!routable(x, w))
    throw Error(tag + ": a piece of [" + std::to_string(begin) + ", " + std::to_string(begin + window.size()) +
                ") goes to a rank of another host and local index than its holder's, which no shift over two levels reaches "
                "(Note [Pieces over two levels])");
  // Every pack is taken from what this rank holds, and every arrival goes where it holds nothing:
  // the shifts of all routes can be in flight together.
  WindowInFlight f;
  f.begin = begin;
  const auto all = routes(x);
  f.shifts.reserve(all.size());
  for (const Route& route : all) {
    if (!used(w, x, route)) continue;  // the same answer on every rank: nobody needs anything on this route
    const std::size_t count = shift_count(w, x, route, x.rank);
    const auto to = std::size_t(to_of(x, route, x.rank)), from = std::size_t(from_of(x, route, x.rank));
    auto& s = f.shifts.emplace_back();
    const Spans sends = intersect(w.holds[me], w.needs[to]);
    s.takes = intersect(w.holds[from], w.needs[me]);
    const bool exact = unequal(x, route);
    s.out.assign(exact ? length(sends) : count, 0.0f);
    s.in.resize(exact ? length(s.takes) : count);
    pack(sends, begin, window.data(), s.out.data());
    CollectiveOp op;
    op.kind = CollectiveKind::shift;
    op.send = s.out.data();
    op.recv = s.in.data();
    op.count = s.out.size();
    if (exact) op.recv_count = s.in.size();
    op.distance = route.distance;
    op.in_host = route.in_host;
    op.tag = tag + " by " + std::to_string(route.distance) + (route.in_host ? " inside the host" : "");
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
    const std::size_t size = std::min(window, total - begin);
    const Window w = clipped(x, begin, size);
    if (!routable(x, w)) {  // summed (Note [Pieces over two levels])
      n += 2 * size * std::size_t(x.world - 1) / std::size_t(x.world);
      continue;
    }
    for (const Route& route : routes(x))
      n += unequal(x, route) ? length(intersect(w.holds[std::size_t(x.rank)], w.needs[std::size_t(to_of(x, route, x.rank))]))
                             : shift_count(w, x, route, x.rank);
  }
  return n;
}

}  // namespace shardflow
