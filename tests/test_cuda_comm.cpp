// The device backends on a real GPU: the in-process world over one GPU's memory (N ranks on one
// device) and NCCL at world 1, each against the CPU reduction of the same random inputs, plus the
// Runtime reducing CUDA buckets after its per-bucket events. Without a GPU it says why and exits
// 77 (ctest: skipped). f32 sums are compared bit for bit (the in-process kernel sums in rank order
// with round-to-nearest adds, like the CPU); NCCL within a tolerance (its order is its own).
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "support/collective_op.hpp"
#include "examples/mlp/train.hpp"
#include "kernels/cpu/elementwise.hpp"
#include "support/gpu_suite.hpp"
#include "kernels/cuda/device.hpp"
#include "shardflow/nccl.hpp"
#include "shardflow/shardflow.hpp"
#include "shardflow/store.hpp"

#ifdef SHARDFLOW_WITH_CUDA_RUNTIME
#include <cuda_runtime.h>

namespace {

using namespace shardflow;
using namespace std::chrono_literals;
void check(bool ok, const std::string& what) { test::gpu_check(ok, what); }

std::vector<float> random_vec(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> N(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = N(rng);
  return v;
}

float* upload(const std::vector<float>& v) {
  float* d = nullptr;
  cudaMalloc(&d, std::max<std::size_t>(v.size(), 1) * 4);
  cudaMemcpy(d, v.data(), v.size() * 4, cudaMemcpyHostToDevice);
  return d;
}

std::vector<float> download(const float* d, std::size_t n) {
  std::vector<float> v(n);
  cudaMemcpy(v.data(), d, n * 4, cudaMemcpyDeviceToHost);  // synchronises with the legacy stream only
  return v;
}

std::size_t differ(const std::vector<float>& a, const std::vector<float>& b, float tol = 0.0f) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < a.size(); ++i) bad += tol == 0.0f ? a[i] != b[i] : std::abs(a[i] - b[i]) > tol * (1 + std::abs(b[i]));
  return bad;
}

void on_ranks(int n, const std::function<void(int)>& f) {
  std::vector<std::thread> t;
  for (int r = 0; r < n; ++r) t.emplace_back([&, r] {
    cudaSetDevice(0);
    f(r);
  });
  for (auto& x : t) x.join();
}

