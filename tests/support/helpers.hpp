// Shared test plumbing: run N ranks as threads and collect what each one threw.
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <exception>
#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "collective_op.hpp"
#include "shardflow/shardflow.hpp"

namespace shardflow::test {

// Built with AddressSanitizer or ThreadSanitizer (`make sanitize`): promises about time or resident
// memory mean nothing there, and work that only repeats what a smaller case runs (a bigger buffer,
// the same cell with the other optimizer) is left to the Release pass, which runs it all.
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kAddressSanitized = true;
#else
inline constexpr bool kAddressSanitized = false;
#endif
#if defined(__SANITIZE_THREAD__)
inline constexpr bool kThreadSanitized = true;
#else
inline constexpr bool kThreadSanitized = false;
#endif
inline constexpr bool kSanitized = kAddressSanitized || kThreadSanitized;

// Runs fn(rank) on `n` threads; returns each rank's exception (null if it returned normally).
// The restore's windows for a scope: SHARDFLOW_TEST_RESTORE_WINDOW elements (Note [Windows in
// flight], twin_restore.cpp), or the default's with nullptr.
struct RestoreWindows {
  explicit RestoreWindows(const char* elements) {
    if (elements) ::setenv("SHARDFLOW_TEST_RESTORE_WINDOW", elements, 1);
  }
  ~RestoreWindows() { ::unsetenv("SHARDFLOW_TEST_RESTORE_WINDOW"); }
};

inline std::vector<std::exception_ptr> run_ranks(int n, const std::function<void(int)>& fn) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

inline std::string message_of(const std::exception_ptr& e) {
  if (!e) return "";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
}

// Registers `count` fp32 parameters "p0".."p<count-1>" of `numel` elements each, laid end to end
// in `flat` (which holds count * numel floats).
inline std::vector<Param> register_flat(Runtime& rt, float* flat, int count, std::int64_t numel) {
  std::vector<Param> h;
  for (int i = 0; i < count; ++i)
    h.push_back(rt.register_param({"p" + std::to_string(i), {numel}, DType::f32, Device::cpu(), flat + std::size_t(i) * std::size_t(numel)}));
  return h;
}

// ZeRO-1, interleaved, one bucket per parameter of `numel` floats: the forward-prefetch scenarios'
// runtime (test_trainer_collective, test_prefetch_order).
inline Config zero1_bucket_per_param(std::int64_t numel, bool forward_prefetch) {
  Config cfg;
  cfg.zero.stage = ZeroStage::optimizer_state;
  cfg.zero.overlap = Overlap::interleaved;
  cfg.zero.forward_prefetch = forward_prefetch;
  cfg.buckets.first_cap_bytes = cfg.buckets.cap_bytes = std::size_t(numel) * 4;
  return cfg;
}

// Fails the test with the rank's message if any rank threw.
inline void require_all_ok(const std::vector<std::exception_ptr>& errors) {
  for (std::size_t r = 0; r < errors.size(); ++r) {
    INFO("rank " << r << ": " << message_of(errors[r]));
    REQUIRE(!errors[r]);
  }
}

template <class E>
bool is(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const E&) {
    return true;
  } catch (...) {
    return false;
  }
}

// A world of n ranks (threads) meeting at the store on `port` (token "t"): each rank gets a copy of
// `base` (backend options extending StoreRendezvous) with its rank filled in, and make(options).
template <class Options, class Make>
std::vector<std::shared_ptr<Communicator>> store_world(int n, std::uint16_t port, const Options& base, Make make) {
  std::vector<std::shared_ptr<Communicator>> comms(static_cast<std::size_t>(n));
  require_all_ok(run_ranks(n, [&](int r) {
    Options o = base;
    o.rank = r;
    o.world_size = n;
    o.store_port = port;
    o.token = "t";
    comms[std::size_t(r)] = make(o);
  }));
  return comms;
}

