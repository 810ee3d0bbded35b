// The store on etcd at a job's scale (Note [A store no node owns]): a 3-member etcd on loopback
// with authentication (or the members given), against the TCP store on the same calls.
//   1. set / get / add per second, 16 clients at once, etcd and the TCP store in alternate rounds;
//   0. what one login costs (etcd checks the password with bcrypt): 20 in a row on one member, and
//      16 at once; a process logs in once per member (Note [One login per process]), so a job of
//      N processes costs N of them at its start;
//   2. 1,000 clients that each wait for their key (1,000 idle watches), while one writer sets
//      10,000 keys, the waited-for ones last; then each client reads its 10 keys back and adds 1 to
//      one counter. Checked: every value read is the one written, the counter ends at 1,000, and
//      every add returned a distinct value (no add lost or doubled). Timed: set rate, and from the
//      writer's set of a client's key to that client's wake-up (median, 99th percentile).
//
//   build/bench/bench_etcd_store [--clients 16] [--ops 300] [--reps 3] [--waiting 1000] [--keys 10000]
#include <CLI/CLI.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "runtime/bootstrap/etcd_http.hpp"
#include "shardflow/errors.hpp"
#include "shardflow/etcd_store.hpp"
#include "shardflow/store.hpp"
#include "tests/support/etcd_cluster.hpp"

using namespace shardflow;
using Clock = std::chrono::steady_clock;

