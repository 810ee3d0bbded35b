// shardflow: data-parallel gradient reduction for C++ trainers. This is the one header a trainer
// includes.
//
//   auto world = shardflow::InProcessWorld::create(2);            // or another backend
//   shardflow::Runtime rt(world->communicator(rank), cfg);
//   auto w = rt.register_param({"layers.0.weight", {256, 784}, DType::f32, Device::cpu(), w_ptr});
//   ...                                                             // all parameters, forward order
//   for each step:
//     rt.zero_grad();
//     forward; backward writing each gradient where rt.grad(p) points, then rt.grad_ready(p)
//     rt.finish_backward();   // every gradient of this backward has been reported
//     rt.wait();              // gradients are now averaged over all ranks
//     optimizer step
//
// Reductions start while backward is still running: a bucket's all-reduce is issued as soon as
// its gradients and those of every earlier bucket are ready, in the same order on every rank.
#pragma once

#include <array>
#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "shardflow/comm_hook.hpp"
#include "shardflow/communicator.hpp"
#include "shardflow/config.hpp"
#include "shardflow/errors.hpp"
#include "shardflow/optimizer.hpp"
#include "shardflow/safetensors.hpp"
#include "shardflow/sim.hpp"
#include "shardflow/types.hpp"

namespace shardflow {

// A registered parameter. Cheap to copy; only valid with the Runtime that returned it.
struct Param {
  std::uint32_t index = ~0u;
  std::uint32_t owner = 0;
};

struct BucketInfo {
  std::uint32_t index = 0;
  DType dtype = DType::f32;
  Device device;
  std::size_t bytes = 0;
  std::vector<std::string> params;  // in the order they sit in the flat buffer
};

// A piece of a parameter this rank owns (keeps optimizer state for and steps): elements
// [begin, end) of its flat storage; the whole parameter when begin is 0 and end its numel.
struct OwnedPiece {
  std::string param;
  std::size_t begin = 0, end = 0;
  bool operator==(const OwnedPiece&) const = default;
};

// Raw buffers, the way llm.c-style engines keep a model (Note [Flat buffers]): one flat parameter
// buffer, optionally one flat gradient buffer of the same layout, and a table of where each
// parameter sits in them (offsets and shapes in elements).
struct FlatEntry {
  std::string name;
  Shape shape;
  std::size_t offset = 0;
};
struct FlatBuffers {
  void* params = nullptr;
  // The engine's gradient buffer (Config::buckets.gradient_as_bucket_view off: shardflow copies
  // into and out of its buckets), or null (view on: gradients live in the buckets, Runtime::grad).
  void* grads = nullptr;
  std::size_t numel = 0;  // elements in each buffer
  DType dtype = DType::f32;
  Device device = Device::cpu();
  std::vector<FlatEntry> table;  // in forward order
};

// Parameters that share optimizer hyper-parameters (lr, weight decay, betas...). Every group uses
// the same optimizer kind.
struct ParamGroup {
  std::vector<Param> params;
  OptimizerConfig optimizer;
};

// Bytes this rank holds, by purpose.
struct MemoryReport {
  std::size_t params = 0;           // the trainer's parameter storage
  std::size_t grads = 0;            // bucket buffers (+ reduced gradient shards in stage 2)
  std::size_t optimizer_state = 0;  // momentum / exp_avg / exp_avg_sq of the parameters this rank owns
  std::size_t comm_buffers = 0;     // buffers only communication needs (norm exchange)
  std::string str() const;
};

// What one synchronised iteration cost and how much of the communication hid behind compute
// (Runtime::stats()). An iteration runs from the end of one wait() to the end of the next.
struct IterationStats {
  std::uint64_t iteration = 0;
  double iteration_ms = 0;
  double compute_ms = 0;    // the trainer's own time: the iteration minus exposed_ms
  double link_ms = 0;       // time the rank's comm stream was busy with the runtime's collectives
  double hidden_ms = 0;     // link time while the trainer computed
  double exposed_ms = 0;    // time the trainer was held up by the runtime: wait(), wait_param(),
                            // backpressure in grad(): from the last grad_ready (or the end of
                            // forward, with prefetch) until it may go on
  double optimizer_ms = 0;  // the shard's steps (host time; on a GPU: enqueueing)
  std::size_t buckets = 0;
  std::size_t buckets_done_in_backward = 0;  // reduced, stepped and synced before backward ended
  std::array<std::uint64_t, 5> bytes{};      // bytes moved per CollectiveKind (allreduce, ...): the buffers
  // What this rank put on the link (wire_bytes in communicator.hpp: an all-reduce's buffer counts
  // 2 (N - 1) / N, a reduce-scatter's, all-gather's or broadcast's (N - 1) / N). ZeRO-1 and -2 with
  // the flat partition move what DDP moves.
  std::uint64_t wire_bytes = 0;
};
struct RuntimeStats {
  std::vector<IterationStats> steps;  // the most recent iterations (up to 10,000)
  IterationStats median;              // each field's median over the steps after the first five
  // {"median": {"iteration_ms": ..., "exposed_ms": ..., ...}, "steps": [...]}
  std::string to_json() const;
};

// Where rank `rank` writes the trace of Config::trace.path: "{rank}" replaced; without it, when
// each rank is a process of its own (under a launcher), <stem>.rank<r>.json beside the path; else
// the path itself (ranks that are threads share it).
std::string trace_file_for(const std::string& trace_path, int rank, bool one_process_per_rank);

// The training state in parameter coordinates, as a consolidated checkpoint file holds it:
// parameters under their names, optimizer state as optim.<name>.exp_avg / exp_avg_sq /
// momentum_buffer / master (fp32), and the step count, stage, partition and param groups in the
// metadata (Note [Checkpoints]).
struct StateDict {
  TensorMap tensors;
  std::map<std::string, std::string> metadata;
};

class Runtime {
 public:
  Runtime(std::shared_ptr<Communicator> comm, Config config = {});
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  int rank() const;
  int world_size() const;
  const Config& config() const;

