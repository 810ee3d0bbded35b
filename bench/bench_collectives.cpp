// bench_collectives: algorithm and bus bandwidth of each collective of a backend, per size, next to
// a plain memcpy of the same size. Sizes follow nccl-tests: the bytes of the largest buffer an op
// touches per rank (allreduce: the buffer; reduce_scatter: the send buffer; allgather: the receive
// buffer; broadcast: the buffer). Bus bandwidth scales algorithm bandwidth by what each rank must
// move (2(n-1)/n for allreduce, (n-1)/n for reduce_scatter / allgather, 1 for broadcast), so it is
// comparable across world sizes and with memcpy.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "shardflow/gloo.hpp"
#include "shardflow/launch.hpp"
#include "shardflow/shardflow.hpp"
#include "shardflow/store.hpp"

using namespace shardflow;
using clk = std::chrono::steady_clock;

namespace {

double bus_factor(CollectiveKind k, int n) {
  switch (k) {
    case CollectiveKind::allreduce: return 2.0 * (n - 1) / n;
    case CollectiveKind::reduce_scatter:
    case CollectiveKind::allgather: return double(n - 1) / n;
    default: return 1.0;
  }
}

// One rank's timings of `reps` ops (after two warm-up reps: page faults, thread wake-ups), each
// from a common start (`sync`) to completion on this rank.
// `registered`: buffers from comm.allocate() (the runtime's buckets are), else plain vectors.
std::vector<double> time_rank(Communicator& comm, CollectiveKind kind, std::size_t bytes, int reps,
                              const std::function<void()>& sync, bool registered) {
  const int n = comm.world_size();
  const std::size_t elems = bytes / 4;
  const std::size_t block = kind == CollectiveKind::allreduce || kind == CollectiveKind::broadcast ? elems : elems / std::size_t(n);
  const std::size_t ns = kind == CollectiveKind::allgather ? block : elems;
  const std::size_t nd = kind == CollectiveKind::reduce_scatter ? block : elems;
  std::vector<float> sv, dv;
  std::shared_ptr<std::byte> sr, dr;
  float *s = nullptr, *d = nullptr;
  if (registered) {
    sr = comm.allocate(ns * 4);
    dr = comm.allocate(nd * 4);
    s = reinterpret_cast<float*>(sr.get());
    d = reinterpret_cast<float*>(dr.get());
  } else {
    sv.resize(ns);
    dv.resize(nd);
    s = sv.data();
    d = dv.data();
  }
  std::fill_n(s, ns, 1.0f);
  CollectiveOp op;
  op.kind = kind;
  op.send = s;
  op.recv = kind == CollectiveKind::allreduce || kind == CollectiveKind::broadcast ? s : d;
  op.count = block;
  op.tag = "bench";
  std::vector<double> times;
  for (int i = 0; i < reps + 2; ++i) {
    sync();
    const auto t0 = clk::now();
    comm.run(op, std::chrono::minutes(1));
    if (i >= 2) times.push_back(std::chrono::duration<double>(clk::now() - t0).count());
  }
  return times;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Ranks as threads of this process: rank 0's median.
double time_op(const std::vector<std::shared_ptr<Communicator>>& comms, CollectiveKind kind, std::size_t bytes, int reps,
               bool registered) {
  const int n = int(comms.size());
  std::barrier sync(n);
  std::vector<double> times;
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      auto t = time_rank(*comms[std::size_t(r)], kind, bytes, reps, [&] { sync.arrive_and_wait(); }, registered);
      if (r == 0) times = std::move(t);
    });
  for (auto& t : threads) t.join();
  return median(times);
}

double time_memcpy(std::size_t bytes, int reps) {
  std::vector<char> a(bytes, 1), b(bytes, 0);
  std::vector<double> times;
  for (int i = 0; i < reps + 2; ++i) {
    const auto t0 = clk::now();
    std::memcpy(b.data(), a.data(), bytes);
    if (i >= 2) times.push_back(std::chrono::duration<double>(clk::now() - t0).count());
  }
  return median(times);
}

