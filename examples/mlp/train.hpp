// Data-parallel training of the example MLP with shardflow: N ranks, each with its own replica,
// its slice of every global batch and its own shardflow::Runtime — as threads of this process
// (train) or as one rank per process (train_rank). mlp_train, the tests and bench_ddp drive this.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "examples/mlp/model.hpp"
#include "shardflow/optimizer.hpp"
#include "shardflow/safetensors.hpp"
#include "shardflow/shardflow.hpp"
#include "shardflow/sim.hpp"

namespace shardflow::mlp {

struct Dataset {
  int in = 0, out = 0;
  std::size_t rows = 0;
  std::vector<float> x, y;  // [rows, in], [rows, out]
  // Held-out rows, never trained on (the file's x_test / y_test, when it has them).
  std::size_t test_rows = 0;
  std::vector<float> x_test, y_test;

  // Regression targets from a fixed random teacher network, so the loss has somewhere to go.
  static Dataset synthetic(int in, int out, std::size_t rows, std::uint64_t seed);
  // `x` [rows, in] and `y` [rows, out], and optionally the held-out `x_test` / `y_test` (both or
  // neither), float32; Error naming the file and tensor otherwise.
  static Dataset load(const std::string& path, int in, int out);
};

struct StepReport {
  int step = 0;
  float loss = 0;        // mean over the global batch (all ranks)
  double step_ms = 0;    // wall time of the step on rank 0
  IterationStats stats;  // rank 0's runtime figures for the step's synchronised iteration
};

struct TrainOptions {
  std::vector<int> sizes{784, 256, 256, 10};
  Loss loss = Loss::mse;  // cross_entropy: y holds one-hot labels
  int steps = 100;
  int global_batch = 64;
  int world_size = 1;
  OptimizerConfig optimizer;
  std::uint64_t seed = 0;
  std::optional<std::string> init_path, data_path, save_path;
  std::size_t data_rows = 0;  // synthetic data rows (0: max(16 * batch, 4096))
  Config runtime;             // bucket caps, find_unused, timeout, zero_stage, overlap, clipping...
  // The optimizer runs inside shardflow (stage / overlap / partition from `runtime`). Off: the
  // trainer steps every parameter itself after wait() (plain DDP).
  bool optimizer_in_runtime = true;
  int accumulate = 1;         // micro-batches (of global_batch rows) per optimizer step
  // Parameters and gradients as the runtime sees them. 16-bit: the runtime keeps fp32 masters in
  // the shard; the trainer computes in fp32 copies of the 16-bit parameters.
  DType param_dtype = DType::f32;
  bool report_loss = true;    // the global loss: an extra all-reduce
  // ... every this many steps (and the last); the others are all-reduced together at the end, so
  // TrainResult::losses is the same. Between, forward prefetch's syncs are not waited for (our
  // collective must not race them). on_step sees the last global loss.
  int loss_every = 1;
  // cuda: the model runs with cuBLAS on this GPU (DeviceModel), the buckets live there, the ranks
  // are threads over the in-process backend on that one GPU (train) or processes over NCCL
  // (train_rank); the runtime's optimizer steps its shard on the device (every ZeRO stage,
  // clipping, prefetch), or the trainer steps every parameter there after wait() when
  // optimizer_in_runtime is off. fp32 parameters.
  Device device = Device::cpu();
  // Ranks as threads behind a simulated link (Note [Simulated link]): the in-process backend moves
  // the data, completions wait for the modelled link. CPU only.
  std::optional<SimLink> sim;
  std::function<void(const StepReport&)> on_step;  // called on rank 0's thread
  // Checkpoints (Runtime::save_checkpoint): DIR/checkpoint.safetensors every this many steps
  // (counted from the start of the training, resumed runs included; 0: at the end only).
  std::optional<std::string> checkpoint_dir;
  int checkpoint_every = 0;
  // Sharded instead (Runtime::save_sharded_checkpoint): each rank writes its own file in DIR,
  // rank 0 DIR/index.json.
  bool sharded_checkpoint = false;
  // Consolidated files past this many bytes of tensors split into several beside
  // DIR/checkpoint.safetensors.index.json (0: one file).
  std::uint64_t checkpoint_max_file_bytes = 0;
  // Resume from DIR (DIR/index.json if sharded, DIR/checkpoint.safetensors.index.json if split,
  // else DIR/checkpoint.safetensors): parameters,
  // optimizer state and the data position; `steps` counts the steps still to run. Any world
  // size, stage and partition.
  std::optional<std::string> resume_dir;
  // Under `shardflow run --recovery in-place` (train_rank only): the communicator of the job's next
  // round (rejoin_process_group). Set, a lost peer does not end this rank: it recovers in place
  // (Runtime::recover) and goes on from the newest snapshot (Note [Recovering in place]).
  std::function<std::shared_ptr<Communicator>()> rejoin;
  // Parameters registered frozen (ParamSpec::requires_grad false): never reduced or stepped; their
  // gradients are computed and dropped (CPU only).
  std::vector<std::string> freeze;
  // One epoch over the data with each rank its own contiguous shard of the rows (the first
  // rows % world ranks one row more), in local batches of global_batch / world_size (a shard's
  // last partial batch dropped): shards that do not split evenly give ranks different numbers of
  // batches, and a rank out of them joins (Runtime::join; needs runtime.join.uneven_inputs).
  // --steps caps the epoch. Losses are then rank 0's own.
  bool shard_data = false;
  // Runtime::register_comm_hook: "allreduce", "fp16", "bf16", "powersgd" (empty: none).
  std::string comm_hook;
  PowerSGDOptions powersgd;
};

std::string checkpoint_file(const std::string& dir);  // DIR/checkpoint.safetensors

// Checks the options and loads (or makes) the data and the initial parameters: before any rank
// starts, so that bad input fails with one message instead of N.
struct Prepared {
  std::optional<TensorMap> init;
  Dataset data;
  std::string data_split;  // shard_data
};
Prepared prepare(const TrainOptions& opt);

// The all-reduce of `n` per-step losses into their global means (equal shards: the mean of the
// ranks' means), as both MLP trainers issue it (tag "loss"); the buffer must outlive it.
CollectiveOp loss_allreduce(float* losses, std::size_t n, int world_size);

// Rank r's rows of global batch `step` (B rows over N ranks): rows step*B ... step*B+B-1 modulo
// the data size, of which rank r takes the r-th contiguous B/N; from row `at` when given.
void local_batch(const Dataset& d, int step, int B, int N, int r, std::vector<float>& x, std::vector<float>& y,
                 std::optional<std::size_t> at = std::nullopt);

struct TrainResult {
  int rank_at_end = 0;          // train_rank: this process's rank at the end (recovering in place may renumber it)
  TensorMap params;             // final, full parameters (rank 0's; all ranks agree)
  std::vector<float> losses;    // per step (empty without report_loss)
  std::vector<double> step_ms;  // per step, rank 0
  std::vector<BucketInfo> buckets;
  std::vector<MemoryReport> memory;      // per rank, at start-up
  std::vector<MemoryReport> memory_end;  // per rank, after training (pooled buffers at their peak)
  std::vector<float> grad_norms;     // per step (with clipping)
  std::vector<std::string> collectives;  // rank 0's issued collectives
  RuntimeStats stats;                    // rank 0's Runtime::stats() at the end
  std::string data_split;                // with shard_data: how the rows were split over the ranks
  // Top-1 accuracy of the final parameters on the data's held-out rows (rank 0; none without them).
  std::optional<double> heldout_accuracy;
  std::size_t heldout_rows = 0;
};

// Ranks as threads of this process over the in-process backend. Throws UsageError for bad options
// (batch not divisible by world, ...) before any thread starts; a failure on any rank is rethrown.
TrainResult train(const TrainOptions& opt);

// This process is rank comm->rank() of a multi-process job (shardflow run, srun, mpirun): one
// replica, this rank's slice of every batch. opt.world_size must equal the communicator's. The
// result's params, buckets and losses are filled on rank 0; memory reports hold this rank's only.
// On failure the communicator is aborted (peers fail at once) and the error rethrown.
TrainResult train_rank(const TrainOptions& opt, const std::shared_ptr<Communicator>& comm);

}  // namespace shardflow::mlp