  // Registers a parameter; call in forward order, before training starts. Names must be unique.
  Param register_param(ParamSpec spec);
  // Registers every parameter of a flat buffer (FlatBuffers; entries must not overlap and must fit
  // in it). Returns their handles in table order.
  std::vector<Param> register_flat(const FlatBuffers& flat);
  // Every parameter of the flat buffer lying in elements [offset, offset + count) has its gradient:
  // what an engine knows when a layer's backward is done. A range that cuts a parameter is a
  // UsageError naming it. Callable from any thread, like grad_ready.
  void grads_ready(std::size_t offset, std::size_t count);
  Param param(const std::string& name) const;  // UsageError if unknown
  std::size_t num_params() const;
  // Freezing and unfreezing (Note [Changing the trainable set]). Before finalize() it sets
  // ParamSpec::requires_grad; afterwards it takes effect at the next refresh_trainable(), a
  // collective between iterations that re-plans buckets and shards for the new set (every rank must
  // ask for the same one). The optimizer state of parameters that stay trainable survives; a frozen
  // one loses its state, and starts afresh when trained again.
  void set_requires_grad(Param p, bool requires_grad);
  void refresh_trainable();

  // Registers a buffer: state that forward updates and that gets no gradient but must be the same
  // on every rank (normalisation running statistics, counters). Like the parameters it is
  // broadcast from rank 0 at finalize() (Config::sync.initial); with Config::sync.buffers (on by
  // default, as DDP's broadcast_buffers) also once each synchronised iteration, after backward
  // and before wait() returns (Note [Rank 0's state everywhere]). Before training starts; buffers
  // and parameters share one namespace, and every rank registers the same buffers.
  void register_buffer(BufferSpec spec);

  // CUDA parameters: the stream backward runs on (a cudaStream_t; default null, the legacy default
  // stream). When a bucket's last gradient is reported, an event is recorded on it, and the
  // bucket's collective runs after that event on the device: the host never waits for backward.
  // Zeroing, and the copies into and out of buckets without Config::buckets.gradient_as_bucket_view, go on this
  // stream too. After wait() the reduced gradients can be used by work on this stream. All of a
  // Runtime's parameters live on one device. Change it between iterations only.
  void set_stream(void* cuda_stream);

