// gpt_train: a small GPT (examples/gpt/model.hpp) trained character by character on English text,
// data-parallel on shardflow through its libtorch adapter: ranks as threads of this process
// (--world-size N), or one process per rank under the launcher (shm on one host, Gloo across hosts).
//
//   build/examples/gpt_train                                   # world 1, 10.7 M parameters, ~4 minutes
//   shardflow run --nproc_per_node 2 -- build/examples/gpt_train --zero-stage 2 --forward-prefetch
//
// Data: Debian's fortunes as a character-level corpus (build/data/fortunes.safetensors, written by
// scripts/text_to_safetensors.py), with a held-out split no rank trains on. AdamW inside shardflow
// (decay on matrices and embeddings, none on biases and LayerNorm gains, as nanoGPT does), a
// warm-up then cosine learning rate (examples/gpt/schedule.hpp), the global batch the same at every
// world size (Note [GPT batches]). At the end: the held-out loss, tokens per second, memory, and a
// few lines of sampled text.
//
// --device cuda: the model, batches, buckets, shards and optimizer state on the GPU (a CUDA build
// of torch, e.g. the machine's own: docs/cuda.md); ranks as threads share that GPU
// (InProcessWorld::create_on_device), launched ranks take NCCL. --dtype bf16: bf16 parameters and
// activations, fp32 masters in shardflow's shards.
#include <CLI/CLI.hpp>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <string>
#include <thread>

#include "bucket_flags.hpp"
#include "gpt/model.hpp"
#include "gpt/schedule.hpp"
#include "gpt/text.hpp"
#include "shardflow/launch.hpp"
#include "shardflow/libtorch.hpp"
#include "shardflow/safetensors.hpp"
#include "shardflow/sim.hpp"
#include "snapshot_flags.hpp"
#include "torch_params.hpp"