// Every collective at world n over device memory, element by element against the CPU.
void in_process_collectives(int n, std::size_t count) {
  auto world = InProcessWorld::create_on_device(n, 0, 60s);
  std::vector<std::vector<float>> in(static_cast<std::size_t>(n));
  std::vector<const void*> srcs;
  for (int r = 0; r < n; ++r) {
    in[std::size_t(r)] = random_vec(count * std::size_t(n), 100 + unsigned(r));
    srcs.push_back(in[std::size_t(r)].data());
  }
  const std::string at = " (world " + std::to_string(n) + ", " + std::to_string(count) + " elements)";
  // all-reduce, averaged, in place
  std::vector<float> want(count * std::size_t(n));
  kernels::reduce_sum(DType::f32, want.data(), srcs.data(), n, want.size(), 1.0f / float(n));
  std::vector<std::size_t> bad(static_cast<std::size_t>(n), 0);
  on_ranks(n, [&](int r) {
    float* d = upload(in[std::size_t(r)]);
    world->communicator(r)->run(test::make(CollectiveKind::allreduce, d, d, want.size(), 1.0f / float(n)), 60s);
    bad[std::size_t(r)] = differ(download(d, want.size()), want);
    cudaFree(d);
  });
  for (int r = 0; r < n; ++r) check(bad[std::size_t(r)] == 0, "in-process cuda all-reduce, rank " + std::to_string(r) + at);
  // reduce-scatter: rank r gets block r of the sum
  on_ranks(n, [&](int r) {
    float* d = upload(in[std::size_t(r)]);
    float* out = upload(std::vector<float>(count));
    world->communicator(r)->run(test::make(CollectiveKind::reduce_scatter, d, out, count), 60s);
    std::vector<float> w(count);
    std::vector<const void*> blocks;
    for (int i = 0; i < n; ++i) blocks.push_back(in[std::size_t(i)].data() + std::size_t(r) * count);
    kernels::reduce_sum(DType::f32, w.data(), blocks.data(), n, count, 1.0f);
    bad[std::size_t(r)] = differ(download(out, count), w);
    cudaFree(d);
    cudaFree(out);
  });
  for (int r = 0; r < n; ++r) check(bad[std::size_t(r)] == 0, "in-process cuda reduce-scatter, rank " + std::to_string(r) + at);
  // all-gather in place (each rank's slice inside the output), and broadcast from the last rank
  on_ranks(n, [&](int r) {
    float* d = upload(std::vector<float>(count * std::size_t(n), -1.0f));
    cudaMemcpy(d + std::size_t(r) * count, in[std::size_t(r)].data(), count * 4, cudaMemcpyHostToDevice);
    world->communicator(r)->run(test::make(CollectiveKind::allgather, d + std::size_t(r) * count, d, count), 60s);
    std::vector<float> w;
    for (int i = 0; i < n; ++i) w.insert(w.end(), in[std::size_t(i)].begin(), in[std::size_t(i)].begin() + std::ptrdiff_t(count));
    bad[std::size_t(r)] = differ(download(d, w.size()), w);
    float* b = upload(in[std::size_t(r)]);
    world->communicator(r)->run(test::make(CollectiveKind::broadcast, b, b, count, 1.0f, n - 1), 60s);
    const auto& root = in[std::size_t(n - 1)];
    bad[std::size_t(r)] += differ(download(b, count), std::vector<float>(root.begin(), root.begin() + std::ptrdiff_t(count)));
    cudaFree(d);
    cudaFree(b);
  });
  for (int r = 0; r < n; ++r) check(bad[std::size_t(r)] == 0, "in-process cuda all-gather + broadcast, rank " + std::to_string(r) + at);
}

// The op waits for its producer's event on the device: the data is written by a copy on another
// stream that the host never waits for.
void waits_for_the_producer_event() {
  auto world = InProcessWorld::create_on_device(2, 0, 60s);
  const std::size_t n = 1 << 22;
  std::vector<float> result[2];
  on_ranks(2, [&](int r) {
    auto host = random_vec(n, 7 + unsigned(r));
    float *pinned = nullptr, *d = nullptr;
    cudaMallocHost(&pinned, n * 4);
    std::copy(host.begin(), host.end(), pinned);
    cudaMalloc(&d, n * 4);
    cudaMemset(d, 0, n * 4);
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    cudaEvent_t e;
    cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    cudaMemcpyAsync(d, pinned, n * 4, cudaMemcpyHostToDevice, s);
    cudaEventRecord(e, s);
    auto op = test::make(CollectiveKind::allreduce, d, d, n);
    op.wait_event = e;
    world->communicator(r)->run(op, 60s);
    result[r] = download(d, n);
    cudaFree(d);
    cudaFreeHost(pinned);
    cudaEventDestroy(e);
    cudaStreamDestroy(s);
  });
  auto a = random_vec(n, 7), b = random_vec(n, 8);
  std::vector<float> want(n);
  const void* srcs[] = {a.data(), b.data()};
  kernels::reduce_sum(DType::f32, want.data(), srcs, 2, n, 1.0f);
  check(differ(result[0], want) == 0 && differ(result[1], want) == 0, "collective waits for the producer's event (no host sync)");
}

