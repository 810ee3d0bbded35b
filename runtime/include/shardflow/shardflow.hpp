// shardflow: data-parallel training for C++ trainers. This is the one header a trainer includes
// (docs/embedding.md walks through it; the notes named here are in the code).
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
//     optimizer step          // or none: configure_optimizer() steps inside shardflow (ZeRO)
//
// Reductions start while backward is still running: a bucket's collective is issued as soon as its
// gradients and those of every earlier bucket are ready, in the same order on every rank.
#pragma once

#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardflow/comm_hook.hpp"
#include "shardflow/communicator.hpp"
#include "shardflow/config.hpp"
#include "shardflow/errors.hpp"
#include "shardflow/optimizer.hpp"
#include "shardflow/state_dict.hpp"
#include "shardflow/stats.hpp"
#include "shardflow/types.hpp"

namespace shardflow {

// Parameters that share optimizer hyper-parameters (lr, weight decay, betas...). Every group uses
// the same optimizer kind.
struct ParamGroup {
  std::vector<Param> params;
  OptimizerConfig optimizer;
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

  // ---- Set-up: before training starts ---------------------------------------------------------
  // Registers a parameter; call in forward order. Names are unique; parameters and buffers share
  // one namespace, and every rank registers the same ones.
  Param register_param(ParamSpec spec);
  // Every parameter of one flat buffer, llm.c-style (Note [Flat buffers]); entries must not overlap
  // and must fit. Their handles in table order.
  std::vector<Param> register_flat(const FlatBuffers& flat);
  // State forward updates without a gradient (running statistics): broadcast from rank 0 at
  // finalize() and, with Config::sync.buffers, each synchronised iteration (Note [Rank 0's state
  // everywhere]).
  void register_buffer(BufferSpec spec);
  Param param(const std::string& name) const;  // UsageError if unknown
  std::size_t num_params() const;
  // CUDA parameters: the stream backward runs on (a cudaStream_t; null: the legacy default
  // stream). A bucket's collective waits on the device for an event recorded there; after wait()
  // work on this stream sees the results. One device per Runtime; change it between iterations.
  void set_stream(void* cuda_stream);
  // How buckets are reduced (Note [Comm hooks]; PyTorch's register_comm_hook): once, before
  // finalize(), the same kind on every rank. Host buckets, not with ZeRO-2 or a 16-bit comm_dtype.
  void register_comm_hook(std::shared_ptr<CommHook> hook);
  // The optimizer step inside shardflow: each rank steps what it owns (everything at stage 0) as
  // Config::zero.overlap says; wait() returns once every parameter is updated on every rank.
  // Parameters in no group join group 0. After registration.
  void configure_optimizer(std::vector<ParamGroup> groups);
  void configure_optimizer(const OptimizerConfig& all) { configure_optimizer({ParamGroup{{}, all}}); }
  // Ends registration: every rank registered the same parameters and buffers (MismatchError naming
  // the first difference), rank 0's values everywhere (Config::sync.initial), the buckets built.
  // With Config::snapshot.dir the parameters' broadcast waits for resumed_step(): a run that
  // resumes takes them from the snapshot (Note [Rank 0's state everywhere]).
  // A collective; zero_grad(), grad() and grad_ready() call it when needed.
  void finalize();

