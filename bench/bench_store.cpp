// The rendezvous store under load: set, get and add per second with 16 clients at once (each its
// own connection and thread, as 16 ranks rendezvousing), and the server's memory while clients try
// to store more than its limit. bench/RESULTS.md, "Hardening".
//
//   build/bench/bench_store [--clients 16] [--ops 2000] [--reps 3]
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "bench/proc_memory.hpp"
#include "shardflow/errors.hpp"
#include "shardflow/store.hpp"

using namespace shardflow;
using Clock = std::chrono::steady_clock;

namespace {

// `clients` threads each run `ops` calls of one kind; returns calls per second over all of them.
double rate(std::uint16_t port, int clients, int ops, const char* kind) {
  std::vector<std::thread> threads;
  const auto t0 = Clock::now();
  for (int c = 0; c < clients; ++c)
    threads.emplace_back([=] {
      TcpStoreClient cl("127.0.0.1", port, "bench", std::chrono::seconds(30));
      const std::string prefix = "k/" + std::to_string(c) + "/";
      for (int i = 0; i < ops; ++i) {
        const std::string key = prefix + std::to_string(i % 64);
        if (kind[0] == 's') cl.set(key, "10.0.0.1:29500");
        else if (kind[0] == 'g') cl.get(key);
        else cl.add("counter", 1);  // one key every client bumps: the contended case
      }
    });
  for (auto& t : threads) t.join();
  return double(clients) * ops / std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The TCP store: operations per second with many clients, and memory at its limit"};
  int clients = 16, ops = 2000, reps = 3;
  app.add_option("--clients", clients)->capture_default_str();
  app.add_option("--ops", ops, "calls per client per kind")->capture_default_str();
  app.add_option("--reps", reps)->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  StoreServerOptions o;
  o.token = "bench";
  o.max_bytes = std::size_t{64} << 20;  // 64 MB in all, to see the limit hold
  TcpStoreServer server(o);
  std::printf("bench_store: %d clients x %d calls per kind, loopback, %d rounds (set, get, add in turn)\n", clients, ops, reps);
  std::vector<double> set_r, get_r, add_r;
  for (int r = 0; r < reps; ++r) {
    set_r.push_back(rate(server.port(), clients, ops, "set"));
    get_r.push_back(rate(server.port(), clients, ops, "get"));
    add_r.push_back(rate(server.port(), clients, ops, "add"));
    std::printf("  round %d: set %8.0f/s  get %8.0f/s  add %8.0f/s\n", r + 1, set_r.back(), get_r.back(), add_r.back());
  }
  auto med = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
  std::printf("median: set %.0f/s, get %.0f/s, add %.0f/s\n", med(set_r), med(get_r), med(add_r));

  // Memory: clients try to store 128 MB (1 MB values) into a store limited to 64 MB.
  const double before = bench::resident_mb("VmRSS:");
  bench::reset_peak();
  int stored = 0, refused = 0;
  {
    std::vector<std::thread> threads;
    std::vector<int> ok(static_cast<std::size_t>(clients)), no(static_cast<std::size_t>(clients));
    for (int c = 0; c < clients; ++c)
      threads.emplace_back([&, c] {
        TcpStoreClient cl("127.0.0.1", server.port(), "bench", std::chrono::seconds(30));
        const std::string value(1 << 20, 'x');
        for (int i = 0; i < 128 / clients; ++i) {
          try {
            cl.set("big/" + std::to_string(c) + "/" + std::to_string(i), value);
            ++ok[std::size_t(c)];
          } catch (const Error&) {
            ++no[std::size_t(c)];
          }
        }
      });
    for (auto& t : threads) t.join();
    for (int c = 0; c < clients; ++c) stored += ok[std::size_t(c)], refused += no[std::size_t(c)];
  }
  std::printf("memory: %d x 1 MB values stored, %d refused at the 64 MB limit; resident %.1f MB before, peak %.1f MB, now %.1f MB\n",
              stored, refused, before, bench::resident_mb("VmHWM:"), bench::resident_mb("VmRSS:"));
  return 0;
}