void errors_on_device() {
  {
    auto world = InProcessWorld::create_on_device(2, 0, 60s);
    std::string msg[2];
    on_ranks(2, [&](int r) {
      float* d = upload(std::vector<float>(16, 1.0f));
      try {
        world->communicator(r)->run(test::make(CollectiveKind::allreduce, d, d, r == 0 ? 10 : 11), 60s);
      } catch (const MismatchError& e) {
        msg[r] = e.what();
      }
      cudaFree(d);
    });
    check(msg[0].find("collective mismatch") != std::string::npos && msg[1].find("collective mismatch") != std::string::npos,
          "in-process cuda: different counts -> MismatchError on both ranks");
  }
  {
    auto world = InProcessWorld::create_on_device(2, 0, 300ms);
    float* d = upload(std::vector<float>(16, 1.0f));
    std::string msg;
    const auto start = std::chrono::steady_clock::now();
    try {
      world->communicator(0)->run(test::make(CollectiveKind::allreduce, d, d, 16), 300ms);
    } catch (const TimeoutError& e) {
      msg = e.what();
    }
    const auto took = std::chrono::steady_clock::now() - start;
    check(msg.find("rank(s) 1 did not arrive") != std::string::npos,
          "in-process cuda: a rank that never arrives -> TimeoutError: " + msg);
    check(took < 5s, "in-process cuda: the timeout is bounded");
    cudaFree(d);
  }
  {
    auto comm = InProcessWorld::create_on_device(1, 0, 60s)->communicator(0);
    std::vector<float> host{1, 2, 3, 4};
    comm->run(test::make(CollectiveKind::allreduce, host.data(), host.data(), 4, 0.5f), 60s);
    check(host == std::vector<float>{0.5f, 1, 1.5f, 2}, "device communicator stages host buffers");
  }
}

// NCCL at world 1 (the lent machines have one GPU): every collective, then a Runtime end to end.
void nccl_world1() {
  StoreServerOptions so;
  so.token = "t";
  TcpStoreServer server(so);
  NcclOptions o;
  o.rank = 0;
  o.world_size = 1;
  o.store_port = server.port();
  o.token = "t";
  o.timeout = 60s;
  auto comm = make_nccl_communicator(o);
  const std::size_t n = 1000003;
  auto x = random_vec(n, 3);
  float* d = upload(x);
  comm->run(test::make(CollectiveKind::allreduce, d, d, n, 0.5f), 60s);
  auto want = x;
  kernels::scale(DType::f32, want.data(), n, 0.5f);
  check(differ(download(d, n), want, 1e-7f) == 0, "nccl world 1: all-reduce with a pre-multiplied scale");
  comm->run(test::make(CollectiveKind::barrier, nullptr, nullptr, 0), 60s);
  check(true, "nccl world 1: barrier");
  std::vector<float> host{1, 2, 3};
  comm->run(test::make(CollectiveKind::broadcast, host.data(), host.data(), 3), 60s);
  check(host == std::vector<float>{1, 2, 3}, "nccl world 1: broadcast of host memory (staged)");
  cudaFree(d);

  // The runtime: buckets on the GPU, gradients written on the trainer's stream, reduced after the
  // bucket events without the host waiting for backward.
  Config cfg;
  cfg.buckets.cap_bytes = 64 << 10;
  cfg.buckets.first_cap_bytes = 16 << 10;
  cfg.timeouts.collective = 60s;
  Runtime rt(comm, cfg);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  rt.set_stream(s);
  std::vector<float*> params;
  std::vector<Param> handles;
  for (int i = 0; i < 6; ++i) {
    params.push_back(upload(random_vec(10000, 50 + unsigned(i))));
    handles.push_back(rt.register_param({"layer." + std::to_string(i), {100, 100}, DType::f32, Device::cuda(0), params.back()}));
  }
  bool ok = true;
  for (int it = 0; it < 3; ++it) {
    rt.zero_grad();
    std::vector<std::vector<float>> g;
    for (int i = 5; i >= 0; --i) {
      g.push_back(random_vec(10000, 1000 + unsigned(it * 10 + i)));
      cudaMemcpyAsync(rt.grad(handles[std::size_t(i)]), g.back().data(), 40000, cudaMemcpyHostToDevice, s);
      cudaStreamSynchronize(s);  // g.back() is pageable and goes out of scope with the vector growth
      rt.grad_ready(handles[std::size_t(i)]);
    }
    rt.wait();
    for (int i = 5, k = 0; i >= 0; --i, ++k) {
      std::vector<float> got(10000);
      cudaMemcpyAsync(got.data(), rt.grad(handles[std::size_t(i)]), 40000, cudaMemcpyDeviceToHost, s);
      cudaStreamSynchronize(s);
      ok = ok && differ(got, g[std::size_t(k)]) == 0;
    }
  }
  check(ok, "nccl world 1: Runtime reduces CUDA buckets for 3 iterations (buckets rebuilt after the first)");
  for (auto* p : params) cudaFree(p);
  cudaStreamDestroy(s);
}

