#include "examples/mlp/train.hpp"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>

#include "examples/mlp/model.hpp"
#include "examples/mlp/rank_model.hpp"
#include "examples/mlp/rng.hpp"
#include "kernels/cpu/linear.hpp"

namespace shardflow::mlp {

Dataset Dataset::synthetic(int in, int out, std::size_t rows, std::uint64_t seed) {
  Dataset d;
  d.in = in;
  d.out = out;
  d.rows = rows;
  d.x.resize(rows * std::size_t(in));
  d.y.resize(rows * std::size_t(out));
  CounterRng xr(seed, 1001), tr(seed, 1002);
  for (auto& v : d.x) v = xr.normal();
  // Teacher: y = tanh(x · T) with T[in, out] ~ N(0, 1/in): smooth, learnable, bounded targets.
  // Drawn in T's order, kept as its transpose for the GEMM (a scalar loop striding T took 96 s of
  // a 3-step run at 2048 wide).
  std::vector<float> Tt(std::size_t(in) * out);
  const float s = 1.0f / std::sqrt(float(in));
  for (int i = 0; i < in; ++i)
    for (int o = 0; o < out; ++o) Tt[std::size_t(o) * in + std::size_t(i)] = s * tr.normal();
  kernels::linear_forward(d.x.data(), Tt.data(), nullptr, d.y.data(), int(rows), in, out);
  for (auto& v : d.y) v = std::tanh(v);
  return d;
}

Dataset Dataset::load(const std::string& path, int in, int out) {
  const auto t = load_safetensors(path);
  auto get = [&](const char* name, int width) -> const Tensor& {
    auto it = t.find(name);
    if (it == t.end()) throw Error("--data '" + path + "': tensor '" + name + "' is missing");
    const auto& s = it->second.shape;
    if (s.size() != 2 || s[1] != width)
      throw Error("--data '" + path + "': tensor '" + name + "' has shape " + shape_str(s) + ", expected [rows, " +
                  std::to_string(width) + "] to match --sizes");
    return it->second;
  };
  auto rows_of = [&](const char* xn, const char* yn) {
    const Tensor& x = get(xn, in);
    const Tensor& y = get(yn, out);
    if (x.shape[0] != y.shape[0])
      throw Error("--data '" + path + "': " + xn + " has " + std::to_string(x.shape[0]) + " rows, " + yn + " has " +
                  std::to_string(y.shape[0]));
    if (x.shape[0] == 0) throw Error("--data '" + path + "': " + xn + " has no rows");
    return std::size_t(x.shape[0]);
  };
  Dataset d;
  d.in = in;
  d.out = out;
  d.rows = rows_of("x", "y");
  d.x = t.at("x").to_f32("--data '" + path + "': tensor 'x'");
  d.y = t.at("y").to_f32("--data '" + path + "': tensor 'y'");
  const bool has_x = t.count("x_test") != 0, has_y = t.count("y_test") != 0;
  if (has_x != has_y)
    throw Error("--data '" + path + "': has " + (has_x ? "x_test but no y_test" : "y_test but no x_test") +
                "; held-out rows need both");
  if (has_x) {
    d.test_rows = rows_of("x_test", "y_test");
    d.x_test = t.at("x_test").to_f32("--data '" + path + "': tensor 'x_test'");
    d.y_test = t.at("y_test").to_f32("--data '" + path + "': tensor 'y_test'");
  }
  return d;
}

namespace {

struct Shared {
  const TrainOptions& opt;
  const Dataset& data;
  const TensorMap* init;
  TrainResult result;
  std::mutex mu;
  std::exception_ptr error;
};

// Gathers this rank's rows of global batch `step`: rows s*B ... s*B+B-1 modulo the data size, of
// which rank r takes the r-th contiguous B/N.
// shard_data: rank r's rows [first, first + rows) and the whole local batches they hold.
struct DataShard {
  std::size_t first = 0, rows = 0;
  int batches = 0;
};
DataShard shard_of(std::size_t total, int r, int world, int local) {
  const std::size_t base = total / std::size_t(world), extra = total % std::size_t(world);
  DataShard s;
  s.first = std::size_t(r) * base + std::min<std::size_t>(std::size_t(r), extra);
  s.rows = base + (std::size_t(r) < extra ? 1 : 0);
  s.batches = int(s.rows / std::size_t(local));
  return s;
}
std::string describe_split(std::size_t total, int world, int local) {
  std::string s = std::to_string(total) + " rows over " + std::to_string(world) + " ranks, local batch " + std::to_string(local) + ":";
  std::size_t dropped = 0;
  for (int r = 0; r < world; ++r) {
    const auto d = shard_of(total, r, world, local);
    s += " rank " + std::to_string(r) + " rows [" + std::to_string(d.first) + ", " + std::to_string(d.first + d.rows) + ") = " +
         std::to_string(d.batches) + " batches" + (r + 1 < world ? ";" : "");
    dropped += d.rows - std::size_t(d.batches) * std::size_t(local);
  }
  return s + "; " + std::to_string(dropped) + " rows in partial batches dropped; ranks with fewer batches join early";
}

}  // namespace

CollectiveOp loss_allreduce(float* losses, std::size_t n, int world_size) {
  CollectiveOp op;
  op.kind = CollectiveKind::allreduce;
  op.send = op.recv = losses;
  op.count = n;
  op.scale = 1.0f / float(world_size);  // equal shards: the global mean is the mean of the local means
  op.tag = "loss";
  return op;
}

void local_batch(const Dataset& d, int step, int B, int N, int r, std::vector<float>& x, std::vector<float>& y,
                 std::optional<std::size_t> at) {
  const int local = B / N;
  x.resize(std::size_t(local) * d.in);
  y.resize(std::size_t(local) * d.out);
  for (int k = 0; k < local; ++k) {
    const std::size_t row = at ? *at + std::size_t(k) : (std::size_t(step) * B + std::size_t(r) * local + k) % d.rows;
    std::copy_n(d.x.begin() + std::ptrdiff_t(row * d.in), d.in, x.begin() + std::ptrdiff_t(std::size_t(k) * d.in));
    std::copy_n(d.y.begin() + std::ptrdiff_t(row * d.out), d.out, y.begin() + std::ptrdiff_t(std::size_t(k) * d.out));
  }
}

namespace {

// The global mean of this rank's per-step losses: an all-reduce of the trainer's own, queued on
// the runtime's comm stream after the parameter syncs forward prefetch leaves running past wait()
// (Runtime::collective), so it neither races them nor waits for them here.
std::future<void> global_loss(Runtime& rt, float* loss, std::size_t n) {
  return rt.collective(loss_allreduce(loss, n, rt.world_size()));  // the world now (it shrinks when recovering in place)
}

// Rank 0's step reports in step order, each with its global loss. A step whose loss is being
// reduced holds its report (and the ones after it) until the next step reads the result: by
// then the next iteration's reductions are out, so the read never waits for the syncs.
struct LossLog {
  std::future<void> pending;
  float value = 0.0f;  // the pending reduction's buffer
  int pending_step = -1;
  float last_global = 0.0f;
  std::vector<StepReport> held;
};

void report_held(const TrainOptions& opt, LossLog& log) {
  for (const auto& r : log.held)
    if (opt.on_step) opt.on_step(r);
  log.held.clear();
}

void resolve(Shared& sh, LossLog& log, std::vector<float>& local_losses) {
  if (!log.pending.valid()) return;
  log.pending.get();
  log.last_global = log.value;
  if (sh.opt.loss_every <= 1) local_losses[std::size_t(log.pending_step)] = log.value;  // already global: no reduction at the end
  for (auto& r : log.held) r.loss = log.last_global;
  report_held(sh.opt, log);
}

// The end of a step on any device: the global loss every loss_every steps, and rank 0's report.
void end_step(Shared& sh, int rank, Runtime& rt, int step, float loss, std::chrono::steady_clock::time_point t0,
              std::vector<float>& local_losses, LossLog& log) {
  const auto& opt = sh.opt;
  local_losses.push_back(loss);
  resolve(sh, log, local_losses);
  const bool reduce_now = (step + 1) % std::max(1, opt.loss_every) == 0 || step + 1 == opt.steps;
  const bool reduces = opt.report_loss && rt.world_size() > 1 && !opt.shard_data;
  if (!reduces) log.last_global = loss;
  if (reduces && reduce_now) {
    log.value = loss;
    log.pending_step = int(local_losses.size()) - 1;  // its slot (step counts from the start of the training)
    log.pending = global_loss(rt, &log.value, 1);
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (rank == 0) {
    if (opt.runtime.zero.clip_grad_norm > 0) sh.result.grad_norms.push_back(rt.last_grad_norm());
    sh.result.step_ms.push_back(ms);
    log.held.push_back(StepReport{step, log.last_global, ms, rt.last_stats()});
  }
  if (!log.pending.valid()) report_held(opt, log);  // nothing in flight: the report goes now
}

// After the last step: memory at the end, and rank 0's parameters, buckets and collectives.
void finish_rank(Shared& sh, int rank, const Runtime& rt, Model& model, std::size_t slot) {
  {
    std::lock_guard lock(sh.mu);
    sh.result.memory_end[slot] = rt.memory_report();
  }
  if (rank == 0) {
    if (sh.data.test_rows > 0) {
      sh.result.heldout_accuracy = model.accuracy(sh.data.x_test.data(), sh.data.y_test.data(), sh.data.test_rows);
      sh.result.heldout_rows = sh.data.test_rows;
    }
    sh.result.params = model.release_state_dict();  // the model is not used again
    sh.result.buckets = rt.buckets();
    sh.result.collectives = rt.collective_log();
    sh.result.stats = rt.stats();
  }
}

Model initial_model(const Shared& sh) {
  Model model(sh.opt.sizes, sh.opt.loss);
  if (sh.init)
    model.load(*sh.init, "--init '" + *sh.opt.init_path + "'");
  else
    model.init(sh.opt.seed);
  return model;
}

// The step loop every trainer shares: per step, K micro-batches of this rank's rows (only the last
// one synchronised: it reduces what all K accumulated), `update` once the gradients are reduced,
// then the global loss and rank 0's report. `micro(x, y, rows, denom)` runs forward and backward
// and returns the micro-batch's loss.
using MicroBatch = std::function<float(const float* x, const float* y, int rows, double loss_denominator)>;
// Test hook (tests/test_nodes.cpp, Note [A node joins live]): SHARDFLOW_TEST_HOLD=STEP:FILE holds
// each rank before step STEP (counted from the start of training) until FILE exists, so that a
// scenario can start another node's launcher while the job is at a known step.
void hold_if_asked(int step) {
  static const auto hold = []() -> std::pair<int, std::string> {
    const char* v = std::getenv("SHARDFLOW_TEST_HOLD");
    const char* colon = v ? std::strchr(v, ':') : nullptr;
    if (!colon) return {-1, ""};
    return {std::atoi(v), colon + 1};
  }();
  if (step != hold.first) return;
  while (!std::filesystem::exists(hold.second)) std::this_thread::sleep_for(std::chrono::milliseconds(20));
}

void train_steps(Shared& sh, int rank, Runtime& rt, const MicroBatch& micro,
                 const std::function<void(int step)>& update, int first_step, int steps_done) {
  const auto& opt = sh.opt;
  const int N = rt.world_size(), B = opt.global_batch, local = B / N, K = opt.accumulate;
  // This rank's loss is a mean over its rows; K micro-batches sum their gradients, so each one's
  // loss counts 1/K: together they equal one K-times-larger batch.
  const double denom = double(local) * (opt.loss == Loss::mse ? opt.sizes.back() : 1) * K;
  std::vector<float> x, y, local_losses;
  LossLog loss_log;
  const auto shard = shard_of(sh.data.rows, rank, N, local);
  // steps_done: resumed from a snapshot, --steps counts from the start (Note [Snapshots]).
  const int steps = (opt.shard_data ? std::min(opt.steps, shard.batches) : opt.steps) - steps_done;
  for (int step = 0; step < steps; ++step) {
    hold_if_asked(first_step + step);
    const auto t0 = std::chrono::steady_clock::now();
    rt.zero_grad();
    float loss = 0.0f;
    for (int m = 0; m < K; ++m) {
      if (opt.shard_data)
        local_batch(sh.data, 0, local, 1, 0, x, y, shard.first + std::size_t(step) * std::size_t(local));
      else
        local_batch(sh.data, (first_step + step) * K + m, B, N, rank, x, y);  // the data position goes on after a resume
      rt.set_require_sync(m == K - 1);
      loss += micro(x.data(), y.data(), local, denom) / float(K);
      rt.wait();  // no_sync passes return at once; the last one: gradients reduced (and stepped)
    }
    update(step);
    end_step(sh, rank, rt, steps_done + step, loss, t0, local_losses, loss_log);  // counted from the start of the training
    const int done = first_step + step + 1;
    if (opt.checkpoint_dir && ((opt.checkpoint_every > 0 && done % opt.checkpoint_every == 0) || step + 1 == opt.steps))
      // Sharded: the files are written while training goes on, and waited for at the next save
      // (save_sharded_checkpoint_async waits for the one before) or after the last step.
      opt.sharded_checkpoint ? rt.save_sharded_checkpoint_async(*opt.checkpoint_dir) : rt.save_checkpoint(checkpoint_file(*opt.checkpoint_dir), 0, opt.checkpoint_max_file_bytes);
  }
  resolve(sh, loss_log, local_losses);  // the last step's loss
  rt.wait_checkpoint();
  if (opt.shard_data) rt.join();  // out of batches: shadow the ranks that still have some
  // Every step's global loss, in one collective at the end (the same sums as per step).
  if (opt.report_loss) {
    if (rt.world_size() > 1 && opt.loss_every > 1 && !local_losses.empty() && !opt.shard_data)
      global_loss(rt, local_losses.data(), local_losses.size()).get();
    if (rank == 0) sh.result.losses = local_losses;
  }
}

// One rank's life, on any device: the model adapter (rank_model.hpp) registers, computes and
// steps; this loop owns the runtime, the schedule of steps and what the result reports. `slot`:
// where this rank's memory reports go in the result (its rank when ranks are threads, 0 when this
// process is one rank of many).
void run_rank(Shared& sh, int rank, const std::shared_ptr<Communicator>& comm, std::size_t slot) {
  const int started_as = rank;
  const auto& opt = sh.opt;
  Model model = initial_model(sh);
  const auto adapter =
      opt.device.kind == Device::Kind::cuda ? make_device_rank_model(model, opt) : make_host_rank_model(model, opt);
  Runtime rt(comm, opt.runtime);
  if (!opt.comm_hook.empty()) rt.register_comm_hook(make_comm_hook(opt.comm_hook, opt.powersgd));  // one per rank: hooks keep state
  adapter->attach(rt);
  rt.finalize();
  if (opt.optimizer_in_runtime) rt.configure_optimizer(opt.optimizer);
  int first_step = 0;
  if (opt.resume_dir) {
    const auto sharded = std::filesystem::path(*opt.resume_dir) / "index.json";
    const auto split = checkpoint_file(*opt.resume_dir) + ".index.json";
    rt.load_checkpoint(std::filesystem::exists(sharded) ? sharded.string()
                       : std::filesystem::exists(split) ? split
                                                        : checkpoint_file(*opt.resume_dir));
    first_step = int(rt.optimizer_steps());
    adapter->after_step(rt, -1);  // compute copies of 16-bit parameters from what was loaded
  }
  int steps_done = 0;
  if (!opt.runtime.snapshot.dir.empty()) {
    steps_done = int(rt.resumed_step());
    first_step += steps_done;
    if (steps_done) adapter->after_step(rt, -1);
  }
  if (opt.checkpoint_dir) std::filesystem::create_directories(*opt.checkpoint_dir);
  {
    std::lock_guard lock(sh.mu);
    sh.result.memory[slot] = rt.memory_report();
  }
  const int loaded_steps = first_step - steps_done;  // from --resume, before the snapshots
  for (;;) {
    try {
      train_steps(
          sh, rank, rt,
          [&](const float* x, const float* y, int rows, double denom) { return adapter->micro_batch(rt, x, y, rows, denom); },
          [&](int step) { adapter->after_step(rt, step); }, first_step, steps_done);
      break;
    } catch (const Error& e) {
      // A lost peer (its death, or its silence past the timeout) with in-place recovery: this
      // process goes on in the job's next round, from the newest snapshot (Note [Recovering in place]).
      if (!opt.rejoin || !(dynamic_cast<const CommError*>(&e) || dynamic_cast<const TimeoutError*>(&e))) throw;
      std::fprintf(stderr, "rank %d: this round ended (%s); recovering in place\n", rank, e.what());
      steps_done = int(rt.recover(opt.rejoin()));
      // A shrinking round numbers the survivors afresh: each takes its new share of every batch.
      if (opt.global_batch % rt.world_size() != 0)
        throw UsageError("recovered at world " + std::to_string(rt.world_size()) + ", which does not divide --global-batch " +
                         std::to_string(opt.global_batch) + ": every rank takes an equal share of each batch");
      rank = rt.rank();
      first_step = loaded_steps + steps_done;
      if (steps_done) adapter->after_step(rt, -1);
      std::fprintf(stderr, "rank %d (pid %ld): recovered in place as rank %d of %d, going on after step %d\n", started_as,
                   long(::getpid()), rank, rt.world_size(), steps_done);
    }
  }
  rt.wait_all_params();  // the last iteration's updates, before anyone reads the parameters
  adapter->finish(rt, model);
  finish_rank(sh, rank, rt, model, slot);
  if (slot == 0) sh.result.rank_at_end = rank;
}

bool is_consequence(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const CommError&) {
    return true;
  } catch (...) {
    return false;
  }
}

}  // namespace

Prepared prepare(const TrainOptions& opt) {
  if (opt.world_size < 1) throw UsageError("--world-size must be >= 1");
  if (opt.global_batch < 1) throw UsageError("--global-batch must be >= 1");
  if (opt.global_batch % opt.world_size != 0)
    throw UsageError("--global-batch " + std::to_string(opt.global_batch) + " is not divisible by the world size " +
                     std::to_string(opt.world_size) + ": every rank takes an equal share of each batch");
  if (opt.steps < 0) throw UsageError("--steps must be >= 0");
  if (opt.accumulate < 1) throw UsageError("--accumulate must be >= 1");
  if (opt.sim) opt.sim->validate(opt.world_size);
  if (opt.device.kind == Device::Kind::cuda) {
    if (opt.sim) throw UsageError("--backend sim simulates a link between CPU ranks; --device cuda moves device memory");
    if (opt.param_dtype != DType::f32)
      throw UsageError("--device cuda: the example's GPU model computes in fp32 parameters (--param-dtype fp32); "
                       "16-bit parameters are supported by its CPU trainer");
    if (opt.loss != Loss::mse)
      throw UsageError("--device cuda: the example's GPU model computes the MSE loss (--loss mse); --loss " +
                       std::string(loss_name(opt.loss)) + " is supported by its CPU trainer");
    if (const auto why = device_model_unavailable(); !why.empty()) throw UsageError("--device cuda: " + why);
  }
  for (const auto& name : opt.freeze) {
    bool known = false;
    std::string all;
    for (int l = 0; l < int(opt.sizes.size()) - 1; ++l)
      for (bool bias : {false, true}) {
        known |= Model::param_name(l, bias) == name;
        all += (all.empty() ? "" : ", ") + Model::param_name(l, bias);
      }
    if (!known) throw UsageError("--freeze: the model has no parameter '" + name + "' (its parameters: " + all + ")");
  }
  if (!opt.freeze.empty() && opt.device.kind == Device::Kind::cuda)
    throw UsageError("--freeze: the example's GPU model does not freeze parameters yet; use its CPU trainer");
  if (!opt.comm_hook.empty()) (void)make_comm_hook(opt.comm_hook, opt.powersgd);  // a bad name or option, before threads start
  if (opt.shard_data) {
    if (!opt.runtime.join.uneven_inputs)
      throw UsageError("--shard-data gives ranks different numbers of batches: it needs join.uneven_inputs (mlp_train sets it)");
    if (opt.accumulate != 1) throw UsageError("--shard-data takes one micro-batch per step (--accumulate 1)");
    if (opt.checkpoint_dir || opt.resume_dir)
      throw UsageError("--shard-data runs one epoch to its end with ranks joining early; checkpoints mid-epoch are not supported with it");
  }
  if (!opt.runtime.snapshot.dir.empty() && !opt.optimizer_in_runtime)
    throw UsageError("--snapshot-dir snapshots the runtime's optimizer state: it needs the optimizer inside the runtime");
  if (opt.resume_dir && !opt.optimizer_in_runtime)
    throw UsageError("--resume restores the runtime's optimizer state: it needs the optimizer inside the runtime");
  if (opt.checkpoint_every < 0) throw UsageError("--every must be >= 0");
  if (!opt.optimizer_in_runtime && (opt.runtime.zero.stage != ZeroStage::ddp || opt.runtime.zero.clip_grad_norm > 0 || opt.param_dtype != DType::f32))
    throw UsageError("ZeRO stages, clipping and 16-bit parameters need the optimizer inside the runtime");
  opt.optimizer.validate();
  opt.runtime.validate();
  // --sizes and --init checked before threads start. Only an --init needs a model to load into:
  // a model made just to check the widths zero-filled every parameter once more (64 MiB, 0.15 s
  // of page faults at 4096 x 4096 on a VM), on every start, a replacement's and a joiner's too.
  Model::check_sizes(opt.sizes);
  Prepared p;
  if (opt.init_path) {
    p.init = load_safetensors(*opt.init_path);
    Model(opt.sizes).load(*p.init, "--init '" + *opt.init_path + "'");
  }
  const int in = opt.sizes.front(), out = opt.sizes.back();
  p.data = opt.data_path
               ? Dataset::load(*opt.data_path, in, out)
               : Dataset::synthetic(in, out, opt.data_rows ? opt.data_rows : std::max<std::size_t>(16 * std::size_t(opt.global_batch), 4096),
                                    opt.seed);
  if (opt.shard_data) p.data_split = describe_split(p.data.rows, opt.world_size, opt.global_batch / opt.world_size);
  return p;
}

std::string checkpoint_file(const std::string& dir) { return (std::filesystem::path(dir) / "checkpoint.safetensors").string(); }

TrainResult train(const TrainOptions& opt) {
  // Ranks are threads here: one BLAS thread each, or the GEMMs of N ranks fight over the cores.
  // Set before prepare() generates the data: some kernels' bits depend on the thread count (Note
  // [OpenBLAS on CPUs it does not know]), and the data must not depend on what ran before.
  const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
  kernels::set_blas_threads(std::max(1, cores / std::max(1, opt.world_size)));  // world 0: refused by prepare()
  const Prepared prep = prepare(opt);

  const auto world = opt.device.kind == Device::Kind::cuda
                         ? InProcessWorld::create_on_device(opt.world_size, opt.device.index, opt.runtime.timeouts.collective)
                     : opt.sim ? make_sim_world(opt.world_size, *opt.sim, opt.runtime.timeouts.collective)
                               : InProcessWorld::create(opt.world_size, opt.runtime.timeouts.collective);
  Shared sh{opt, prep.data, prep.init ? &*prep.init : nullptr, {}, {}, {}};
  sh.result.memory.resize(std::size_t(opt.world_size));
  sh.result.data_split = prep.data_split;
  sh.result.memory_end.resize(std::size_t(opt.world_size));
  std::vector<std::thread> threads;
  for (int r = 0; r < opt.world_size; ++r)
    threads.emplace_back([&sh, &world, r] {
      try {
        run_rank(sh, r, world->communicator(r), std::size_t(r));
      } catch (...) {
        std::lock_guard lock(sh.mu);
        // Keep the root cause: a peer's "aborted" CommError is only a consequence of it.
        if (!sh.error || is_consequence(sh.error)) sh.error = std::current_exception();
        // Peers blocked in a collective with this rank fail promptly instead of at the timeout.
        world->communicator(r)->abort("rank " + std::to_string(r) + " failed");
      }
    });
  for (auto& t : threads) t.join();
  if (sh.error) std::rethrow_exception(sh.error);
  if (opt.save_path) save_safetensors(*opt.save_path, sh.result.params, {{"format", "pt"}});
  return std::move(sh.result);
}

TrainResult train_rank(const TrainOptions& options, const std::shared_ptr<Communicator>& comm) {
  if (!comm) throw UsageError("train_rank: communicator is null");
  if (options.world_size != comm->world_size())
    throw UsageError("--world-size " + std::to_string(options.world_size) + " differs from the launched world size " +
                     std::to_string(comm->world_size()));
  const Prepared prep = prepare(options);
  Shared sh{options, prep.data, prep.init ? &*prep.init : nullptr, {}, {}, {}};
  sh.result.memory.resize(1);
  sh.result.data_split = prep.data_split;
  sh.result.memory_end.resize(1);
  try {
    run_rank(sh, comm->rank(), comm, 0);
  } catch (const std::exception& e) {
    // Peers blocked in a collective with this rank fail promptly instead of at the timeout.
    comm->abort("rank " + std::to_string(comm->rank()) + " failed: " + e.what());
    throw;
  }
  if (options.save_path && sh.result.rank_at_end == 0) save_safetensors(*options.save_path, sh.result.params, {{"format", "pt"}});
  return std::move(sh.result);
}

}  // namespace shardflow::mlp