namespace {

using namespace shardflow;

struct Args {
  std::string data = SHARDFLOW_TEXT_DEFAULT, overlap = "interleaved", partition = "flat", backend = "auto", trace, stats_json, save, save_init,
              init, checkpoint_dir, resume, prompt = "The ", device = "cpu", dtype = "fp32";
  gpt::GptConfig model;
  int batch = 16, steps = 200, stop_at = 0, warmup = 20, world_size = 1, zero_stage = 1, every = 0, log_every = 0, threads = 0, eval_windows = 256,
      sample_chars = 300;
  float lr = 1e-3f, weight_decay = 0.1f, clip = 0.0f, temperature = 0.8f;
  double timeout_s = 300;
  ::examples::BucketFlags buckets;
  ::examples::SnapshotFlags snapshot_flags;
  SnapshotConfig snapshot;
  int redundancy = 1, twin_distance = 0;
  std::uint64_t seed = 1;
  int syncs_in_backward = -1;
  std::size_t max_buckets_in_flight = 0;
  int interleave_lag = -1;
  bool prefetch = false, quiet = false;
  SimLink sim;  // ranks as threads: the simulated link (--sim-gbytes-per-s), else shared memory
};

// Autoregressive sampling from rank 0's final model: the last --context tokens in, one character
// out at a time, softmax at --temperature.
std::string sample(gpt::Gpt& net, const gpt::Corpus& c, const std::string& prompt, int chars, float temperature, std::uint64_t seed) {
  std::vector<std::int64_t> ids;
  for (unsigned char ch : prompt) {
    auto it = std::find(c.vocab.begin(), c.vocab.end(), ch);
    if (it == c.vocab.end()) throw UsageError(std::string("--prompt: the character '") + char(ch) + "' never occurs in the corpus");
    ids.push_back(it - c.vocab.begin());
  }
  torch::NoGradGuard no_grad;
  net->eval();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (int i = 0; i < chars; ++i) {
    const std::size_t from = ids.size() > std::size_t(net->cfg.context) ? ids.size() - net->cfg.context : 0;
    auto x = torch::tensor(std::vector<std::int64_t>(ids.begin() + std::ptrdiff_t(from), ids.end()), torch::kLong).unsqueeze(0);
    auto logits = net->forward(x.to(net->wte->weight.device())).select(1, -1).squeeze(0).to(torch::kCPU, torch::kFloat) / std::max(1e-3f, temperature);
    ids.push_back(torch::multinomial(torch::softmax(logits, -1), 1, false, gen).item<std::int64_t>());
  }
  net->train();
  return c.decode(ids);
}

// The global mean of the loss without draining the runtime: queued on the comm stream after the
// step's own collectives (Runtime::collective) and read after the next step, so forward prefetch's
// syncs never wait for it. Reports leave in step order.
struct LossLine {
  int step;
  double ms;
  float lr;
  std::unique_ptr<float> value;  // the reduction's buffer
  std::future<void> done;
};

struct Result {
  std::vector<double> step_ms;
  int steps_run = 0;
  float first_loss = 0, last_loss = 0;
  double heldout = 0;
  std::string sample, memory, backend;
  std::int64_t params = 0;
  std::size_t buckets = 0;
  RuntimeStats stats;
};

void train_rank(const Args& a, std::shared_ptr<Communicator> comm, const gpt::Corpus& corpus, bool report, Result& out) {
  const int world = comm->world_size(), rank = comm->rank();
  gpt::GptConfig mc = a.model;
  mc.vocab = corpus.vocab_size();
  // libtorch's generator is the process's: ranks that are threads draw their weights one at a
  // time, or rank 0's would depend on the other threads' draws (and differ from world 1's).
  static std::mutex init_mu;
  gpt::Gpt net(nullptr);
  {
    std::lock_guard lock(init_mu);
    torch::manual_seed(a.seed);
    net = gpt::Gpt(mc);
  }
  if (!a.init.empty()) examples::load_params(*net, a.init, " (check --layers, --d-model, --context)");
  const torch::Device device(a.device);
  net->to(device, a.dtype == "bf16" ? torch::kBFloat16 : torch::kFloat);

  libtorch::Options opts;
  auto& cfg = opts.config;
  cfg.zero.stage = ZeroStage(a.zero_stage);
  cfg.zero.overlap = parse_overlap(a.overlap);
  cfg.zero.partition = parse_partition(a.partition);
  cfg.zero.forward_prefetch = a.prefetch;
  cfg.zero.prefetch_syncs_in_backward = a.syncs_in_backward;
  cfg.zero.max_buckets_in_flight = a.max_buckets_in_flight;
  cfg.zero.interleave_lag = a.interleave_lag;
  cfg.zero.clip_grad_norm = a.clip;
  a.buckets.apply(cfg.buckets);
  cfg.timeouts.collective = std::chrono::milliseconds(std::int64_t(a.timeout_s * 1000));
  cfg.trace.path = a.trace;
  cfg.setting_names = {{"zero.stage", "--zero-stage"},         {"zero.overlap", "--overlap"},
                       {"zero.partition", "--partition"},      {"zero.forward_prefetch", "--forward-prefetch"}, {"zero.prefetch_syncs_in_backward", "--prefetch-syncs-in-backward"}, {"zero.interleave_lag", "--interleave-lag"},
                       {"zero.max_buckets_in_flight", "--max-buckets-in-flight"},
                       {"zero.clip_grad_norm", "--clip-grad-norm"}, {"buckets.cap_bytes", "--bucket-mb"},
                       {"buckets.first_cap_bytes", "--first-bucket-mb"}, {"buckets.last_cap_bytes", "--last-bucket-mb"}, {"buckets.min_buckets", "--min-buckets"}, {"timeouts.collective", "--timeout"}};
  cfg.snapshot = a.snapshot;
  cfg.zero.redundancy = a.redundancy;
  cfg.zero.twin_distance = a.twin_distance;
  a.snapshot_flags.apply(cfg);
  libtorch::DataParallel ddp(*net, comm, opts);  // rank 0's weights on every rank from here
  Runtime& rt = ddp.runtime();
  // Two AdamW groups: weight decay on matrices and embeddings (the tied head with them), none on
  // biases and LayerNorm gains.
  OptimizerConfig decay;
  decay.kind = OptimizerConfig::Kind::adamw;
  decay.lr = a.lr;
  decay.beta2 = 0.95f;
  decay.weight_decay = a.weight_decay;
  OptimizerConfig flat = decay;
  flat.weight_decay = 0.0f;
  ParamGroup g_decay{{}, decay}, g_flat{{}, flat};
  for (auto& item : net->named_parameters()) (item.value().dim() >= 2 ? g_decay : g_flat).params.push_back(rt.param(item.key()));
  rt.configure_optimizer({g_decay, g_flat});

  if (!a.save_init.empty() && rank == 0) examples::save_params(*net, a.save_init);
  int first = 0;
  // The runtime's own snapshots: a restarted job (shardflow run --max-restarts) goes on from the
  // newest; the schedule and the data position follow the step alone.
  if (!cfg.snapshot.dir.empty()) {
    if (!a.resume.empty()) throw UsageError("--resume and --snapshot-dir: give one place to go on from");
    first = int(rt.resumed_step());
  }
  if (!a.resume.empty()) {
    rt.load_checkpoint((std::filesystem::path(a.resume) / "checkpoint.safetensors").string());
    first = int(rt.optimizer_steps());
  }
  if (!a.checkpoint_dir.empty() && rank == 0) std::filesystem::create_directories(a.checkpoint_dir);

  const int local = a.batch / world, T = mc.context;
  const int every = a.log_every > 0 ? a.log_every : std::max(1, a.steps / 20);
  const double tokens_per_step = double(a.batch) * T;
  if (report) {
    out.params = net->num_parameters();
    std::printf("gpt_train: %lld parameters (%d layers, d_model %d, %d heads, context %d, vocabulary %d), world %d (%s), "
                "global batch %d x %d tokens, AdamW lr %g, zero stage %d, overlap %s%s\n",
                static_cast<long long>(out.params), mc.layers, mc.d_model, mc.heads, T, mc.vocab, world, comm->backend_name().c_str(), a.batch, T,
                double(a.lr), a.zero_stage, a.overlap.c_str(), a.prefetch ? ", forward prefetch" : "");
    std::printf("data: %zu training characters, %zu held out\n", corpus.train.size(), corpus.val.size());
    std::fflush(stdout);
  }
  std::deque<LossLine> lines;
  auto flush = [&](bool all) {
    while (!lines.empty() && (all || lines.front().done.wait_for(std::chrono::seconds(0)) == std::future_status::ready)) {
      auto& l = lines.front();
      l.done.get();
      if (l.step == first) out.first_loss = *l.value;
      out.last_loss = *l.value;
      if (report && !a.quiet)
        std::printf("step %*d/%d  loss %.4f  lr %.2e  %8.1f ms  %8.0f tokens/s\n", int(std::to_string(a.steps).size()), l.step + 1,
                    a.steps, double(*l.value), double(l.lr), l.ms, tokens_per_step * 1000.0 / l.ms);
      std::fflush(stdout);
      lines.pop_front();
    }
  };
  // --steps is the whole run's length (the schedule's); a resumed run goes on from the
  // checkpoint's step (its data position too) to it, and --stop-at ends this process early.
  const int end = a.stop_at > 0 ? std::min(a.steps, a.stop_at) : a.steps;
  if (first > a.steps) throw UsageError("--resume: the checkpoint is at step " + std::to_string(first) + ", past --steps " + std::to_string(a.steps));
  out.steps_run = std::max(0, end - first);
  for (int step = first; step < end; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    const float lr = gpt::lr_at(a.lr, step, a.warmup, a.steps);
    rt.set_lr(0, lr);
    rt.set_lr(1, lr);
    auto b = gpt::train_batch(corpus, a.seed, step, std::int64_t(rank) * local, local, T);
    b.x = b.x.to(device);
    b.y = b.y.to(device);
    ddp.zero_grad();
    torch::Tensor logits;
    {
      auto span = rt.span("forward", "forward");
      logits = a.prefetch ? net->forward(b.x, [&](torch::nn::Module& m) { ddp.wait_for(m); }) : net->forward(b.x);
    }
    const auto loss = torch::nn::functional::cross_entropy(logits.view({-1, mc.vocab}).to(torch::kFloat), b.y.view({-1}));
    ddp.backward(loss);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    out.step_ms.push_back(ms);
    if (!a.checkpoint_dir.empty() && (step + 1 == end || (a.every > 0 && (step + 1) % a.every == 0)))
      rt.save_checkpoint((std::filesystem::path(a.checkpoint_dir) / "checkpoint.safetensors").string());
    if ((step + 1) % every == 0 || step == first || step + 1 == end) {
      LossLine l{step, ms, lr, std::make_unique<float>(loss.item<float>()), {}};
      CollectiveOp op;
      op.send = op.recv = l.value.get();
      op.count = 1;
      op.scale = 1.0f / float(world);
      op.tag = "loss";
      l.done = rt.collective(op);
      lines.push_back(std::move(l));
    }
    flush(false);
  }
  flush(true);
  rt.wait_all_params();
  out.stats = rt.stats();
  out.buckets = rt.buckets().size();
  out.memory = rt.memory_report().str();
  if (report) {
    auto fwd = [&](const torch::Tensor& x) { return net->forward(x.to(device)).to(torch::kCPU, torch::kFloat); };
    out.heldout = gpt::heldout_loss(*net, fwd, corpus, T, a.eval_windows, std::max(1, local));
    if (!a.save.empty()) examples::save_params(*net, a.save);
    if (a.sample_chars > 0) out.sample = sample(net, corpus, a.prompt, a.sample_chars, a.temperature, a.seed);
  }
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"A small GPT on English text, data-parallel on shardflow (ranks as threads, or one process per rank under `shardflow run`)"};
  Args a;
  app.add_option("--data", a.data, "the corpus: scripts/text_to_safetensors.py's file (train, val, vocab)")->capture_default_str();
  app.add_option("--layers", a.model.layers, "transformer blocks")->capture_default_str();
  app.add_option("--d-model", a.model.d_model, "width of the residual stream")->capture_default_str();
  app.add_option("--heads", a.model.heads, "attention heads (divides --d-model)")->capture_default_str();
  app.add_option("--context", a.model.context, "tokens per sequence")->capture_default_str();
  app.add_option("--batch", a.batch, "sequences per step over all ranks (a multiple of the world size)")->capture_default_str();
  app.add_option("--steps", a.steps, "the run's optimizer steps (the schedule's length; a resumed run goes on to it)")->capture_default_str();
  app.add_option("--stop-at", a.stop_at, "end after this step, as a preempted job would (the schedule still spans --steps)");
  app.add_option("--lr", a.lr, "peak learning rate (AdamW)")->capture_default_str();
  app.add_option("--warmup", a.warmup, "steps of linear warm-up before the cosine decay to lr/10")->capture_default_str();
  app.add_option("--weight-decay", a.weight_decay, "AdamW weight decay of matrices and embeddings")->capture_default_str();
  app.add_option("--clip-grad-norm", a.clip, "clip the global gradient 2-norm to this (0: off; on, a step waits for every bucket)")->capture_default_str();
  app.add_option("--zero-stage", a.zero_stage, "0 (DDP), 1 (optimizer state sharded), 2 (and gradients)")->capture_default_str();
  app.add_option("--overlap", a.overlap, "none | after_backward | interleaved: when the shards step")->capture_default_str();
  app.add_option("--partition", a.partition, "param | bucket | flat")->capture_default_str();
  app.add_flag("--forward-prefetch", a.prefetch, "parameter syncs land during the next forward, waited for block by block");
  app.add_option("--prefetch-syncs-in-backward", a.syncs_in_backward,
                 "with --forward-prefetch: parameter syncs sent during backward (-1: chosen from the second step)")
      ->capture_default_str();
  app.add_option("--max-buckets-in-flight", a.max_buckets_in_flight,
                 "ZeRO-2: gradient buffers held at once (0: as many as the memory budget holds; more makes the buckets smaller within it)")
      ->capture_default_str();
  app.add_option("--interleave-lag", a.interleave_lag,
                 "interleaved: bucket b's sync goes after the reduction of bucket b+lag (0: as soon as stepped; -1: chosen from what "
                 "the first and fifth steps measured)")->capture_default_str();
  a.buckets.add(app);
  a.snapshot_flags.add(app, a.snapshot);
  a.snapshot_flags.add_twins(app, a.redundancy, a.twin_distance);
  app.add_option("--backend", a.backend,
                 "under a launcher: auto (shm on one host, two levels on several hosts of several ranks, else gloo) | shm | "
                 "gloo | hierarchical")
      ->capture_default_str();
  app.add_option("--sim-gbytes-per-s", a.sim.gbytes_per_s,
                 "ranks as threads: between them a simulated link of this rate, GB/s (Note [Simulated link]; the data still moves "
                 "in memory, each collective completes when the link would have carried it)");
  app.add_option("--sim-latency-us", a.sim.latency_us, "with --sim-gbytes-per-s: the link's latency per message step, microseconds")
      ->capture_default_str();
  app.add_option("--device", a.device, "cpu | cuda | cuda:N: where the model, its buckets and shards live")->capture_default_str();
  app.add_option("--dtype", a.dtype, "fp32 | bf16 (bf16 parameters and activations, fp32 masters in the shards)")->capture_default_str();
  app.add_option("--world-size", a.world_size, "ranks as threads of this process (under a launcher: the launcher's)")->capture_default_str();
  app.add_option("--threads", a.threads, "torch intra-op threads (0: OMP_NUM_THREADS, else the cores / the ranks)")->capture_default_str();
  app.add_option("--seed", a.seed, "initial weights and the batches' windows")->capture_default_str();
  app.add_option("--init", a.init, "initial weights (safetensors with the module's names) instead of --seed's");
  app.add_option("--save-init", a.save_init, "write the initial weights (rank 0's, what every rank starts from) as safetensors");
  app.add_option("--save", a.save, "write the final parameters (safetensors, the module's names)");
  app.add_option("--save-checkpoint", a.checkpoint_dir, "DIR/checkpoint.safetensors at the end (and every --every steps): any world size resumes it");
  app.add_option("--every", a.every, "with --save-checkpoint: also every K steps (0: at the end only)")->capture_default_str();
  app.add_option("--resume", a.resume, "continue from DIR/checkpoint.safetensors: steps, data position and optimizer state");
  app.add_option("--trace", a.trace, "Chrome trace of every rank's forward, backward, reductions and steps");
  app.add_option("--stats-json", a.stats_json, "rank 0's runtime figures per iteration and their medians (JSON)");
  app.add_option("--log-every", a.log_every, "progress line every N steps (0: about 20 lines)")->capture_default_str();
  app.add_option("--eval-windows", a.eval_windows, "held-out windows of --context tokens for the final loss")->capture_default_str();
  app.add_option("--sample-chars", a.sample_chars, "characters of text to sample at the end (0: none)")->capture_default_str();
  app.add_option("--prompt", a.prompt, "the sample's first characters")->capture_default_str();
  app.add_option("--temperature", a.temperature, "the sample's softmax temperature")->capture_default_str();
  app.add_option("--timeout", a.timeout_s, "seconds any wait on another rank may take")->capture_default_str();
  app.add_flag("--quiet", a.quiet, "only the summary");
  CLI11_PARSE(app, argc, argv);