// N ranks on one GPU through the Runtime: each rank's gradients differ, all end with the average.
void runtime_on_device_world(int n) {
  auto world = InProcessWorld::create_on_device(n, 0, 60s);
  const std::size_t numel = 50000;
  std::vector<std::size_t> bad(static_cast<std::size_t>(n), 1);
  on_ranks(n, [&](int r) {
    Config cfg;
    cfg.buckets.cap_bytes = 100 << 10;
    cfg.timeouts.collective = 60s;
    Runtime rt(world->communicator(r), cfg);
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    rt.set_stream(s);
    std::vector<float*> ps;
    std::vector<Param> hs;
    for (int i = 0; i < 4; ++i) {
      ps.push_back(upload(std::vector<float>(numel, 0.0f)));
      hs.push_back(rt.register_param({"p" + std::to_string(i), {std::int64_t(numel)}, DType::f32, Device::cuda(0), ps.back()}));
    }
    std::size_t wrong = 0;
    for (int it = 0; it < 3; ++it) {
      rt.zero_grad();
      for (int i = 3; i >= 0; --i) {
        auto g = random_vec(numel, unsigned(10000 * it + 100 * i + r));
        cudaMemcpyAsync(rt.grad(hs[std::size_t(i)]), g.data(), numel * 4, cudaMemcpyHostToDevice, s);
        cudaStreamSynchronize(s);
        rt.grad_ready(hs[std::size_t(i)]);
      }
      rt.wait();
      for (int i = 0; i < 4; ++i) {
        std::vector<std::vector<float>> all;
        std::vector<const void*> srcs;
        for (int q = 0; q < n; ++q) all.push_back(random_vec(numel, unsigned(10000 * it + 100 * i + q)));
        for (auto& a : all) srcs.push_back(a.data());
        std::vector<float> want(numel), got(numel);
        kernels::reduce_sum(DType::f32, want.data(), srcs.data(), n, numel, 1.0f / float(n));
        cudaMemcpyAsync(got.data(), rt.grad(hs[std::size_t(i)]), numel * 4, cudaMemcpyDeviceToHost, s);
        cudaStreamSynchronize(s);
        wrong += differ(got, want);
      }
    }
    bad[std::size_t(r)] = wrong;
    for (auto* p : ps) cudaFree(p);
    cudaStreamDestroy(s);
  });
  for (int r = 0; r < n; ++r)
    check(bad[std::size_t(r)] == 0, "Runtime on in-process cuda world " + std::to_string(n) + ", rank " + std::to_string(r) +
                                        ": every gradient is the average, bit for bit");
}

// The Runtime's sharded optimizer with its shard on the GPU (Note [Shard streams]) against the same
// Runtime on CPU memory: the same gradients at the same ranks, the same config. Parameters of mixed
// sizes (one of 3 elements: some ranks own nothing of it), fp32 or bf16 storage.
struct ZeroCase {
  std::string name;
  Config cfg;
  DType dtype = DType::f32;
  float tol = 0.0f;  // 0: bit for bit (the kernels and the device reduction follow the CPU's order)
};

