// The MLP trained by actors (examples/actor_trainer/): a data loader, one actor per layer, a loss
// actor and a rank trainer per rank, each rank driven through its rank actor (shardflow/actor.hpp)
// on the runtime's own actor system. Ranks as actors of this process, or one process per rank under
// `shardflow run`. Prints what mlp_train prints; same data, model and arithmetic, same result.
//
//   build/examples/actor_trainer --data build/data/digits.safetensors --sizes 64,128,10 --loss cross-entropy \
//       --optimizer adamw --lr 0.003 --world-size 2 --zero-stage 2 --overlap interleaved --steps 300
#include <CLI/CLI.hpp>

#include <cstdio>
#include <fstream>

#include "examples/actor_trainer/train.hpp"
#include "examples/bucket_flags.hpp"
#include "examples/snapshot_flags.hpp"
#include "examples/mlp/report.hpp"

int main(int argc, char** argv) {
  using namespace shardflow;
  CLI::App app{"Data-parallel MLP training by actors on shardflow's rank actors (ranks as actors, or one process per rank under "
               "`shardflow run`)"};
  mlp::TrainOptions opt;
  std::string sizes = "784,256,256,10", optimizer = "sgd", init, data, save, loss = "mse", overlap = "none", partition = "flat";
  std::string backend = "auto", stats_json;
  double timeout_s = 600;
  ::examples::BucketFlags bucket_flags;
  ::examples::SnapshotFlags snapshot_flags;
  int zero_stage = 0, log_every = 0;
  bool quiet = false;
  app.add_option("--sizes", sizes, "layer widths, input first (comma separated)")->capture_default_str();
  app.add_option("--steps", opt.steps, "optimizer steps")->capture_default_str();
  app.add_option("--global-batch", opt.global_batch, "rows per step over all ranks")->capture_default_str();
  app.add_option("--world-size", opt.world_size, "data-parallel ranks (actors of this process; under a launcher, its ranks)")
      ->capture_default_str();
  app.add_option("--optimizer", optimizer, "sgd | adam | adamw")->capture_default_str();
  app.add_option("--lr", opt.optimizer.lr, "learning rate")->capture_default_str();
  app.add_option("--momentum", opt.optimizer.momentum, "SGD momentum")->capture_default_str();
  app.add_option("--weight-decay", opt.optimizer.weight_decay, "weight decay (default: torch's, 0.01 for adamw, else 0)");
  app.add_option("--init", init, "initial parameters (safetensors, nn.Linear names)");
  app.add_option("--data", data, "safetensors with x, y and optionally x_test, y_test (build/data/digits.safetensors)");
  app.add_option("--loss", loss, "mse | cross-entropy")->capture_default_str();
  app.add_option("--save", save, "write the final parameters (safetensors)");
  app.add_option("--seed", opt.seed, "seed of the init and synthetic data")->capture_default_str();
  bucket_flags.add(app);
  snapshot_flags.add(app, opt.runtime.snapshot);
  app.add_option("--timeout", timeout_s, "seconds any wait on another rank may take")->capture_default_str();
  app.add_option("--zero-stage", zero_stage, "0 (DDP), 1, 2")->capture_default_str();
  app.add_option("--overlap", overlap, "none | after_backward | interleaved")->capture_default_str();
  app.add_option("--partition", partition, "param | bucket | flat")->capture_default_str();
  app.add_flag("--forward-prefetch", opt.runtime.zero.forward_prefetch, "parameter syncs overlap the next forward (each layer actor asks for its update)");
  app.add_option("--clip-grad-norm", opt.runtime.zero.clip_grad_norm, "clip the global gradient 2-norm to this (0: off)")->capture_default_str();
  app.add_option("--actor-threads", opt.runtime.actor_threads, "CAF scheduler threads (0: min(2, cores)); 1 is enough")->capture_default_str();
  app.add_option("--backend", backend,
                 "under a launcher: auto (shm on one host, two levels on several hosts of several ranks, else gloo) | shm | "
                 "gloo | hierarchical")
      ->capture_default_str();
  app.add_option("--trace", opt.runtime.trace.path, "Chrome trace of every rank ({rank}: one file per rank)");
  app.add_flag("--quiet", quiet, "only the summary");
  app.add_option("--log-every", log_every, "print the progress line every N steps (0: about 20 lines per run)");
  app.add_option("--stats-json", stats_json, "write rank 0's Runtime::stats() as JSON");
  CLI11_PARSE(app, argc, argv);
  try {
    mlp::parse_model_flags(opt, sizes, loss, optimizer, zero_stage);
    opt.runtime.zero.overlap = parse_overlap(overlap);
    opt.runtime.zero.partition = parse_partition(partition);
    if (!init.empty()) opt.init_path = init;
    if (!data.empty()) opt.data_path = data;
    if (!save.empty()) opt.save_path = save;
    bucket_flags.apply(opt.runtime.buckets);
    snapshot_flags.apply(opt.runtime);
    if (timeout_s <= 0) throw UsageError("--timeout must be positive");
    opt.runtime.timeouts.collective = std::chrono::milliseconds(std::int64_t(timeout_s * 1000));
    if (log_every < 0) throw UsageError("--log-every must be >= 0");
    const LaunchEnv env = LaunchEnv::detect();
    std::shared_ptr<Communicator> comm;
    if (env.launched()) {
      mlp::adopt_launch(env, opt, app.count("--world-size") > 0, backend);
      const ProcessGroupOptions group{backend, opt.runtime.timeouts.collective};
      comm = init_process_group(env, group);
      // A lost peer is healed in this process: the rank trainer asks its rank actor to recover
      // onto the job's next round (Note [The actor trainer heals in place]).
      if (env.recover_in_place) opt.rejoin = [env, group] { return rejoin_process_group(env, group); };
      if (env.rank != 0) quiet = true;  // rank 0 reports for the job
    } else {
      mlp::check_unlaunched_backend("actor_trainer", backend);
    }
    const bool report = !env.launched() || env.rank == 0;
    const int every = log_every > 0 ? log_every : std::max(1, opt.steps / 20);
    opt.loss_every = every;
    opt.on_step = mlp::step_printer(opt, quiet, every);
    if (report)
      mlp::print_header("actor_trainer", sizes, opt, comm ? std::string(comm->backend_name()) + ", rank actors" : "in-process rank actors",
                        optimizer, overlap, partition);
    auto res = comm ? actor_trainer::train_rank(opt, comm) : actor_trainer::train(opt);
    // The rank 0 at the end reports it (recovering in place by shrinking renumbers the survivors).
    if (env.launched() ? res.rank_at_end != 0 : !report) return 0;
    mlp::print_summary(res, opt, comm ? res.rank_at_end : -1, quiet);
    if (!stats_json.empty()) mlp::write_stats_json(res, stats_json);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "actor_trainer: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
