// torch_digits: a libtorch convolutional classifier trained data-parallel on shardflow, one process
// per rank — the C++ program PyTorch's DDP has no counterpart for.
//
//   shardflow run --nproc_per_node 2 -- build/examples/torch_digits --zero-stage 1 --steps 400
//
// scikit-learn's handwritten digits (make's set-up converts them to build/data/digits.safetensors),
// global batches of 64 rows split evenly over the ranks, softmax cross-entropy, AdamW inside
// shardflow (ZeRO-1/2 shard it) or a torch::optim optimizer of the trainer's own (--own-optimizer),
// checkpoints, a Chrome trace, a progress line, and the accuracy on the 360 held-out images.
// Started plainly it is world 1.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "shardflow/launch.hpp"
#include "shardflow/libtorch.hpp"
#include "shardflow/safetensors.hpp"
#include "torch_params.hpp"

namespace {

using namespace shardflow;

// conv 3x3 (1 -> 16) · ReLU · conv 3x3 (16 -> 32) · ReLU · max-pool 2 · linear 512 -> 64 · ReLU ·
// linear 64 -> 10. The names are the attributes of tests/torch_digits_ddp.py's nn.Module.
struct NetImpl : torch::nn::Module {
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  NetImpl() {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3).padding(1)));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).padding(1)));
    fc1 = register_module("fc1", torch::nn::Linear(32 * 4 * 4, 64));
    fc2 = register_module("fc2", torch::nn::Linear(64, 10));
  }
  // `before(m)`: forward prefetch waits for m's parameters there.
  torch::Tensor forward(torch::Tensor x, const std::function<void(torch::nn::Module&)>& before = {}) {
    auto use = [&](torch::nn::Module& m) { if (before) before(m); };
    use(*conv1);
    x = torch::relu(conv1(x));
    use(*conv2);
    x = torch::max_pool2d(torch::relu(conv2(x)), 2).flatten(1);
    use(*fc1);
    x = torch::relu(fc1(x));
    use(*fc2);
    return fc2(x);
  }
};
TORCH_MODULE(Net);

struct Digits {
  torch::Tensor x, labels, x_test, labels_test;  // [rows, 1, 8, 8] float, [rows] int64
};

torch::Tensor tensor_of(const TensorMap& t, const std::string& path, const std::string& name) {
  auto it = t.find(name);
  if (it == t.end()) throw Error("--data '" + path + "': tensor '" + name + "' is missing (expected the digits file)");
  auto v = it->second.to_f32("--data '" + path + "': tensor '" + name + "'");
  return torch::from_blob(v.data(), it->second.shape).clone();
}

Digits load_digits(const std::string& path) {
  if (!std::filesystem::exists(path))
    throw UsageError("--data '" + path + "': no such file (make's set-up writes build/data/digits.safetensors; it needs python3-sklearn)");
  const auto t = load_safetensors(path);
  Digits d;
  auto images = [](const torch::Tensor& x, const std::string& what) {
    if (x.dim() != 2 || x.size(1) != 64) throw Error(what + ": expected [rows, 64] (8x8 images), got " + c10::str(x.sizes()));
    return x.view({x.size(0), 1, 8, 8});
  };
  d.x = images(tensor_of(t, path, "x"), "--data '" + path + "': x");
  d.labels = tensor_of(t, path, "y").argmax(1);
  d.x_test = images(tensor_of(t, path, "x_test"), "--data '" + path + "': x_test");
  d.labels_test = tensor_of(t, path, "y_test").argmax(1);
  return d;
}