namespace {

const std::string kToken = "bench-token";

double med(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// `clients` threads each run `ops` calls of one kind on their own client; calls per second in all.
template <class Connect>
double rate(const Connect& connect, int clients, int ops, char kind) {
  std::vector<std::thread> threads;
  const auto t0 = Clock::now();
  for (int c = 0; c < clients; ++c)
    threads.emplace_back([&, c] {
      const auto store = connect();
      const std::string prefix = "k/" + std::to_string(c) + "/";
      for (int i = 0; i < ops; ++i) {
        const std::string key = prefix + std::to_string(i % 64);
        if (kind == 's') store->set(key, "10.0.0.1:29500");
        else if (kind == 'g') store->get(key);
        else store->add("counter", 1);  // one key every client bumps: the contended case
      }
    });
  for (auto& t : threads) t.join();
  return double(clients) * ops / std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The store on etcd: rates against the TCP store, and 1,000 waiting clients over 10,000 keys"};
  int clients = 16, ops = 300, reps = 3, waiting = 1000, keys = 10000;
  std::vector<std::string> endpoints;
  app.add_option("--clients", clients)->capture_default_str();
  app.add_option("--ops", ops, "calls per client per kind")->capture_default_str();
  app.add_option("--reps", reps)->capture_default_str();
  app.add_option("--waiting", waiting, "clients waiting for their key")->capture_default_str();
  app.add_option("--keys", keys, "keys the writer sets (the waited-for ones among them)")->capture_default_str();
  app.add_option("--endpoints", endpoints, "an etcd of your own (user shardflow, password bench-token); default: 3 members started here");
  CLI11_PARSE(app, argc, argv);
  if (keys < waiting) keys = waiting;

  std::unique_ptr<test::EtcdCluster> local;
  if (endpoints.empty()) {
    local = std::make_unique<test::EtcdCluster>(3, kToken);
    endpoints = local->endpoints();
  }
  auto etcd_options = [&](const std::string& root) {
    EtcdOptions o;
    o.endpoints = endpoints;
    o.password = kToken;
    o.root = root;
    o.timeout = std::chrono::seconds(600);
    return o;
  };
  {
    auto login_ms = [&](int at_once, int each) {
      std::vector<std::thread> threads;
      const auto t0 = Clock::now();
      for (int t = 0; t < at_once; ++t)
        threads.emplace_back([&] {
          etcd::Connection c(endpoints[0]);
          for (int i = 0; i < each; ++i)
            c.post("/v3/auth/authenticate", "{\"name\":\"shardflow\",\"password\":\"" + kToken + "\"}", "",
                   Clock::now() + std::chrono::seconds(60));
        });
      for (auto& t : threads) t.join();
      return std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / (at_once * each);
    };
    const double one = login_ms(1, 20), many = login_ms(16, 4);
    std::printf("logins: %.1f ms each in a row, %.1f ms of wall time each with 16 at once (%.0f logins/s)\n", one, many, 1000.0 / many);
  }
  StoreServerOptions so;
  so.token = kToken;
  TcpStoreServer server(so);
  std::printf("bench_etcd_store: %zu etcd member(s), %d clients x %d calls per kind, %d rounds, etcd and the TCP store alternated\n",
              endpoints.size(), clients, ops, reps);
  std::vector<double> e_set, e_get, e_add, t_set, t_get, t_add;
  for (int r = 0; r < reps; ++r) {
    const std::string root = "/shardflow/bench-rates-" + std::to_string(r) + "/";
    auto etcd = [&] { return std::make_unique<EtcdStore>(etcd_options(root)); };
    auto tcp = [&] { return std::make_unique<TcpStoreClient>("127.0.0.1", server.port(), kToken, std::chrono::seconds(120)); };
    e_set.push_back(rate(etcd, clients, ops, 's'));
    t_set.push_back(rate(tcp, clients, ops, 's'));
    e_get.push_back(rate(etcd, clients, ops, 'g'));
    t_get.push_back(rate(tcp, clients, ops, 'g'));
    e_add.push_back(rate(etcd, clients, ops, 'a'));
    t_add.push_back(rate(tcp, clients, ops, 'a'));
    std::printf("  round %d: etcd set %6.0f/s get %6.0f/s add %6.0f/s | tcp set %6.0f/s get %6.0f/s add %6.0f/s\n", r + 1, e_set.back(),
                e_get.back(), e_add.back(), t_set.back(), t_get.back(), t_add.back());
  }
  std::printf("median: etcd set %.0f/s, get %.0f/s, add %.0f/s; tcp set %.0f/s, get %.0f/s, add %.0f/s\n", med(e_set), med(e_get),
              med(e_add), med(t_set), med(t_get), med(t_add));

  // 1,000 waiting clients over 10,000 keys.
  const std::string root = "/shardflow/bench-waiting/";
  std::vector<Clock::time_point> set_at(static_cast<std::size_t>(waiting)), woke_at(static_cast<std::size_t>(waiting));
  std::vector<std::int64_t> ticket(static_cast<std::size_t>(waiting), -1);
  std::atomic<int> ready{0}, wrong{0}, failed{0};
  std::vector<std::thread> threads;
  const auto per = keys / waiting;  // keys each client reads back
  for (int c = 0; c < waiting; ++c)
    threads.emplace_back([&, c] {
      try {
        EtcdStore s(etcd_options(root));
        ++ready;
        const std::string mine = "ready/" + std::to_string(c);
        if (s.get(mine) != "go " + std::to_string(c)) ++wrong;
        woke_at[std::size_t(c)] = Clock::now();
        for (int i = 0; i < per; ++i) {
          const int k = c * per + i;
          if (s.get("k/" + std::to_string(k)) != std::to_string(k * 7)) ++wrong;
        }
        ticket[std::size_t(c)] = s.add("done", 1);
      } catch (const std::exception& e) {
        ++failed;
        std::fprintf(stderr, "client %d: %s\n", c, e.what());
      }
    });
  const auto c0 = Clock::now();
  while (ready + failed < waiting) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  std::printf("waiting: %d clients connected (one login per member, shared) in %.2f s\n", waiting, std::chrono::duration<double>(Clock::now() - c0).count());
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // every client in its watch
  EtcdStore writer(etcd_options(root));
  const auto t0 = Clock::now();
  for (int k = 0; k < keys; ++k) writer.set("k/" + std::to_string(k), std::to_string(k * 7));
  const double set_s = std::chrono::duration<double>(Clock::now() - t0).count();
  for (int c = 0; c < waiting; ++c) {
    set_at[std::size_t(c)] = Clock::now();
    writer.set("ready/" + std::to_string(c), "go " + std::to_string(c));
  }
  for (auto& t : threads) t.join();
  const double total_s = std::chrono::duration<double>(Clock::now() - t0).count();
  std::vector<double> wake_ms;
  for (int c = 0; c < waiting; ++c)
    if (ticket[std::size_t(c)] >= 0) wake_ms.push_back(std::chrono::duration<double, std::milli>(woke_at[std::size_t(c)] - set_at[std::size_t(c)]).count());
  std::sort(wake_ms.begin(), wake_ms.end());
  std::vector<int> hits(std::size_t(waiting) + 1, 0);
  int out_of_range = 0;
  for (const auto t : ticket)
    if (t >= 1 && t <= waiting) ++hits[std::size_t(t)];
    else if (t >= 0) ++out_of_range;
  const int doubled = int(std::count_if(hits.begin() + 1, hits.end(), [](int h) { return h > 1; }));
  const int lost = int(std::count(hits.begin() + 1, hits.end(), 0));
  const auto total = writer.add("done", 0);
  std::printf("waiting: %d clients, %d keys set in %.2f s (%.0f/s); wake-up after its key's set: median %.1f ms, p99 %.1f ms; "
              "all done in %.2f s\n",
              waiting, keys, set_s, keys / set_s, wake_ms.empty() ? 0 : wake_ms[wake_ms.size() / 2],
              wake_ms.empty() ? 0 : wake_ms[std::min(wake_ms.size() - 1, wake_ms.size() * 99 / 100)], total_s);
  std::printf("checked: %d wrong values, %d clients failed, counter %lld of %d, adds lost %d, doubled %d, out of range %d\n", wrong.load(),
              failed.load(), (long long)total, waiting, lost, doubled, out_of_range);
  return wrong == 0 && failed == 0 && total == waiting && lost == 0 && doubled == 0 ? 0 : 1;
}