// Runs every collective (all-reduce scaled by 0.5, reduce-scatter, all-gather, broadcast from the
// last rank, barrier) of `count` elements per rank on `comms` (one thread per rank) and returns
// how many output elements differ from the exact answer. `registered(r)`: rank r's buffers come
// from comm.allocate() rather than the heap.
inline std::size_t wrong_elements(const std::vector<std::shared_ptr<Communicator>>& comms, std::size_t count,
                                  const std::function<bool(int)>& registered = {}) {
  const int n = int(comms.size());
  auto value = [](int rank, std::size_t i) { return float((rank + 1) * int(i % 53) - 5 * rank); };
  struct Buffers {
    std::vector<std::shared_ptr<std::byte>> owned;
    float* get(Communicator& c, bool reg, std::size_t elems, std::vector<float>& heap) {
      if (!reg) {
        heap.assign(elems, -1.0f);
        return heap.data();
      }
      owned.push_back(c.allocate(std::max<std::size_t>(elems, 1) * 4));
      auto* p = reinterpret_cast<float*>(owned.back().get());
      std::fill_n(p, elems, -1.0f);
      return p;
    }
  };
  const auto N = static_cast<std::size_t>(n);
  std::vector<float*> ar(N), rs_in(N), rs_out(N), ag_in(N), ag_out(N), bc(N), sh_in(N), sh_next(N), sh_back(N);
  std::vector<Buffers> bufs(N);
  std::vector<std::vector<float>> heap(N * 9);
  require_all_ok(run_ranks(n, [&](int r) {
    const auto R = std::size_t(r);
    auto& c = *comms[R];
    const bool reg = registered && registered(r);
    ar[R] = bufs[R].get(c, reg, count, heap[9 * R]);
    bc[R] = bufs[R].get(c, reg, count, heap[9 * R + 1]);
    ag_in[R] = bufs[R].get(c, reg, count, heap[9 * R + 2]);
    ag_out[R] = bufs[R].get(c, reg, count * N, heap[9 * R + 3]);
    rs_in[R] = bufs[R].get(c, reg, count * N, heap[9 * R + 4]);
    rs_out[R] = bufs[R].get(c, reg, count, heap[9 * R + 5]);
    sh_in[R] = bufs[R].get(c, reg, count, heap[9 * R + 6]);
    sh_next[R] = bufs[R].get(c, reg, count, heap[9 * R + 7]);
    sh_back[R] = bufs[R].get(c, reg, count, heap[9 * R + 8]);
    for (std::size_t i = 0; i < count; ++i) ar[R][i] = bc[R][i] = ag_in[R][i] = sh_in[R][i] = value(r, i);
    for (std::size_t i = 0; i < count * N; ++i) rs_in[R][i] = value(r, i);
    c.run(make(CollectiveKind::allreduce, ar[R], ar[R], count, 0.5f), std::chrono::seconds(30));
    c.run(make(CollectiveKind::reduce_scatter, rs_in[R], rs_out[R], count), std::chrono::seconds(30));
    c.run(make(CollectiveKind::allgather, ag_in[R], ag_out[R], count), std::chrono::seconds(30));
    c.run(make(CollectiveKind::broadcast, bc[R], bc[R], count, 1.0f, n - 1), std::chrono::seconds(30));
    c.run(make(CollectiveKind::barrier, nullptr, nullptr, 0), std::chrono::seconds(30));
    for (const int distance : {1, -1}) {  // Note [Shift]: from rank r - 1, then from rank r + 1
      auto op = make(CollectiveKind::shift, sh_in[R], distance == 1 ? sh_next[R] : sh_back[R], count);
      op.distance = distance;
      c.run(op, std::chrono::seconds(30));
    }
  }));
  std::size_t bad = 0;
  for (int r = 0; r < n; ++r) {
    const auto R = std::size_t(r);
    for (std::size_t i = 0; i < count; ++i) {
      float sum = 0, rs = 0;
      for (int k = 0; k < n; ++k) {
        sum += value(k, i);
        rs += value(k, R * count + i);
      }
      bad += ar[R][i] != sum * 0.5f;
      bad += rs_out[R][i] != rs;
      bad += bc[R][i] != value(n - 1, i);
      for (int k = 0; k < n; ++k) bad += ag_out[R][std::size_t(k) * count + i] != value(k, i);
      bad += sh_next[R][i] != value((r + n - 1) % n, i);
      bad += sh_back[R][i] != value((r + 1) % n, i);
      bad += sh_in[R][i] != value(r, i);  // a shift's send is left alone
    }
  }
  return bad;
}

// ||a - b|| / ||b||
inline double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

}  // namespace shardflow::test