  // ---- One iteration, in the order a step runs -----------------------------------------------
  void zero_grad();
  // Where p's gradient goes (its bucket slot with Config::buckets.gradient_as_bucket_view). May
  // move once, when the buckets are rebuilt after the first iteration: ask each step. With the
  // runtime's optimizer at stage >= 1 a bucket carries the parameter sync after the step, so
  // gradients mean nothing after wait().
  void* grad(Param p);
  float* grad_f32(Param p);  // UsageError unless p is fp32
  // Backward produced p's gradient. From any thread. UsageError for an unknown handle or a
  // parameter already reported in this pass.
  void grad_ready(Param p);
  void grad_ready(const std::string& name);
  // Every parameter of the flat buffer in elements [offset, offset + count) has its gradient (a
  // layer's backward is done). A range that cuts a parameter is a UsageError naming it.
  void grads_ready(std::size_t offset, std::size_t count);
  // Every gradient of this pass is reported. Unreported parameters are reduced as zeros with
  // Config::buckets.find_unused_parameters, else a UsageError naming them.
  void finish_backward();
  // Blocks until this iteration's reductions (and steps, with the runtime's optimizer) completed,
  // at most Config::timeouts.collective. Calls finish_backward() if the trainer did not.
  void wait();
  // With Config::zero.forward_prefetch: blocks until p holds its last update; call in forward
  // before p is read (wait() then leaves the updates to land during forward). Else returns at once.
  void wait_param(Param p);
  // wait_param's check without the wait (for an actor): true when every one of `ps` holds its
  // update; where false, ask the rank actor (rank_api::params_ready) to be told.
  bool params_ready(const std::vector<Param>& ps);
  // Every parameter's update landed: before saving, at the end, before a collective of your own
  // issued on the communicator directly.
  void wait_all_params();
  // A collective of your own (a loss, a metric) queued in the runtime's order on its comm stream:
  // between wait() and the next backward, the same ones on every rank; buffers valid until the
  // future is ready; get() rethrows a failure. Returns at once.
  std::future<void> collective(CollectiveOp op);
  // Config::buckets.find_unused_parameters, after wait(): the parameters no rank reported in the
  // last synchronised iteration; not stepped, as torch.optim skips a grad of None.
  std::vector<Param> unused_parameters() const;
  // Config::join.uneven_inputs (PyTorch's Join): this rank is out of data; it takes part in the
  // others' iterations with zero gradients until every rank has joined (Note [Uneven inputs]).
  void join();
  int training_ranks() const;  // ranks that contributed to the last synchronised iteration

  // ---- Gradient accumulation -----------------------------------------------------------------
  // While off, backward passes accumulate locally and wait() returns at once; the first backward
  // after turning it back on reduces what accumulated.
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

  // ---- The trainable set and the optimizer, between iterations -------------------------------
  // Freezing (Note [Changing the trainable set]): before finalize() it sets requires_grad; after,
  // it applies at refresh_trainable(), a collective that re-plans buckets and shards. State of
  // parameters that stay trainable survives.
  void set_requires_grad(Param p, bool requires_grad);
  void refresh_trainable();
  // From the next iteration on (Note [Changing hyper-parameters]): a group's learning rate or any
  // hyper-parameter (the kind stays).
  void set_lr(std::size_t group, float lr);
  void set_hyperparameters(std::size_t group, const OptimizerConfig& h);
  OptimizerConfig hyperparameters(std::size_t group) const;
  // torch.optim's add_param_group: parameters no group named take its hyper-parameters; a
  // parameter trained in group 0 keeps its state. Returns the group's index.
  std::size_t add_param_group(const ParamGroup& group);
  // The last iteration's global norm (clipping or loss scaling), unscaled. With forward prefetch
  // it waits for that norm, and the three below for the last step's end (about what forward waits
  // for anyway): wait() returned before the step was taken.
  float last_grad_norm() const;
  // Config::precision.dynamic_loss_scale (Note [Loss scaling]): multiply the loss by this; whether
  // the last step was skipped for an inf or NaN on some rank (every rank skips alike).
  float loss_scale() const;
  bool last_step_skipped() const;
  std::int64_t optimizer_steps() const;  // steps the runtime's optimizer has taken (0 without one)

