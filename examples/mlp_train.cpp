// mlp_train: trains an MLP data-parallel with shardflow and prints one line per step.
//
//   mlp_train --sizes 784,256,256,10 --steps 300 --global-batch 64 --world-size 2
//             --optimizer adamw --lr 1e-3 [--init in.safetensors] [--data d.safetensors]
//             [--save out.safetensors] [--seed S]
//
// Started plainly, its ranks are threads over the in-process backend. Started by `shardflow run`
// (or torchrun, srun, mpirun) every process is one rank: --backend shm|gloo|auto.
#include <CLI/CLI.hpp>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sys/wait.h>
#include <iostream>
#include <set>

#include "examples/bucket_flags.hpp"
#include "examples/snapshot_flags.hpp"
#include "examples/mlp/model.hpp"
#include "examples/mlp/report.hpp"
#include "examples/mlp/train.hpp"
#include "kernels/cuda/device.hpp"
#include "kernels/cpu/linear.hpp"
#include "shardflow/launch.hpp"
#include "shardflow/sim.hpp"

int main(int argc, char** argv) {
  using namespace shardflow;
  CLI::App app{"Data-parallel MLP training on shardflow (ranks as threads, or one process per rank under `shardflow run`)"};
  mlp::TrainOptions opt;
  std::string sizes = "784,256,256,10", optimizer = "sgd", init, data, save;
  double timeout_s = 600;
  ::examples::BucketFlags bucket_flags;
  ::examples::SnapshotFlags snapshot_flags;
  app.add_option("--sizes", sizes, "layer widths, input first (comma separated)")->capture_default_str();
  app.add_option("--steps", opt.steps, "optimizer steps")->capture_default_str();
  app.add_option("--global-batch", opt.global_batch, "rows per step over all ranks")->capture_default_str();
  app.add_option("--world-size", opt.world_size, "data-parallel ranks")->capture_default_str();
  app.add_option("--optimizer", optimizer, "sgd | adam | adamw")->capture_default_str();
  app.add_option("--lr", opt.optimizer.lr, "learning rate")->capture_default_str();
  app.add_option("--momentum", opt.optimizer.momentum, "SGD momentum")->capture_default_str();
  app.add_flag("--nesterov", opt.optimizer.nesterov, "SGD Nesterov momentum");
  app.add_option("--dampening", opt.optimizer.dampening, "SGD dampening")->capture_default_str();
  app.add_option("--weight-decay", opt.optimizer.weight_decay, "weight decay (default: torch's, 0.01 for adamw, else 0)");
  app.add_option("--beta1", opt.optimizer.beta1, "Adam beta1")->capture_default_str();
  app.add_option("--beta2", opt.optimizer.beta2, "Adam beta2")->capture_default_str();
  app.add_option("--eps", opt.optimizer.eps, "Adam eps")->capture_default_str();
  app.add_option("--init", init, "initial parameters (safetensors, nn.Linear names)");
  app.add_option("--data", data,
                 "training data: safetensors with x [rows, in] and y [rows, out], and optionally held-out x_test / y_test "
                 "(the demo's digits: build/data/digits.safetensors)");
  std::string loss = "mse";
  app.add_option("--loss", loss, "mse (regression) | cross-entropy (softmax over the last layer; y one-hot)")->capture_default_str();
  app.add_option("--save", save, "write the final parameters (safetensors)");
  std::string checkpoint_dir, resume_dir;
  int every = 0;
  app.add_option("--save-checkpoint", checkpoint_dir,
                 "write DIR/checkpoint.safetensors (parameters, optimizer state, step count) at the end and --every K steps");
  app.add_option("--every", every, "with --save-checkpoint: also every K steps (0: at the end only)")->capture_default_str();
  double max_file_mb = 0;
  app.add_option("--checkpoint-max-file-mb", max_file_mb,
                 "with --save-checkpoint: split the file past this many MB (10^6 bytes) of tensors, beside "
                 "DIR/checkpoint.safetensors.index.json (0: one file)")
      ->capture_default_str();
  app.add_flag("--sharded-checkpoint", opt.sharded_checkpoint,
               "with --save-checkpoint: each rank writes its own shard file in DIR and rank 0 DIR/index.json (nothing gathered)");
  app.add_option("--resume", resume_dir,
                 "start from DIR (its index.json if sharded, else DIR/checkpoint.safetensors) at any --world-size / --zero-stage / "
                 "--partition; --steps counts the steps still to run");
  snapshot_flags.add(app, opt.runtime.snapshot);
  app.add_option("--seed", opt.seed, "seed of the init and synthetic data")->capture_default_str();
  bucket_flags.add(app);
  app.add_option("--freeze", opt.freeze, "register these parameters frozen (requires_grad false: never reduced or stepped), e.g. layers.0.weight,layers.0.bias")
      ->delimiter(',');
  app.add_flag("--shard-data", opt.shard_data,
               "one epoch, each rank its own contiguous shard of the rows; uneven shards: ranks out of batches join (PyTorch's Join)");
  app.add_option("--comm-hook", opt.comm_hook, "how buckets are reduced (PyTorch's DDP comm hooks): allreduce, fp16, bf16, powersgd")
      ->check(CLI::IsMember({"allreduce", "fp16", "bf16", "powersgd"}));
  app.add_option("--powersgd-rank", opt.powersgd.rank, "PowerSGD: the rank of the approximation")->capture_default_str();
  app.add_option("--powersgd-start-iter", opt.powersgd.start_iter, "PowerSGD: plain all-reduce for this many iterations first")
      ->capture_default_str();
  app.add_flag("--find-unused-parameters", opt.runtime.buckets.find_unused_parameters, "reduce parameters without a gradient as zeros");
  app.add_flag("!--no-rebuild", opt.runtime.buckets.rebuild, "keep the registration-order buckets (no rebuild after the first iteration)");
  app.add_flag("--static-graph", opt.runtime.buckets.static_graph,
               "PyTorch's static_graph: the same parameters every iteration, unused ones learnt once; a gradient may be reported several times");
  app.add_option("--timeout", timeout_s, "seconds any wait on another rank may take")->capture_default_str();
  int zero_stage = 0;
  std::string overlap = "none", partition = "flat";
  app.add_option("--zero-stage", zero_stage, "0 (DDP), 1 (sharded optimizer state), 2 (+ reduce-scattered gradients)")->capture_default_str();
  app.add_option("--overlap", overlap, "none | after_backward | interleaved")->capture_default_str();
  app.add_option("--partition", partition, "param | bucket | flat")->capture_default_str();
  bool allreduce_grads = false;
  app.add_flag("--no-reduce-scatter", allreduce_grads,
               "ZeRO-1: all-reduce the gradients (every rank's buckets hold the whole average) instead of reduce-scattering "
               "each rank's slice (1.5x the bytes)");
  app.add_option("--interleave-lag", opt.runtime.zero.interleave_lag,
                 "interleaved: bucket b's sync goes after the reduction of bucket b+lag (0: as soon as stepped; 1: keeps the link "
                 "busy when it is the bottleneck; -1: chosen after the first iteration)")->capture_default_str();
  app.add_option("--clip-grad-norm", opt.runtime.zero.clip_grad_norm, "clip the global gradient 2-norm to this (0: off)")->capture_default_str();
  app.add_option("--accumulate", opt.accumulate, "micro-batches of --global-batch rows per optimizer step")->capture_default_str();
  app.add_flag("--forward-prefetch", opt.runtime.zero.forward_prefetch, "parameter syncs overlap the next forward (waited for per layer)");
  app.add_option("--prefetch-syncs-in-backward", opt.runtime.zero.prefetch_syncs_in_backward,
                 "forward prefetch: how many buckets' syncs go out during backward, the rest after it (-1: chosen from iteration 2)")
      ->capture_default_str();
  app.add_option("--max-buckets-in-flight", opt.runtime.zero.max_buckets_in_flight,
                 "ZeRO-2: gradient buffers held at once (0: as many as the memory budget holds)")->capture_default_str();
  app.add_option("--fuse-syncs-bytes", opt.runtime.zero.fuse_syncs_bytes,
                 "ZeRO 1-2, flat: consecutive parameter syncs go out as one all-gather up to this many bytes (0: each alone)")
      ->capture_default_str();
  snapshot_flags.add_twins(app, opt.runtime.zero.redundancy, opt.runtime.zero.twin_distance);
  std::string param_dtype = "fp32", comm_dtype = "fp32";
  app.add_option("--comm-dtype", comm_dtype, "fp32 | bf16 | fp16: what fp32 gradients and parameter syncs travel as")->capture_default_str();
  app.add_option("--param-dtype", param_dtype, "fp32 | bf16 | fp16 (16-bit: fp32 masters and optimizer state in the shard)")->capture_default_str();
  app.add_option("--trace", opt.runtime.trace.path,
                 "write a Chrome trace (ui.perfetto.dev) of every rank's gradients, collectives and waits; {rank} in the "
                 "path: one file per rank (needed under a launcher)");
  std::string device = "cpu";
  app.add_option("--device", device,
                 "cpu | cuda | cuda:N: where the model, its gradients and the buckets live (cuda: cuBLAS, ranks as threads "
                 "on one GPU, or one process per GPU over nccl under a launcher)")->capture_default_str();
  std::string backend = "auto";
  app.add_option("--backend", backend,
                 "auto | in-process | sim | shm | gloo | nccl | hierarchical (auto: in-process threads when started plainly; under a "
                 "launcher shm on one host, hierarchical (shm inside a host, gloo between hosts) on several hosts of several ranks, "
                 "else gloo; sim: a simulated link over the in-process backend, or over auto under a launcher)")
      ->capture_default_str();
  SimLink sim;
  app.add_option("--sim-latency-us", sim.latency_us, "sim link: alpha, microseconds per message step")->capture_default_str();
  app.add_option("--sim-gbytes-per-s", sim.gbytes_per_s, "sim link: beta, GB/s (10^9 bytes per second)")->capture_default_str();
  app.add_option("--sim-world", sim.sim_world, "sim link: charge the time of an N-rank ring (0: the real world size)")
      ->capture_default_str();
  bool quiet = false, plot = false;
  app.add_flag("--quiet", quiet, "only the summary");
  int log_every = 0;
  app.add_option("--log-every", log_every, "print the progress line every N steps (0: about 20 lines per run; on a terminal it is redrawn each step)");
  std::string stats_json;
  app.add_option("--stats-json", stats_json,
                 "write rank 0's runtime figures (Runtime::stats(): per step and the median after the first five) as JSON");
  app.add_flag("--plot", plot, "with --trace: draw the trace as a PNG Gantt chart beside it (tools/trace_plot.py, python3-matplotlib)");
  CLI11_PARSE(app, argc, argv);
  if (opt.shard_data) opt.runtime.join.uneven_inputs = true;  // uneven shards: ranks out of batches join

  try {
    mlp::parse_model_flags(opt, sizes, loss, optimizer, zero_stage);
    opt.param_dtype = parse_dtype(param_dtype);
    opt.runtime.precision.comm_dtype = parse_dtype(comm_dtype);
    opt.runtime.zero.overlap = parse_overlap(overlap);
    opt.runtime.zero.partition = parse_partition(partition);
    opt.runtime.zero.reduce_scatter = !allreduce_grads;
    // Errors about these settings name the flags this program's users typed.
    opt.runtime.setting_names = {{"zero.stage", "--zero-stage"},
                                 {"zero.overlap", "--overlap"},
                                 {"zero.partition", "--partition"},
                                 {"zero.reduce_scatter", "--no-reduce-scatter"},
                                 {"zero.forward_prefetch", "--forward-prefetch"},
                                 {"zero.prefetch_syncs_in_backward", "--prefetch-syncs-in-backward"},
                                 {"zero.interleave_lag", "--interleave-lag"},
                                 {"zero.max_buckets_in_flight", "--max-buckets-in-flight"},
                                 {"zero.fuse_syncs_bytes", "--fuse-syncs-bytes"},
                                 {"zero.clip_grad_norm", "--clip-grad-norm"},
                                 {"precision.comm_dtype", "--comm-dtype"},
                                 {"buckets.first_cap_bytes", "--first-bucket-mb"}, {"buckets.last_cap_bytes", "--last-bucket-mb"},
                                 {"buckets.cap_bytes", "--bucket-mb"},
                                 {"buckets.min_buckets", "--min-buckets"},
                                 {"timeouts.collective", "--timeout"}};
    snapshot_flags.apply(opt.runtime);
    if (!init.empty()) opt.init_path = init;
    if (!data.empty()) opt.data_path = data;
    if (!save.empty()) opt.save_path = save;
    if (!checkpoint_dir.empty()) opt.checkpoint_dir = checkpoint_dir;
    if (!resume_dir.empty()) opt.resume_dir = resume_dir;
    opt.checkpoint_every = every;
    if (max_file_mb < 0) throw UsageError("--checkpoint-max-file-mb must be >= 0, got " + std::to_string(max_file_mb));
    opt.checkpoint_max_file_bytes = std::uint64_t(max_file_mb * 1e6);
    bucket_flags.apply(opt.runtime.buckets);
    if (timeout_s <= 0) throw UsageError("--timeout must be positive");
    opt.runtime.timeouts.collective = std::chrono::milliseconds(std::int64_t(timeout_s * 1000));

    if (device == "cpu") {
      opt.device = Device::cpu();
    } else if (device == "cuda" || device.rfind("cuda:", 0) == 0) {
      int idx = 0;
      if (device.size() > 5) {
        try {
          std::size_t used = 0;
          idx = std::stoi(device.substr(5), &used);
          if (used != device.size() - 5 || idx < 0) throw std::invalid_argument(device);
        } catch (const std::exception&) {
          throw UsageError("--device '" + device + "': expected cpu, cuda or cuda:N");
        }
      }
      opt.device = Device::cuda(idx);
    } else {
      throw UsageError("--device '" + device + "': expected cpu, cuda or cuda:N");
    }
    if (plot && opt.runtime.trace.path.empty()) throw UsageError("--plot draws the trace: add --trace FILE");
    if (log_every < 0) throw UsageError("--log-every must be >= 0");
    if (!stats_json.empty()) {  // fail before training, not after it
      std::FILE* f = std::fopen(stats_json.c_str(), "a");
      if (!f) throw UsageError("--stats-json '" + stats_json + "': cannot write: " + std::strerror(errno));
      std::fclose(f);
    }
    static const std::set<std::string> backends{"auto", "in-process", "sim", "shm", "gloo", "nccl", "hierarchical"};
    if (!backends.count(backend))
      throw UsageError("--backend '" + backend + "': expected auto, in-process, sim, shm, gloo, nccl or hierarchical");
    // An explicit --weight-decay is the user's number (-1 is only the default's marker).
    if (app.count("--weight-decay") && opt.optimizer.weight_decay < 0)
      throw UsageError("--weight-decay must be >= 0, got " + std::to_string(opt.optimizer.weight_decay));
    const bool simulated = backend == "sim";
    if (!simulated && (app.count("--sim-latency-us") || app.count("--sim-gbytes-per-s") || app.count("--sim-world")))
      throw UsageError("--sim-latency-us, --sim-gbytes-per-s and --sim-world describe the simulated link: add --backend sim");
    const LaunchEnv env = LaunchEnv::detect();
    std::shared_ptr<Communicator> comm;
    if (env.launched()) {
      mlp::adopt_launch(env, opt, app.count("--world-size") > 0, backend);
      // One GPU per process: NCCL, on cuda:LOCAL_RANK (the launcher's local rank picks the GPU).
      if (opt.device.kind == Device::Kind::cuda) {
        if (backend != "auto" && backend != "nccl")
          throw UsageError("--device cuda under a launcher reduces over nccl; --backend " + backend + " moves CPU memory");
        backend = "nccl";
        opt.device = Device::cuda(env.local_rank % std::max(1, cuda::device_count()));  // as init_process_group picks
      }
      const ProcessGroupOptions group{simulated ? "auto" : backend, opt.runtime.timeouts.collective};
      comm = init_process_group(env, group);
      if (simulated) comm = simulate_link(std::move(comm), sim);
      // Note [Recovering in place]: a lost peer is healed in this process.
      if (env.recover_in_place)
        opt.rejoin = [env, group, simulated, sim] {
          auto next = rejoin_process_group(env, group);
          return simulated ? simulate_link(std::move(next), sim) : next;
        };
      if (env.rank != 0) quiet = true;  // rank 0 reports for the job
    } else if (simulated) {
      sim.validate(opt.world_size);
      opt.sim = sim;  // ranks as threads, each behind its link
    } else {
      mlp::check_unlaunched_backend("mlp_train", backend);  // nccl too: it needs one process per GPU
    }
    const bool report = !env.launched() || env.rank == 0;

    const int every = log_every > 0 ? log_every : std::max(1, opt.steps / 20);
    // The global loss only when it is printed (and all of them at the end): in between, forward
    // prefetch's syncs run on past wait() without the trainer's own all-reduce waiting for them.
    opt.loss_every = every;
    opt.on_step = mlp::step_printer(opt, quiet, every);
    const std::string where = std::string(comm ? comm->backend_name() : simulated ? "in-process threads, sim link" : "in-process threads") +
                              (opt.device.kind == Device::Kind::cuda ? " on " + opt.device.str() : "");
    if (report) mlp::print_header("mlp_train", sizes, opt, where, optimizer, overlap, partition);
    auto res = comm ? mlp::train_rank(opt, comm) : mlp::train(opt);
    if (!res.data_split.empty()) std::printf("data: %s\n", res.data_split.c_str());
    // The rank 0 at the end reports it (recovering in place by shrinking renumbers the survivors).
    if (env.launched() ? res.rank_at_end != 0 : !report) return 0;
    mlp::print_summary(res, opt, comm ? res.rank_at_end : -1, quiet);
    if (!stats_json.empty()) mlp::write_stats_json(res, stats_json);
    if (plot) {
      // Rank 0's file: the one every rank shares, or its own under a launcher.
      const std::string trace = trace_file_for(opt.runtime.trace.path, 0, env.launched() && env.world_size > 1);
      const std::string& given = opt.runtime.trace.path;
      const auto dot = given.rfind('.');
      const bool has_ext = dot != std::string::npos && given.find('/', dot) == std::string::npos;
      const std::string png = (has_ext ? given.substr(0, dot) : given) + ".png";
      // Debian's python3 (python3-matplotlib) rather than whatever python3 comes first on the PATH.
      const std::string python = ::access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3" : "python3";
      const std::string cmd = python + " '" SHARDFLOW_TOOLS_DIR "/trace_plot.py' '" + trace + "' -o '" + png + "'";
      std::fflush(stdout);
      const int rc = std::system(cmd.c_str());
      if (rc != 0) throw Error("--plot: tools/trace_plot.py failed (exit " + std::to_string(WEXITSTATUS(rc)) + "); see its message above");
      std::printf("plot %s\n", png.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mlp_train: error: %s\n", e.what());
    std::fflush(stderr);
    return 1;
  }
  return 0;
}