  try {
    try {
      a.model.vocab = 1;  // the corpus's, checked once it is read
      a.model.validate();
    } catch (const std::invalid_argument& e) {
      throw UsageError(e.what());
    }
    if (a.steps < 0) throw UsageError("--steps must be >= 0");
    if (a.warmup < 0) throw UsageError("--warmup must be >= 0");
    if (a.zero_stage < 0 || a.zero_stage > 2) throw UsageError("--zero-stage must be 0, 1 or 2, got " + std::to_string(a.zero_stage));
    {
      BucketConfig check;  // a bad flag is refused before training
      a.buckets.apply(check);
    }
    if (a.timeout_s <= 0) throw UsageError("--timeout must be positive");
    if (a.eval_windows < 1) throw UsageError("--eval-windows must be >= 1");
    if (!a.stats_json.empty()) {  // fail before training, not after it
      std::ofstream probe(a.stats_json, std::ios::app);
      if (!probe) throw UsageError("--stats-json '" + a.stats_json + "': cannot write");
    }
    if (a.dtype != "fp32" && a.dtype != "bf16") throw UsageError("--dtype must be fp32 or bf16, got '" + a.dtype + "'");
    int cuda_index = -1;
    try {
      const torch::Device d(a.device);
      if (!d.is_cpu() && !d.is_cuda()) throw UsageError("--device must be cpu, cuda or cuda:N, got '" + a.device + "'");
      if (d.is_cuda()) {
        if (!torch::cuda::is_available())
          throw UsageError("--device " + a.device + ": this torch sees no GPU (a CPU build of torch, or no device here)");
        cuda_index = d.has_index() ? d.index() : 0;
        a.device = "cuda:" + std::to_string(cuda_index);
      }
    } catch (const c10::Error&) {
      throw UsageError("--device must be cpu, cuda or cuda:N, got '" + a.device + "'");
    }
    const LaunchEnv env = LaunchEnv::detect();
    const auto timeout = std::chrono::milliseconds(std::int64_t(a.timeout_s * 1000));
    std::vector<std::shared_ptr<Communicator>> comms;
    if (env.launched()) {
      if (app.count("--sim-gbytes-per-s") || app.count("--sim-latency-us"))
        throw UsageError("--sim-gbytes-per-s simulates the link between ranks as threads; under a launcher the ranks use the real one");
      if (app.count("--world-size") && a.world_size != env.world_size)
        throw UsageError("--world-size " + std::to_string(a.world_size) + " but the launcher started " + std::to_string(env.world_size) + " rank(s)");
      // A GPU per process: NCCL, unless --backend names another (which then refuses CUDA buckets by name).
      comms.push_back(init_process_group(env, ProcessGroupOptions{cuda_index >= 0 && a.backend == "auto" ? "nccl" : a.backend, timeout}));
    } else {
      if (app.count("--backend")) throw UsageError("--backend picks how processes talk; as threads the ranks share memory (start gpt_train with `shardflow run` for shm or gloo)");
      if (a.world_size < 1) throw UsageError("--world-size must be >= 1, got " + std::to_string(a.world_size));
      const bool simulated = app.count("--sim-gbytes-per-s") > 0;
      if (simulated && cuda_index >= 0) throw UsageError("--sim-gbytes-per-s simulates a link between CPU ranks; --device " + a.device + " shares one GPU");
      if (!simulated && app.count("--sim-latency-us")) throw UsageError("--sim-latency-us describes the simulated link: add --sim-gbytes-per-s");
      auto world = simulated         ? make_sim_world(a.world_size, a.sim, timeout)
                   : cuda_index >= 0 ? InProcessWorld::create_on_device(a.world_size, cuda_index, timeout)
                                     : InProcessWorld::create(a.world_size, timeout);
      for (int r = 0; r < a.world_size; ++r) comms.push_back(world->communicator(r));
    }
    const int world = comms.front()->world_size();
    if (a.batch < 1 || a.batch % world != 0)
      throw UsageError("--batch " + std::to_string(a.batch) + " must be a positive multiple of the world size " + std::to_string(world));
    int threads = a.threads;
    if (threads <= 0) {
      const char* omp = std::getenv("OMP_NUM_THREADS");
      threads = omp ? std::max(1, std::atoi(omp)) : std::max(1, int(std::thread::hardware_concurrency()) / int(comms.size()));
    }
    torch::set_num_threads(threads);
    const gpt::Corpus corpus = gpt::load_corpus(a.data, a.model.context);

    Result res;
    const bool report_rank0 = !env.launched() || env.rank == 0;
    if (comms.size() == 1) {
      train_rank(a, comms.front(), corpus, report_rank0, res);
    } else {
      std::vector<Result> others(comms.size() - 1);
      std::vector<std::exception_ptr> errors(comms.size());
      std::vector<std::thread> ranks;
      for (std::size_t r = 0; r < comms.size(); ++r)
        ranks.emplace_back([&, r] {
          try {
            train_rank(a, comms[r], corpus, r == 0, r == 0 ? res : others[r - 1]);
          } catch (...) {
            errors[r] = std::current_exception();
          }
        });
      for (auto& t : ranks) t.join();
      for (auto& e : errors)
        if (e) std::rethrow_exception(e);
    }
    if (!report_rank0) return 0;
    const double med = median(res.step_ms);
    const double tokens = double(a.batch) * a.model.context;
    rusage ru{};
    ::getrusage(RUSAGE_SELF, &ru);  // ru_maxrss: KiB on Linux
    std::printf("done: %d steps, loss %.4f -> %.4f, median step %.1f ms, %.0f tokens/s\n", res.steps_run, double(res.first_loss), double(res.last_loss),
                med, med > 0 ? tokens * 1000.0 / med : 0.0);
    std::printf("held-out loss %.4f (%d windows of %d characters never trained on)\n", res.heldout, a.eval_windows, a.model.context);
    std::printf("memory rank 0: %s; peak resident memory of this process %.1f MB\n", res.memory.c_str(), double(ru.ru_maxrss) * 1024 / 1e6);
    const auto& m = res.stats.median;
    std::printf("runtime (rank 0, median): iteration %.1f ms, exposed %.1f ms, link %.1f ms (hidden %.1f ms), optimizer %.1f ms, %zu bucket(s), "
                "%zu/%zu done inside backward\n",
                m.iteration_ms, m.exposed_ms, m.link_ms, m.hidden_ms, m.optimizer_ms, res.buckets, m.buckets_done_in_backward, m.buckets);
    if (!a.save.empty()) std::printf("saved %s\n", a.save.c_str());
    if (!a.checkpoint_dir.empty()) std::printf("checkpoint %s/checkpoint.safetensors\n", a.checkpoint_dir.c_str());
    if (!a.stats_json.empty()) {
      std::ofstream f(a.stats_json);
      f << res.stats.to_json() << "\n";
      if (!f) throw Error("--stats-json '" + a.stats_json + "': write failed");
      std::printf("stats %s\n", a.stats_json.c_str());
    }
    if (!res.sample.empty()) std::printf("sample:\n%s\n", res.sample.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpt_train: %s\n", e.what());
    return 1;
  }
}