std::string human(std::size_t bytes) {
  char buf[32];
  if (bytes >= (1u << 20)) std::snprintf(buf, sizeof buf, "%zu MiB", bytes >> 20);
  else std::snprintf(buf, sizeof buf, "%zu KiB", bytes >> 10);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Collective bandwidth of a backend next to memcpy"};
  std::string backend = "in-process";
  app.add_option("--backend", backend,
                 "in-process | gloo (ranks are threads; gloo connects them over loopback TCP). Under `shardflow run` every "
                 "process is one rank: shm | gloo")->capture_default_str();
  std::vector<int> worlds{2, 4};
  std::vector<std::size_t> sizes{4 << 10, 256 << 10, 4 << 20, 64 << 20};
  int reps = 10;
  bool plain = false;
  app.add_flag("--plain-buffers", plain, "time ordinary buffers instead of comm.allocate()'d ones (shm then stages every op)");
  app.add_option("--world", worlds, "world sizes")->capture_default_str();
  app.add_option("--bytes", sizes, "buffer sizes in bytes")->capture_default_str();
  app.add_option("--reps", reps, "timed repetitions (median reported)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  auto kinds = {CollectiveKind::allreduce, CollectiveKind::reduce_scatter, CollectiveKind::allgather, CollectiveKind::broadcast};
  auto reps_for = [&](std::size_t bytes) { return bytes >= (16u << 20) ? std::max(3, reps / 2) : reps * 10; };
  auto report = [&](int n, CollectiveKind kind, std::size_t bytes, double t) {
    const double mc = double(bytes) / time_memcpy(bytes, reps_for(bytes)) / 1e9;
    const double alg = double(bytes) / t / 1e9;
    const double bus = alg * bus_factor(kind, n);
    std::printf("| %s%s | %d | %s | %s | %.1f | %.2f | %.2f | %.2f | %.0f %% |\n", backend.c_str(), plain ? " (plain)" : "", n, collective_name(kind),
                human(bytes).c_str(), t * 1e6, alg, bus, mc, 100.0 * bus / mc);
    std::fflush(stdout);
  };
  const LaunchEnv env = LaunchEnv::detect();
  if (env.rank == 0) {
    std::printf("| backend | world | op | size | time (us) | algbw (GB/s) | busbw (GB/s) | memcpy (GB/s) | busbw / memcpy |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|\n");
  }
  if (env.launched()) {  // one rank per process: rank 0 reports its own medians
    auto comm = init_process_group(env, ProcessGroupOptions{backend, std::chrono::minutes(2)});
    CollectiveOp barrier;
    barrier.kind = CollectiveKind::barrier;
    barrier.tag = "bench sync";
    for (auto kind : kinds)
      for (std::size_t bytes : sizes) {
        const auto t = time_rank(*comm, kind, bytes, reps_for(bytes), [&] { comm->run(barrier, std::chrono::minutes(1)); }, !plain);
        if (env.rank == 0) report(env.world_size, kind, bytes, median(t));
      }
    return 0;
  }
  std::unique_ptr<TcpStoreServer> store;
  if (backend == "gloo") {
    StoreServerOptions so;
    so.token = "bench";
    store = std::make_unique<TcpStoreServer>(so);
  } else if (backend != "in-process") {
    std::fprintf(stderr, "bench_collectives: unknown backend '%s'\n", backend.c_str());
    return 1;
  }
  for (int n : worlds) {
    std::vector<std::shared_ptr<Communicator>> comms(static_cast<std::size_t>(n));
    std::shared_ptr<InProcessWorld> world;
    if (backend == "gloo") {
      std::vector<std::thread> ts;
      for (int r = 0; r < n; ++r)
        ts.emplace_back([&, r] {
          GlooOptions o;
          o.rank = r;
          o.world_size = n;
          o.store_port = store->port();
          o.token = "bench";
          o.key_prefix = "w" + std::to_string(n) + "/";
          comms[std::size_t(r)] = make_gloo_communicator(o);
        });
      for (auto& t : ts) t.join();
    } else {
      world = InProcessWorld::create(n);
      for (int r = 0; r < n; ++r) comms[std::size_t(r)] = world->communicator(r);
    }
    for (auto kind : kinds)
      for (std::size_t bytes : sizes) report(n, kind, bytes, time_op(comms, kind, bytes, reps_for(bytes), !plain));
  }
  return 0;
}