  // Replaces how buckets are reduced (Note [Comm hooks]; PyTorch's register_comm_hook): allreduce,
  // fp16/bf16 compression, PowerSGD (comm_hook.hpp) or the trainer's own. Once, before finalize();
  // every rank registers the same kind. Host buckets; with ZeRO-2's reduce-scatter it is an error
  // (use Config::precision.comm_dtype for a 16-bit wire there), as is a hook beside a 16-bit
  // comm_dtype. Without the runtime's optimizer a 16-bit comm_dtype means the matching compress hook.
  void register_comm_hook(std::shared_ptr<CommHook> hook);

  // Ends registration: checks that every rank registered the same parameters and buffers (count,
  // names, shapes, dtypes; MismatchError naming the first difference), broadcasts rank 0's values
  // of both to every rank (Config::sync.initial, on by default as in DDP) and builds the buckets.
  // A collective: every rank calls it. zero_grad(), grad() and grad_ready() call it when needed.
  void finalize();

  // Where the gradient of `p` lives (inside its bucket with Config::buckets.gradient_as_bucket_view). May move
  // once, when the buckets are rebuilt at the end of the first iteration: ask again each step.
  // With the runtime's optimizer at ZeRO stage >= 1 a bucket carries the parameter sync once it
  // has been stepped, so gradients are not meaningful after wait() (zero_grad() clears them).
  void* grad(Param p);
  float* grad_f32(Param p);  // UsageError unless p is fp32

  void zero_grad();

  // Backward produced p's gradient. Callable from any thread. Throws UsageError for an unknown
  // handle or a parameter already reported in this backward pass.
  void grad_ready(Param p);
  void grad_ready(const std::string& name);

  // Every gradient of this backward pass has been reported. With Config::buckets.find_unused_parameters the
  // parameters that got none are reduced as zeros; without it they are a UsageError naming them.
  void finish_backward();

  // With Config::buckets.find_unused_parameters, after wait(): the parameters no rank reported a
  // gradient for in the last synchronised iteration. The runtime's optimizer did not step them
  // (as torch.optim skips a grad of None); a trainer's own optimizer should skip them too (Note
  // [Unused parameters]). A parameter unused on some ranks only is reduced as zeros there and
  // stepped as usual.
  std::vector<Param> unused_parameters() const;

  // Config::join.uneven_inputs (Note [Uneven inputs], PyTorch's Join): this rank is out of data.
  // Blocks, taking part in the other ranks' iterations with zero gradients (their averages count
  // only the ranks that contributed), until every rank has called join(). Every rank calls it
  // after its last iteration.
  void join();
  // With uneven inputs, how many ranks contributed to the last synchronised iteration.
  int training_ranks() const;

  // Blocks until this iteration's reductions completed (at most Config::timeouts.collective): afterwards the
  // gradients hold the average over all ranks. Calls finish_backward() if the trainer did not.
  void wait();

  // With Config::zero.forward_prefetch: blocks until p holds its update from the last iteration. Call it
  // in forward before p is used, for every parameter (wait() then returns without waiting for the
  // updates, so they overlap the next forward). Without prefetch it returns at once.
  void wait_param(Param p);
  // wait_param's check without the wait, for a trainer that must not block (an actor): true when
  // every one of `ps` holds its update, noting forward's use of each as wait_param does. Where it
  // says false, ask the rank actor (rank_api::params_ready) to be told when they land. Most
  // parameters are ready when forward reaches them, and this answers those with no message.
  bool params_ready(const std::vector<Param>& ps);
  // Every parameter's update landed. Needed before saving, at the end of training, and before a
  // collective of the trainer's own issued on the communicator directly (it would race the
  // runtime's syncs; Runtime::collective does not).
  void wait_all_params();
  // A collective of the trainer's own (a loss, a metric) on the runtime's communicator, queued on
  // its comm stream in the runtime's order: after every collective of the synchronised iterations
  // so far (the parameter syncs that forward prefetch leaves running past wait() included) and
  // before the next iteration's first, the same place on every rank. It neither races the
  // runtime's collectives nor holds the trainer up until they are done: get() the future when the
  // value is needed (at the next step, say; by then the next iteration's reductions are out, so it
  // is ready). Returns at once. Call it between wait() and the next backward, every rank the same
  // collectives in the same order; the op's buffers must stay valid until the future is ready.
  // get() rethrows a failure (TimeoutError, CommError; UsageError when called during backward).
  std::future<void> collective(CollectiveOp op);