std::vector<std::vector<float>> train_zero(const ZeroCase& c, int n, bool on_gpu) {
  const std::vector<std::size_t> sizes = {50000, 1000, 3, 20001};
  auto world = on_gpu ? InProcessWorld::create_on_device(n, 0, 60s) : InProcessWorld::create(n, 60s);
  std::vector<std::vector<float>> out(sizes.size());
  const std::size_t es = dtype_size(c.dtype);
  on_ranks(n, [&](int r) {
    Config cfg = c.cfg;
    cfg.timeouts.collective = 60s;
    cfg.buckets.cap_bytes = 64 << 10;
    cfg.buckets.first_cap_bytes = 16 << 10;
    Runtime rt(world->communicator(r), cfg);
    cudaStream_t s = nullptr;
    if (on_gpu) {
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
      rt.set_stream(s);
    }
    // Storage: device memory, or host vectors; initial values the same on every rank.
    std::vector<void*> data;
    std::vector<std::vector<std::byte>> host;
    std::vector<Param> hs;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      auto init = random_vec(sizes[i], unsigned(7 + i));
      std::vector<std::byte> bytes(sizes[i] * es);
      if (c.dtype == DType::f32)
        std::memcpy(bytes.data(), init.data(), bytes.size());
      else
        kernels::convert_from_f32(c.dtype, bytes.data(), init.data(), sizes[i]);
      if (on_gpu) {
        void* d = nullptr;
        cudaMalloc(&d, bytes.size());
        cudaMemcpy(d, bytes.data(), bytes.size(), cudaMemcpyHostToDevice);
        data.push_back(d);
      } else {
        host.push_back(std::move(bytes));
        data.push_back(host.back().data());
      }
      hs.push_back(rt.register_param({"p" + std::to_string(i), {std::int64_t(sizes[i])}, c.dtype,
                                      on_gpu ? Device::cuda(0) : Device::cpu(), data.back()}));
    }
    rt.finalize();
    OptimizerConfig oc;
    oc.kind = OptimizerConfig::Kind::adamw;
    oc.lr = 1e-2f;
    rt.configure_optimizer(oc);
    for (int it = 0; it < 4; ++it) {
      rt.zero_grad();
      for (std::size_t i = sizes.size(); i-- > 0;) {
        if (cfg.zero.forward_prefetch) rt.wait_param(hs[i]);
        auto g = random_vec(sizes[i], unsigned(10000 * it + 100 * int(i) + r));
        std::vector<std::byte> gb(sizes[i] * es);
        if (c.dtype == DType::f32)
          std::memcpy(gb.data(), g.data(), gb.size());
        else
          kernels::convert_from_f32(c.dtype, gb.data(), g.data(), sizes[i]);
        if (on_gpu) {
          cudaMemcpyAsync(rt.grad(hs[i]), gb.data(), gb.size(), cudaMemcpyHostToDevice, s);
          cudaStreamSynchronize(s);  // gb goes out of scope
        } else {
          std::memcpy(rt.grad(hs[i]), gb.data(), gb.size());
        }
        rt.grad_ready(hs[i]);
      }
      rt.wait();
    }
    rt.wait_all_params();
    if (r == 0)
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        std::vector<std::byte> bytes(sizes[i] * es);
        if (on_gpu) {
          cudaMemcpyAsync(bytes.data(), data[i], bytes.size(), cudaMemcpyDeviceToHost, s);
          cudaStreamSynchronize(s);
        } else {
          std::memcpy(bytes.data(), data[i], bytes.size());
        }
        out[i].resize(sizes[i]);
        kernels::convert_to_f32(c.dtype, out[i].data(), bytes.data(), sizes[i]);
      }
    if (on_gpu) {
      cudaStreamSynchronize(s);
      for (auto* d : data) cudaFree(d);
      cudaStreamDestroy(s);
    }
  });
  return out;
}

