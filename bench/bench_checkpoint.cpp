// Checkpoint throughput next to a plain file write of the same bytes (Note [Checkpoints], Note
// [Sharded checkpoints]): world 2 as threads, ZeRO-2 flat, AdamW, one step taken so the state is
// real. Per round, alternated A B A B: the consolidated save (rank 0 writes), a plain write of
// as many bytes (write + fsync), the sharded save (each rank its file), the sharded load, and the
// time save_sharded_checkpoint_async blocks the trainer against one copy of a rank's shard.
#include <CLI/CLI.hpp>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "bench/proc_memory.hpp"
#include "shardflow/shardflow.hpp"

using namespace shardflow;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

namespace {

volatile char sink;

using bench::resident_mb;
using bench::reset_peak;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A plain write of `bytes` to `path`, fsync'ed: the yardstick.
double plain_write(const std::string& path, const std::vector<char>& buf) {
  const auto t0 = Clock::now();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::size_t done = 0;
  while (done < buf.size()) done += std::size_t(::write(fd, buf.data() + done, buf.size() - done));
  ::fsync(fd);
  ::close(fd);
  return since(t0);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Checkpoint throughput: consolidated and sharded save, sharded load, save_async's blocking time"};
  std::size_t mib = 256;
  int reps = 3;
  std::string dir = (fs::temp_directory_path() / "sf_bench_ckpt").string();
  app.add_option("--param-mib", mib, "parameters, MiB (16 of them; the checkpoint holds 3x: parameters, exp_avg, exp_avg_sq)")->capture_default_str();
  app.add_option("--reps", reps, "A B A B rounds (medians)")->capture_default_str();
  app.add_option("--dir", dir, "scratch directory (removed at the end)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  const int world = 2, P = 16;
  const std::size_t numel = mib * 1048576 / 4 / P;
  fs::create_directories(dir);
  std::vector<std::vector<float>> data(world, std::vector<float>(numel * P, 0.5f));
  auto w = InProcessWorld::create(world, std::chrono::seconds(600));
  std::vector<double> consolidated, in_memory, plain, sharded, loaded, blocked, copy, peak_extra;
  std::size_t file_bytes = 0, shard_bytes = 0;
  std::vector<std::unique_ptr<Runtime>> rts(world);
  std::vector<std::vector<Param>> handles(world);
  auto on_ranks = [&](const std::function<void(int)>& fn) {
    std::vector<std::thread> t;
    for (int r = 0; r < world; ++r) t.emplace_back(fn, r);
    for (auto& x : t) x.join();
  };
  on_ranks([&](int r) {
    Config cfg;
    cfg.zero.stage = ZeroStage::gradients;
    cfg.zero.overlap = Overlap::interleaved;
    rts[std::size_t(r)] = std::make_unique<Runtime>(w->communicator(r), cfg);
    auto& rt = *rts[std::size_t(r)];
    for (int i = 0; i < P; ++i)
      handles[std::size_t(r)].push_back(rt.register_param(
          {"p" + std::to_string(i), {std::int64_t(numel)}, DType::f32, Device::cpu(), data[std::size_t(r)].data() + std::size_t(i) * numel}));
    OptimizerConfig oc;
    oc.kind = OptimizerConfig::Kind::adamw;
    rt.configure_optimizer(oc);
    rt.zero_grad();
    for (int i = P; i-- > 0;) {
      std::fill_n(rt.grad_f32(handles[std::size_t(r)][std::size_t(i)]), numel, 0.01f * float(r + 1));
      rt.grad_ready(handles[std::size_t(r)][std::size_t(i)]);
    }
    rt.wait();
  });
  for (int rep = 0; rep < reps; ++rep) {
    // A: consolidated, and how far the process's resident memory rose above where it started.
    reset_peak();
    const double before = resident_mb("VmRSS:");
    auto t0 = Clock::now();
    on_ranks([&](int r) { rts[std::size_t(r)]->save_checkpoint(dir + "/consolidated.safetensors"); });
    consolidated.push_back(since(t0));
    peak_extra.push_back(resident_mb("VmHWM:") - before);
    file_bytes = fs::file_size(dir + "/consolidated.safetensors");
    // A': the same stream into memory (state_dict): the consolidation without the disk.
    t0 = Clock::now();
    on_ranks([&](int r) { (void)rts[std::size_t(r)]->state_dict(0); });
    in_memory.push_back(since(t0));
    // B: a plain write of as many bytes.
    std::vector<char> buf(file_bytes, 1);
    plain.push_back(plain_write(dir + "/plain.bin", buf));
    // C: sharded, in the background, and what it blocks.
    std::vector<double> block(world);
    t0 = Clock::now();
    on_ranks([&](int r) {
      const auto b0 = Clock::now();
      rts[std::size_t(r)]->save_sharded_checkpoint_async(dir + "/sharded");
      block[std::size_t(r)] = since(b0);
      rts[std::size_t(r)]->wait_checkpoint();
    });
    sharded.push_back(since(t0));
    blocked.push_back(*std::max_element(block.begin(), block.end()));
    shard_bytes = 0;
    for (const auto& e : fs::directory_iterator(dir + "/sharded")) shard_bytes = std::max<std::size_t>(shard_bytes, e.path().extension() == ".safetensors" ? fs::file_size(e.path()) : 0);
    // One in-memory copy of the largest rank's shard bytes into a fresh buffer (as a staging copy
    // is), on every rank at once as the save's staging runs: what the blocking time is measured
    // against.
    std::vector<std::vector<char>> from(world, std::vector<char>(shard_bytes, 2));
    std::vector<double> copies(world);
    on_ranks([&](int r) {
      const auto c0 = Clock::now();
      std::unique_ptr<char[]> to(new char[shard_bytes]);
      std::memcpy(to.get(), from[std::size_t(r)].data(), shard_bytes);
      copies[std::size_t(r)] = since(c0);
      sink = char(sink + to[shard_bytes / 2]);  // the copy is used: not optimised away
    });
    copy.push_back(*std::max_element(copies.begin(), copies.end()));
    // D: sharded load.
    t0 = Clock::now();
    on_ranks([&](int r) { rts[std::size_t(r)]->load_checkpoint(dir + "/sharded"); });
    loaded.push_back(since(t0));
  }
  const double gb = double(file_bytes) / 1e9;
  std::printf("bench_checkpoint: world 2 (threads), ZeRO-2 flat, AdamW, %zu MiB of parameters in %d tensors; checkpoint %.3f GB; %d rounds (medians)\n",
              mib, P, gb, reps);
  std::printf("  consolidated save (rank 0 writes)     %8.3f s  %6.2f GB/s   %.2fx the plain write\n", median(consolidated), gb / median(consolidated),
              median(consolidated) / median(plain));
  std::printf("  consolidated save: peak resident memory above the start, both ranks of this process together: %.1f MB (one 16 MiB "
              "window per rank is %.1f MB)\n",
              median(peak_extra), 2 * 16.0 * 1048576 / 1e6);
  std::printf("  state_dict(0): the same stream into memory   %8.3f s  %6.2f GB/s\n", median(in_memory), gb / median(in_memory));
  std::printf("  plain write + fsync, same bytes       %8.3f s  %6.2f GB/s\n", median(plain), gb / median(plain));
  std::printf("  sharded save (each rank its file)     %8.3f s  %6.2f GB/s   %.2fx the plain write\n", median(sharded), gb / median(sharded),
              median(sharded) / median(plain));
  std::printf("  sharded load (each rank its slices)   %8.3f s  %6.2f GB/s\n", median(loaded), gb / median(loaded));
  std::printf("  save_async blocked the trainer        %8.4f s  against one copy of a rank's shard on each rank at once (%.3f GB): %.4f s (%.2fx)\n", median(blocked),
              double(shard_bytes) / 1e9, median(copy), median(blocked) / median(copy));
  rts.clear();
  fs::remove_all(dir);
}