  // ---- Checkpoints and state (Note [Checkpoints]); every call is a collective ----------------
  // One safetensors file in parameter coordinates, streamed to `recipient`, written atomically;
  // past max_file_bytes of tensor data (0: no limit) split into files with a path.index.json.
  void save_checkpoint(const std::string& path, int recipient = 0, std::uint64_t max_file_bytes = 0);
  // Each rank writes what it owns to its own file in `dir`, rank 0 an index written last: no rank
  // gathers anything (Note [Sharded checkpoints]). The async form blocks only while copying;
  // wait_checkpoint() finishes it (every rank, before the next save).
  void save_sharded_checkpoint(const std::string& dir);
  void save_sharded_checkpoint_async(const std::string& dir);
  void wait_checkpoint();
  // Config::snapshot.dir (Note [Snapshots]): restores the newest complete snapshot, the same on
  // every rank; returns the iteration it follows (0: a fresh start). Once, before the first forward.
  std::uint64_t resumed_step();
  // After a peer was lost (a CommError or TimeoutError from a call above), under `shardflow run
  // --recovery in-place`: goes on in this process over `comm`, the job's next round
  // (rejoin_process_group in shardflow/launch.hpp), while the lost rank's process starts again
  // (Note [Recovering in place]). The failed step is discarded on every rank: the set-up calls made
  // before training are made again on `comm` and the newest complete snapshot is loaded, as the
  // replacement's resumed_step() does. Returns the iteration to go on from; rank() and world_size()
  // are the new round's. Parameter handles stay valid. Needs Config::snapshot.dir.
  std::uint64_t recover(std::shared_ptr<Communicator> comm);
  // The trainer's own state in each snapshot (Config::snapshot.trainer_state; Note [The
  // trainer's state in a snapshot]): bytes the trainer encodes (an LR scheduler's state_dict), the
  // same on every rank, as they stand once its code after a step has run, i.e. at the next
  // iteration's start. trainer_state_wanted() is the step of the snapshot in flight that still
  // waits for them (0: none), and with mirrored shards (Config::zero.redundancy = 2) the step just
  // done at every iteration's start, whose state the twins may go on from (Note [The trainer's
  // state with the twins]); set_trainer_state(step, bytes) hands them to it, and its index keeps
  // them. trainer_state() is what the snapshot or sharded checkpoint last loaded carried (nullopt:
  // nothing), for the trainer to restore after resumed_step() or recover().
  std::uint64_t trainer_state_wanted() const;
  void set_trainer_state(std::uint64_t step, const std::string& state);
  std::optional<std::string> trainer_state() const;
  // A consolidated file, a parameters-only state dict or a sharded checkpoint, at any world size,
  // stage and partition; between iterations, after configure_optimizer(). UsageError naming the
  // file and tensor for another model or optimizer, a bad checksum, a missing or cut file.
  void load_checkpoint(const std::string& path);
  // The same state in memory: on `recipient` (every rank with -1), others get an empty dict.
  StateDict state_dict(int recipient = 0);
  void load_state_dict(const StateDict& state);  // every rank, the whole dict, any layout
  // This rank's own part, no collective: what its sharded checkpoint file holds (<name>@<offset>).
  StateDict shard_state_dict();

  // ---- Observing -----------------------------------------------------------------------------
  MemoryReport memory_report() const;
  RuntimeStats stats() const;
  IterationStats last_stats() const;  // the last synchronised iteration's figures (cheap)
  // Your own work on the timeline beside the runtime's (Note [Timeline]): cat "forward",
  // "backward" or "step", until the object goes; on the thread doing the work, nested or apart.
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
  std::uint64_t iteration() const;          // completed synchronised iterations
  std::vector<BucketInfo> buckets() const;  // the current bucket plan
  // What this rank owns with the runtime's optimizer, bucket by bucket (padding left out); what
  // `shardflow plan` predicts. Empty without configure_optimizer().
  std::vector<OwnedPiece> owned() const;
  std::vector<std::string> collective_log() const;  // every collective this rank issued, in order

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  // The rank actor (runtime/rank/rank_actor.cpp) runs the halves of the waits around the
  // completions it is told of (Note [The rank actor]) through Impl: this is its way in.
  friend struct RankActorAccess;
};

}  // namespace shardflow