  // Gradient accumulation: while set, backward passes accumulate locally and wait() returns at
  // once; the first backward after clearing it reduces the accumulated gradients.
  void set_require_sync(bool sync);
  class NoSync {
   public:
    explicit NoSync(Runtime& rt) : rt_(rt) { rt_.set_require_sync(false); }
    ~NoSync() { rt_.set_require_sync(true); }
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    Runtime& rt_;
  };
  NoSync no_sync() { return NoSync(*this); }  // auto guard = rt.no_sync();

  // Hands the optimizer step to shardflow: each rank steps the parameters it owns (all of them in
  // stage 0) as Config::zero.overlap says, and wait() returns once every parameter is updated on every
  // rank. Parameters in no group join group 0. Call before training starts (after registration).
  void configure_optimizer(std::vector<ParamGroup> groups);
  void configure_optimizer(const OptimizerConfig& all) { configure_optimizer({ParamGroup{{}, all}}); }
  // Between iterations (schedules; Note [Changing hyper-parameters]): the learning rate, or any
  // hyper-parameter of a group (the kind stays, and SGD momentum cannot appear where no group had
  // it). They apply from the next iteration on.
  void set_lr(std::size_t group, float lr);
  void set_hyperparameters(std::size_t group, const OptimizerConfig& h);
  OptimizerConfig hyperparameters(std::size_t group) const;
  // torch.optim's add_param_group, between iterations: parameters that no configure_optimizer
  // group named (they were in group 0 by default, or frozen) get the group's hyper-parameters
  // from the next iteration on; returns its index. Unlike torch, where such a parameter was in no
  // optimizer, a parameter trained in group 0 keeps the state it built there.
  std::size_t add_param_group(const ParamGroup& group);
  // The global gradient norm of the last synchronised iteration (computed only when clipping or
  // loss scaling; unscaled).
  float last_grad_norm() const;
  // Config::precision.dynamic_loss_scale (Note [Loss scaling]): what the trainer multiplies its
  // loss by this iteration (1 without it), and whether the last iteration's step was skipped for
  // an inf or a NaN in some rank's gradients (every rank skips the same steps).
  float loss_scale() const;
  bool last_step_skipped() const;
  MemoryReport memory_report() const;

  RuntimeStats stats() const;
  IterationStats last_stats() const;  // the last synchronised iteration's figures (cheap)

  // The trainer's own work on the timeline (Note [Timeline]): forward, backward, its own optimizer
  // step. cat is "forward", "backward" or "step"; the span lasts until the object goes. Call it on
  // the thread that runs the work; spans of one thread may nest but not partially overlap.
  //   { auto s = rt.span("forward", "forward"); model.forward(...); }
  class Span {
   public:
    Span(Span&& o) noexcept : rt_(o.rt_), name_(std::move(o.name_)), cat_(o.cat_), begin_(o.begin_) { o.rt_ = nullptr; }
    Span(const Span&) = delete;
    Span& operator=(const Span&) = delete;
    Span& operator=(Span&&) = delete;
    ~Span();

   private:
    friend class Runtime;
    Span(Runtime* rt, std::string name, const char* cat, std::int64_t begin)
        : rt_(rt), name_(std::move(name)), cat_(cat), begin_(begin) {}
    Runtime* rt_;
    std::string name_;
    const char* cat_;
    std::int64_t begin_;
  };
  Span span(std::string name, const char* cat);