// The mean of one float over the ranks (the progress line's global loss).
float global_mean(Communicator& comm, float v, std::chrono::milliseconds timeout) {
  CollectiveOp op;
  op.send = op.recv = &v;
  op.count = 1;
  op.scale = 1.0f / float(comm.world_size());
  op.tag = "loss";
  comm.run(op, timeout);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"A libtorch CNN on the digits, data-parallel on shardflow (one process per rank under `shardflow run`)"};
  std::string data = SHARDFLOW_DIGITS_DEFAULT, optimizer = "adamw", overlap = "interleaved", init, save, ckpt_dir, resume, trace,
              backend = "auto";
  int steps = 400, global_batch = 64, zero_stage = 1, every = 0, threads = 0, log_every = 0;
  float lr = 1e-3f;
  std::uint64_t seed = 0;
  bool own_optimizer = false, prefetch = false;
  double timeout_s = 120;
  app.add_option("--data", data, "the digits as safetensors (x, y, x_test, y_test)")->capture_default_str();
  app.add_option("--steps", steps, "optimizer steps")->capture_default_str();
  app.add_option("--global-batch", global_batch, "rows per step over all ranks (divisible by the world size)")->capture_default_str();
  app.add_option("--optimizer", optimizer, "adamw | sgd")->capture_default_str();
  app.add_option("--lr", lr, "learning rate")->capture_default_str();
  app.add_option("--zero-stage", zero_stage, "0 (DDP), 1 (optimizer state sharded), 2 (and gradients)")->capture_default_str();
  app.add_option("--overlap", overlap, "none | after-backward | interleaved: when the shards step")->capture_default_str();
  app.add_flag("--forward-prefetch", prefetch, "parameter syncs land during the next forward, waited for layer by layer");
  app.add_flag("--own-optimizer", own_optimizer, "plain DDP: shardflow averages the gradients, torch::optim steps every parameter");
  app.add_option("--seed", seed, "torch::manual_seed of the initial weights")->capture_default_str();
  app.add_option("--init", init, "initial weights (safetensors with the module's names), instead of --seed's");
  app.add_option("--save", save, "final parameters (rank 0) as safetensors");
  app.add_option("--checkpoint-dir", ckpt_dir, "DIR/checkpoint.safetensors at the end and every --every steps");
  app.add_option("--every", every, "checkpoint every N steps (0: at the end only)")->capture_default_str();
  app.add_option("--resume", resume, "continue from DIR/checkpoint.safetensors (any world size or stage)");
  app.add_option("--trace", trace, "Chrome trace of every rank's forward, backward, reductions and steps");
  app.add_option("--threads", threads, "torch intra-op threads per rank (0: OMP_NUM_THREADS, which the launcher sets, else 1)")->capture_default_str();
  app.add_option("--log-every", log_every, "progress line every N steps (0: about 20 lines)")->capture_default_str();
  app.add_option("--backend", backend,
                 "under a launcher: auto (shm on one host, two levels on several hosts of several ranks, else gloo) | shm | "
                 "gloo | hierarchical")
      ->capture_default_str();
  app.add_option("--timeout", timeout_s, "seconds any wait on another rank may take")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  try {
    const LaunchEnv env = LaunchEnv::detect();
    std::shared_ptr<Communicator> comm =
        env.launched() ? init_process_group(env, ProcessGroupOptions{backend, std::chrono::milliseconds(std::int64_t(timeout_s * 1000))})
                       : InProcessWorld::create(1)->communicator(0);
    if (!env.launched() && app.count("--backend"))
      throw UsageError("--backend picks how processes talk; started plainly torch_digits is world 1 (start it with `shardflow run --nproc_per_node N --`)");
    const int world = comm->world_size(), rank = comm->rank();
    if (steps < 0) throw UsageError("--steps must be >= 0");
    if (global_batch < 1 || global_batch % world != 0)
      throw UsageError("--global-batch " + std::to_string(global_batch) + " must be a positive multiple of the world size " + std::to_string(world));
    if (zero_stage < 0 || zero_stage > 2) throw UsageError("--zero-stage must be 0, 1 or 2");
    if (own_optimizer && (zero_stage != 0 || prefetch || !resume.empty() || !ckpt_dir.empty()))
      throw UsageError("--own-optimizer steps with torch::optim: ZeRO stages, --forward-prefetch and checkpoints need shardflow's optimizer");
    if (threads <= 0) threads = std::getenv("OMP_NUM_THREADS") ? std::max(1, std::atoi(std::getenv("OMP_NUM_THREADS"))) : 1;
    torch::set_num_threads(threads);

    const Digits d = load_digits(data);
    torch::manual_seed(seed);
    Net net;
    if (!init.empty()) examples::load_params(*net, init);

    libtorch::Options opts;
    opts.config.zero.stage = ZeroStage(zero_stage);
    // --overlap says when shardflow's optimizer steps; with torch::optim's there is none to overlap.
    if (!own_optimizer) opts.config.zero.overlap = parse_overlap(overlap);
    if (own_optimizer && app.count("--overlap")) throw UsageError("--overlap times shardflow's optimizer steps; --own-optimizer steps after backward");
    opts.config.zero.forward_prefetch = prefetch;
    opts.config.timeouts.collective = std::chrono::milliseconds(std::int64_t(timeout_s * 1000));
    opts.config.trace.path = trace;
    OptimizerConfig oc;
    oc.kind = OptimizerConfig::parse_kind(optimizer);
    oc.lr = lr;
    if (!own_optimizer) opts.optimizer = oc;
    libtorch::DataParallel ddp(*net, comm, opts);  // rank 0's weights on every rank from here
    Runtime& rt = ddp.runtime();
    std::unique_ptr<torch::optim::Optimizer> torch_opt;
    if (own_optimizer) {
      if (oc.kind == OptimizerConfig::Kind::adamw)
        torch_opt = std::make_unique<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(lr).weight_decay(oc.effective_weight_decay()));
      else
        torch_opt = std::make_unique<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(lr).momentum(oc.momentum).weight_decay(oc.effective_weight_decay()));
    }
    int first = 0;
    if (!resume.empty()) {
      rt.load_checkpoint((std::filesystem::path(resume) / "checkpoint.safetensors").string());
      first = int(rt.optimizer_steps());
    }
    if (!ckpt_dir.empty()) std::filesystem::create_directories(ckpt_dir);

    const int local = global_batch / world;
    const auto rows = d.x.size(0);
    const int print_every = log_every > 0 ? log_every : std::max(1, steps / 20);
    if (rank == 0)
      std::printf("torch_digits: world %d (%s), global batch %d, %s lr %g %s, zero stage %d, overlap %s%s, %d torch thread(s) per rank\n", world,
                  comm->backend_name().c_str(), global_batch, optimizer.c_str(), double(lr), own_optimizer ? "(torch::optim)" : "(in shardflow)",
                  zero_stage, own_optimizer ? "none" : overlap.c_str(), prefetch ? ", forward prefetch" : "", threads);
    std::vector<double> step_ms;
    float first_loss = 0, last_loss = 0;
    for (int s = 0; s < steps; ++s) {
      const auto t0 = std::chrono::steady_clock::now();
      const int step = first + s;  // the data position goes on after a resume
      auto idx = (torch::arange(local, torch::kLong) + std::int64_t(step) * global_batch + std::int64_t(rank) * local).remainder(rows);
      ddp.zero_grad();
      torch::Tensor logits;
      {
        auto span = rt.span("forward", "forward");
        logits = prefetch ? net->forward(d.x.index_select(0, idx), [&](torch::nn::Module& m) { ddp.wait_for(m); })
                          : net->forward(d.x.index_select(0, idx));
      }
      auto loss = torch::nn::functional::cross_entropy(logits, d.labels.index_select(0, idx));
      ddp.backward(loss);
      if (torch_opt) {
        auto span = rt.span("torch::optim step", "step");
        torch_opt->step();
      }
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      step_ms.push_back(ms);
      if (!ckpt_dir.empty() && (s + 1 == steps || (every > 0 && (step + 1) % every == 0)))
        rt.save_checkpoint((std::filesystem::path(ckpt_dir) / "checkpoint.safetensors").string());
      if ((s + 1) % print_every == 0 || s == 0 || s + 1 == steps) {
        if (prefetch) rt.wait_all_params();  // our all-reduce must not race the runtime's syncs
        const float g = global_mean(*comm, loss.item<float>(), opts.config.timeouts.collective);
        if (s == 0) first_loss = g;
        last_loss = g;
        if (rank == 0)
          std::printf("step %d/%d  loss %.6f  %7.3f ms  %8.0f samples/s\n", s + 1, steps, double(g), ms, global_batch * 1000.0 / ms);
      }
    }
    rt.wait_all_params();
    if (rank == 0) {
      torch::NoGradGuard no_grad;
      net->eval();
      const double acc = net->forward(d.x_test).argmax(1).eq(d.labels_test).to(torch::kDouble).mean().item<double>();
      std::sort(step_ms.begin(), step_ms.end());
      std::printf("done: %d steps, loss %.6f -> %.6f, median step %.3f ms\n", steps, double(first_loss), double(last_loss),
                  step_ms.empty() ? 0.0 : step_ms[step_ms.size() / 2]);
      std::printf("held-out accuracy %.1f%% (%lld images never trained on)\n", 100.0 * acc, static_cast<long long>(d.x_test.size(0)));
      if (!save.empty()) {
        examples::save_params(*net, save);
        std::printf("saved %s\n", save.c_str());
      }
      if (!ckpt_dir.empty()) std::printf("checkpoint %s/checkpoint.safetensors\n", ckpt_dir.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torch_digits: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