void zero_on_device() {
  std::vector<ZeroCase> cases;
  for (int stage : {1, 2})
    for (auto part : {Partition::flat, Partition::param})
      for (auto ov : {Overlap::none, Overlap::interleaved}) {
        ZeroCase c;
        c.cfg.zero.stage = ZeroStage(stage);
        c.cfg.zero.partition = part;
        c.cfg.zero.overlap = ov;
        c.name = "stage " + std::to_string(stage) + (part == Partition::flat ? " flat" : " param") +
                 (ov == Overlap::none ? " none" : " interleaved");
        cases.push_back(c);
      }
  auto with = [&](std::string name, auto&& edit, float tol = 0.0f) {
    ZeroCase c;
    c.cfg.zero.stage = ZeroStage::gradients;
    c.name = std::move(name);
    c.tol = tol;
    edit(c);
    cases.push_back(c);
  };
  // The norm partials are float atomics on the device: the clip coefficient may differ in its last bits.
  with("stage 2 clip 2-norm", [](ZeroCase& c) { c.cfg.zero.clip_grad_norm = 1.0f; }, 1e-5f);
  with("stage 1 clip inf-norm", [](ZeroCase& c) { c.cfg.zero.stage = ZeroStage::optimizer_state; c.cfg.zero.clip_grad_norm = 0.5f; c.cfg.zero.clip_norm_type = INFINITY; }, 1e-5f);
  with("stage 0 clip 2-norm (every rank steps everything)", [](ZeroCase& c) { c.cfg.zero.stage = ZeroStage::ddp; c.cfg.zero.clip_grad_norm = 1.0f; }, 1e-5f);
  with("stage 2 bf16 wire", [](ZeroCase& c) { c.cfg.precision.comm_dtype = DType::bf16; });
  with("stage 2 bf16 parameters, fp32 masters", [](ZeroCase& c) { c.dtype = DType::bf16; });
  with("stage 1 forward prefetch", [](ZeroCase& c) { c.cfg.zero.stage = ZeroStage::optimizer_state; c.cfg.zero.forward_prefetch = true; });
  for (const auto& c : cases)
    for (int n : {2, 3}) {
      const auto cpu = train_zero(c, n, false), gpu = train_zero(c, n, true);
      std::size_t bad = 0, total = 0;
      for (std::size_t i = 0; i < cpu.size(); ++i) {
        bad += differ(gpu[i], cpu[i], c.tol);
        total += cpu[i].size();
      }
      check(bad == 0, "ZeRO on the GPU, world " + std::to_string(n) + ", " + c.name + ": parameters match the CPU shard (" +
                          std::to_string(bad) + " of " + std::to_string(total) + " differ" +
                          (c.tol == 0.0f ? ", bit for bit)" : ", tolerance " + std::to_string(c.tol) + ")"));
    }
}

// In the trace: some collective is still in flight when its rank reports another gradient, on
// every rank — the reduction overlaps backward.
bool reductions_overlap_backward(const std::string& path) {
  std::ifstream in(path);
  if (!in) return false;
  const auto t = nlohmann::json::parse(in).at("traceEvents");
  // Lanes are numbered threads of a process per rank (Note [Timeline]): the comm stream's is the
  // one its thread_name metadata names.
  std::map<int, int> comm_lane;  // pid -> tid
  for (const auto& m : t)
    if (m.at("ph") == "M" && m.at("name") == "thread_name" && m.at("args").at("name") == "comm stream")
      comm_lane[m.at("pid").get<int>()] = m.at("tid").get<int>();
  std::map<int, bool> overlapped;
  for (const auto& span : t) {
    if (span.at("ph") != "X" || !span.contains("tid") || !span.contains("pid")) continue;
    const int pid = span.at("pid").get<int>();
    if (!comm_lane.count(pid) || span.at("tid").get<int>() != comm_lane[pid]) continue;
    const std::int64_t b = span.at("ts"), e = b + span.at("dur").get<std::int64_t>();
    for (const auto& g : t)
      if (g.at("ph") == "i" && g.at("pid") == pid && g.at("ts") >= b && g.at("ts") <= e) overlapped[pid] = true;
  }
  return comm_lane.size() == 2 && overlapped.size() == 2;
}