  // Checkpoints (Note [Checkpoints], runtime/checkpoint/checkpoint.cpp). A collective: the parameters and the
  // optimizer state of every rank's shard go into one safetensors file in parameter coordinates
  // (parameters under their names, state as optim.<name>.exp_avg / exp_avg_sq / momentum_buffer /
  // master, the step count and the groups' hyper-parameters in the metadata). The state streams
  // to `recipient` in bounded windows; only it writes, atomically (temporary file, fsync, rename).
  // Past `max_file_bytes` of tensor data (0: no limit) the file is split, as large safetensors
  // checkpoints are: files of at most that much beside `path`.index.json, whose weight_map names
  // each tensor's file; load that index.
  void save_checkpoint(const std::string& path, int recipient = 0, std::uint64_t max_file_bytes = 0);
  // A collective: each rank writes the parameters and optimizer state of the pieces it owns to a
  // file of its own in `dir`, and rank 0 an index (dir/index.json: world size, stage, partition,
  // bucket plan, every slice and its file; each file carries its slices' CRC-32s). No rank
  // gathers anything (Note [Sharded checkpoints]). The index is written last: a crash mid-save
  // leaves the previous checkpoint in `dir` loadable.
  void save_sharded_checkpoint(const std::string& dir);
  // The same, blocking training only while each rank copies its slices to a staging buffer; the
  // files are written in the background. wait_checkpoint() (a collective, called by every rank
  // before the next save or when the trainer wants the checkpoint on disk) waits for them and
  // writes the index; until then the previous checkpoint in `dir` is the loadable one.
  void save_sharded_checkpoint_async(const std::string& dir);
  void wait_checkpoint();
  // With Config::snapshot.dir (Note [Snapshots]): restores the newest complete snapshot there, the
  // same one on every rank, and returns the synchronised iteration it was taken after (0: none
  // yet; a fresh start). A collective, called once before the first forward, after
  // configure_optimizer: the trainer's data position follows the step it returns. Without
  // snapshots: 0. Later calls return the same step.
  std::uint64_t resumed_step();
  // Loads a consolidated file, a state dict of parameters alone, or a sharded checkpoint (its
  // directory or index.json), at any world size, stage and partition: each rank reads the
  // parameters and the state of the pieces it owns. Between iterations, after
  // configure_optimizer() when there is optimizer state to restore. UsageError naming the file
  // and tensor for a checkpoint of another model or optimizer, a checksum that does not match, a
  // missing or truncated file.
  void load_checkpoint(const std::string& path);
  // The same state in memory, no file and no serialisation: a collective that streams every
  // rank's state to `recipient` (every rank with -1) in bounded windows, as save_checkpoint does;
  // the recipient holds the result and one window more. Other ranks get an empty StateDict.
  StateDict state_dict(int recipient = 0);
  // A StateDict (from state_dict(), or built by hand with the checkpoint's names) into this rank,
  // at any world size, stage and partition; every rank calls it with the whole dict.
  void load_state_dict(const StateDict& state);
  // This rank's own part of that state, no collective: what its sharded checkpoint file holds (each
  // owned slice as <name>@<offset>, 1-D, parameters and optimizer state), with the metadata and
  // shardflow.rank. Every rank's together cover the state once (a sharded form for trainers that
  // save per rank; load_checkpoint reads the files, shardflow.torch stitches the dicts).
  StateDict shard_state_dict();
  std::int64_t optimizer_steps() const;  // steps the runtime's optimizer has taken (0 without one)

  std::uint64_t iteration() const;               // completed synchronised iterations
  std::vector<BucketInfo> buckets() const;       // current bucket plan
  // What this rank owns with the runtime's optimizer, bucket by bucket (the padding of the flat
  // partition left out); empty without configure_optimizer. `shardflow plan` predicts it.
  std::vector<OwnedPiece> owned() const;
  std::vector<std::string> collective_log() const;  // every collective this rank issued, in order

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  // The rank actor (shardflow/actor.hpp, actors/rank_actor.cpp) runs the halves of the waits below
  // around the completions it is told of; the public waits ask it (Note [The rank actor]).
  friend struct RankActorAccess;
  bool begin_wait();  // the pass handed over; false for an accumulation pass (nothing to await)
  void end_wait();    // after the completion: the bookkeeping before the next iteration
  std::uint32_t param_bucket_to_await(Param p);  // ~0u: p holds its update (forward's use noted)
  void finish_checkpoint();  // the pending background save onto disk (wait_checkpoint's work)
  void wait_here();          // wait() on the rank actor's own thread (a RankCall), which may block
  void load_sharded_checkpoint(const std::string& index_path);
  void finish_sharded_checkpoint(const std::string& dir, const std::string& index, const std::string& failure, std::size_t slices);
  void snapshot_if_due();  // at the end of a synchronised iteration (Note [Snapshots])
};

}  // namespace shardflow