// mlp_train --device cuda: cuBLAS forward/backward, buckets on the GPU, the step on the device.
// World 1 and 2 (two ranks on the one GPU) end where the CPU trainer ends, up to the matmuls'
// summation order.
void mlp_on_device() {
  mlp::TrainOptions o;
  o.sizes = {64, 128, 128, 8};
  o.steps = 20;
  o.global_batch = 32;
  o.optimizer.kind = OptimizerConfig::Kind::adamw;
  o.optimizer.lr = 1e-3f;
  o.optimizer_in_runtime = false;
  o.runtime.timeouts.collective = 60s;
  o.runtime.buckets.cap_bytes = 32 << 10;
  o.runtime.buckets.first_cap_bytes = 8 << 10;
  auto compare = [](const mlp::TrainResult& cpu, const mlp::TrainResult& gpu, const std::string& what) {
    double worst = 0;
    for (const auto& [name, t] : cpu.params) {
      const auto a = t.to_f32(name), b = gpu.params.at(name).to_f32(name);
      for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, double(std::abs(a[i] - b[i])));
    }
    char line[300];
    std::snprintf(line, sizeof(line), "mlp --device cuda %s: loss %.5f -> %.5f (cpu %.5f), max |param diff| %.2e", what.c_str(),
                  double(gpu.losses.front()), double(gpu.losses.back()), double(cpu.losses.back()), worst);
    check(worst < 1e-3 && gpu.losses.back() < gpu.losses.front(), line);
  };
  const auto cpu = mlp::train(o);
  for (int world : {1, 2}) {
    auto d = o;
    d.world_size = world;
    d.device = Device::cuda(0);
    const std::string trace = "/tmp/shardflow_cuda_trace_" + std::to_string(world) + ".json";
    d.runtime.trace.path = trace;
    const auto gpu = mlp::train(d);
    if (world == 2) check(reductions_overlap_backward(trace), "two ranks on one GPU: reductions in flight while backward reports gradients (" + trace + ")");
    compare(cpu, gpu, "world " + std::to_string(world) + ", trainer-side AdamW");
  }
  // The runtime's sharded optimizer stepping on the GPU, as the trainer uses it.
  auto z = o;
  z.optimizer_in_runtime = true;
  z.world_size = 2;
  z.runtime.zero.stage = ZeroStage::gradients;
  z.runtime.zero.overlap = Overlap::interleaved;
  z.runtime.zero.clip_grad_norm = 1.0f;
  const auto zcpu = mlp::train(z);
  for (bool prefetch : {false, true}) {
    auto d = z;
    d.device = Device::cuda(0);
    d.runtime.zero.forward_prefetch = prefetch;
    compare(zcpu, mlp::train(d), std::string("world 2, ZeRO-2 interleaved, clipping") + (prefetch ? ", forward prefetch" : ""));
  }
}

}  // namespace
#endif

int main() {
  return shardflow::test::gpu_main([] {
#ifdef SHARDFLOW_WITH_CUDA_RUNTIME
    using namespace shardflow;
    // Each part on its own: one that throws is one failure, the others still run.
    auto guarded = [](const char* name, const std::function<void()>& f) {
      try {
        f();
      } catch (const std::exception& e) {
        check(false, std::string(name) + " threw: " + e.what());
      }
    };
    for (int n : {1, 2, 3}) guarded("in-process collectives", [&] { in_process_collectives(n, 1000003); });
    guarded("in-process small", [] { in_process_collectives(3, 5); });
    guarded("producer event", waits_for_the_producer_event);
    guarded("errors", errors_on_device);
    if (nccl_compiled()) guarded("nccl", nccl_world1);
    for (int n : {1, 2, 4}) guarded("runtime", [&] { runtime_on_device_world(n); });
    guarded("zero", zero_on_device);
    guarded("mlp", mlp_on_device);
#endif
  });
}
