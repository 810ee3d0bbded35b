// The single place where shardflow's knobs live. Every field has a default a trainer can keep.
#pragma once

#include <chrono>
#include <cstddef>
#include <map>
#include <optional>
#include <string>

#include "shardflow/types.hpp"

namespace shardflow {

// Where the optimizer step happens relative to backward (only with Runtime::configure_optimizer).
enum class Overlap {
  none,            // step after every reduction completed, then parameter sync: the reference
  after_backward,  // once the last bucket went to communication, each bucket steps as soon as its
                   // reduction completed (in bucket order) and its sync starts right after
  interleaved,     // each bucket steps as soon as its reduction completed, while backward runs
};
// What ZeRO shards over the ranks (Rajbhandari et al., 2020). ZeroStage(n) converts a stage
// number; Config::validate refuses anything but 0, 1 and 2.
enum class ZeroStage : std::uint8_t {
  ddp = 0,              // stage 0: nothing sharded, every rank keeps all optimizer state
  optimizer_state = 1,  // stage 1: each rank keeps its shard's optimizer state and steps it
  gradients = 2,        // stage 2: and receives only its shard of the reduced gradients
};
// How optimizer state is split over the ranks (ZeRO stage 1 and 2).
enum class Partition {
  param,   // whole parameters, largest first, each to the least-loaded rank (ties: lowest rank)
  bucket,  // whole buckets, largest first, each to the least-loaded rank
  flat,    // every bucket cut into world equal contiguous slices (padded)
};
Overlap parse_overlap(const std::string& s);      // "none", "after_backward", "interleaved"
Partition parse_partition(const std::string& s);  // "param", "bucket", "flat"
const char* overlap_name(Overlap o);
const char* partition_name(Partition p);

// Config groups its settings the way the field does (FSDP2's policies, Megatron's DDP config):
// cfg.buckets, cfg.zero, cfg.precision, cfg.trace, cfg.timeouts. Every field has a default a
// trainer can keep.

// How gradients are grouped for reduction.
// The bucket cap when none is set (PyTorch's DDP default), and the buckets a small model gets
// at least under it (BucketConfig::min_buckets): with DDP, and with ZeRO stages 1 and 2 at a world
// above 1, whose reduction, step and sync form a longer chain per bucket (Note [Buckets for small
// models]).
inline constexpr std::size_t kDefaultBucketCapBytes = std::size_t{25} << 20;
inline constexpr std::size_t kDefaultMinBuckets = 4;
inline constexpr std::size_t kDefaultMinBucketsSharded = 16;

struct BucketConfig {
  // Buckets are formed walking parameters in reverse registration order (backward produces the
  // last layer's gradients first). The first bucket is small so that the first reduction starts
  // early in backward; the rest are large so that per-collective latency is amortised. A bucket
  // closes as soon as its byte size reaches or passes its cap.
  std::size_t first_cap_bytes = std::size_t{1} << 20;  // 1 MiB
  // The mirror: the gradients that come last (the layers the next forward needs first: embeddings,
  // first block, a tied embedding) get a small bucket of their own, so that what stands between
  // backward's end and forward's first layer (that bucket's reduction, step and sync) is short
  // (Note [A small last bucket]). 0: none, the last bucket fills like any other (PyTorch's DDP).
  std::size_t last_cap_bytes = std::size_t{1} << 20;  // 1 MiB
  // 0 (default): 25 MiB, shrunk for small models by min_buckets. A cap you set is used as given,
  // as PyTorch's bucket_cap_mb is (`shardflow plan` says which rule set each cap).
  std::size_t cap_bytes = 0;
  // A model smaller than min_buckets x 25 MiB would get one or two buckets, and then nothing
  // overlaps: the reductions wait for the whole backward and the parameter syncs for the whole
  // step. So the default cap shrinks to the trainable bytes / min_buckets, never below
  // first_cap_bytes (Note [Buckets for small models]; 8 x Linear(512, 512) over a 1 Gbit/s link,
  // ZeRO-1: 84 -> 77 ms). Unset (default): with the default cap 4, or 16 where ZeRO stage 1 or 2
  // shards over more than one rank; none with a cap you set. Set, it applies to either (0: never
  // shrink).
  std::optional<std::size_t> min_buckets;
  // Gradients live inside the flat bucket buffers (no copy into / out of the bucket). Trainers
  // write gradients where Runtime::grad() points. Off: the trainer owns gradient storage
  // (ParamSpec::grad) and shardflow copies into and out of its buckets.
  bool gradient_as_bucket_view = true;
  // Parameters that got no gradient in an iteration are reduced as zeros when backward finishes;
  // one that no rank used is not stepped (Note [Unused parameters], Runtime::unused_parameters).
  // Off: finishing backward with unreduced parameters is an error naming them (a hang elsewhere).
  bool find_unused_parameters = false;
  // After the first iteration the buckets are rebuilt once from the order gradients actually
  // became ready (rank 0's, so every rank agrees), as PyTorch's DDP does. Off: keep the
  // registration-order plan (a trainer that registers in backward's order already).
  bool rebuild = true;
  // PyTorch's static_graph (Note [Static graph]): every iteration uses the same parameters and
  // reports each gradient the same number of times (re-entrant backward, activation
  // checkpointing: more than once). The first iteration learns both: which parameters no rank uses
  // (fixed from then on: not stepped, and no exchange to find them each iteration, unlike
  // find_unused_parameters) and how many reports complete each gradient.
  bool static_graph = false;
};

// ZeRO: the optimizer step inside the runtime. Everything here takes effect with
// Runtime::configure_optimizer(); set without it, the first backward stops with an error.
struct ZeroConfig {
  // ddp: every rank keeps all optimizer state. optimizer_state (ZeRO-1): each rank keeps the
  // optimizer state of its shard and steps it; updated parameters are synced from their owners.
  // gradients (ZeRO-2): as 1, and a rank holds only its shard of the reduced gradients (its
  // buckets are pooled: Note [Pooled buckets (ZeRO-2)]).
  ZeroStage stage = ZeroStage::ddp;
  Partition partition = Partition::flat;
  // Stages 1 and 2 with the flat partition reduce each bucket by reduce-scatter: a rank receives
  // only its slice's averaged gradient, which is all its step reads (Megatron's distributed
  // optimizer, DeepSpeed's reduce_scatter), so reduce-scatter + all-gather of the parameters moves
  // what DDP's all-reduce moves. Off (stage 1 only): an all-reduce, every rank's bucket holding the
  // whole averaged gradient until its step (1.5x DDP's bytes). A comm hook replaces the reduction
  // with its own all-reduces either way. The param and bucket partitions own pieces of unequal
  // size and always all-reduce.
  bool reduce_scatter = true;
  Overlap overlap = Overlap::none;
  // Interleaved overlap: bucket b's parameter sync goes out right after the reduction of bucket
  // b + interleave_lag (the same order on every rank; Note [Collective schedule]). 0: each sync as
  // soon as its step is done, so when backward is slower per bucket than the link, every bucket but
  // the last is done before backward ends; but the next reduction then waits for the step and its
  // hops. 1 or more: that many reductions keep the link busy while a bucket steps, better when the
  // link or the hops are the bottleneck. -1 (default): chosen after the first iteration from what
  // it measured, rank 0's (Note [Choosing the interleave lag]); at most 64.
  int interleave_lag = -1;
  // Parameter syncs only need to complete before the next forward uses the parameters: wait()
  // returns early and the trainer calls Runtime::wait_param(p) in forward. Syncs go out in the
  // forward order the runtime observed (rank 0's).
  bool forward_prefetch = false;
  // With forward prefetch and interleaved overlap: how many buckets' syncs go out during backward
  // (interleaved with the reductions, each after the next bucket's: lag max(1, interleave_lag)), the
  // others after backward in forward order, overlapping the next forward. -1 (default): chosen from
  // what iteration 2 measured (rank 0's); 0: all after backward.
  int prefetch_syncs_in_backward = -1;
  // Stage 2 holds a bucket's gradient buffer only from its first gradient until its reduction is
  // in the rank's shard. At most this many are held at once in a synchronised pass: asking for a
  // gradient of a further bucket (Runtime::grad) waits until a quarter of them (at least one) are
  // reduced (Note [Backpressure in refills]; `shardflow plan` shows the counts). 0 (default): 2 (one
  // being written, one reduced), and the bucket caps shrink so that the buckets in flight take at
  // most what sharding the gradients saves: stage 2 never holds more than stage 1 (Note [Memory at
  // the ZeRO formula]). Raise it for trainers that write several buckets' gradients at once
  // (threads); the budget then counts this many. Refused, naming it, where nothing would be held
  // back: another stage, or stage 2 keeping whole buckets (world 1, or a model so small that
  // sharding its gradients saves less than the buffers in flight would take).
  std::size_t max_buckets_in_flight = 0;
  // Stages 1 and 2, flat partition: parameter syncs that follow each other in the schedule go out
  // as one all-gather while together they move at most this many bytes (Note [Fused syncs]): a
  // small bucket's sync costs its hops, not its bytes. 0: every bucket syncs alone.
  std::size_t fuse_syncs_bytes = std::size_t(256) << 10;
  // clip_grad_norm over all parameters of all shards (0: off); norm type 2 or infinity.
  float clip_grad_norm = 0.0f;
  float clip_norm_type = 2.0f;
  // Mirrored shards (Note [Mirrored shards], Note [Going on from the twins]). 1: each rank's
  // optimizer shard exists once, and a lost rank sends every rank back to the newest snapshot.
  // 2: each rank also keeps a twin of the shard of the rank twin_distance ranks back, fed by a
  // shift of each bucket's reduced slice (one slice per rank more on the wire, in comm_dtype) and
  // stepped as its owner steps it, one step behind; the owner keeps its pieces as they were before
  // the step in flight. recover() (and a replacement's resumed_step()) then go on after the last
  // step every survivor finished, from memory: no completed step is rolled back, nothing is read
  // from disk, as long as no rank and its twin's holder are lost together. Costs, per element a
  // rank owns, with Adam: 8 fp32 words of memory more (the twin's values and moments, its two
  // slices in comm_dtype, the owner's values and moments from before the step) beside the 2 of
  // the state itself (11 where the twin gives the syncs, below: it also keeps the step it
  // computed ahead); a slice per bucket on the wire (at 2 hosts half again the bytes ZeRO moves
  // between them; none more at world 2 across two hosts, where the twin's shift replaces the
  // parameters' all-gather: Note [Syncs from the twin], nor over two levels at two hosts with the
  // twin a host away, where the sync gathers inside the hosts alone: Note [Syncs from the twin,
  // two levels]); and the twin's step on the rank's cores. Needs
  // stage 1 or 2 with the flat partition's reduce-scatter, the runtime's optimizer on host shards,
  // no comm hook, and Config::snapshot.dir (what recovery falls back to). With
  // snapshot.trainer_state the trainer's state is kept at every step too (Note [The trainer's
  // state with the twins]); from Python: DistributedDataParallel(redundancy=2).
  int redundancy = 1;
  // Where the twin of a rank's shard lives: that many ranks on (its source that many back). 0
  // (default): the ranks of one node (LOCAL_WORLD_SIZE under `shardflow run` or torchrun,
  // SLURM_TASKS_PER_NODE under srun, OMPI_COMM_WORLD_LOCAL_SIZE under mpirun), when there are
  // several nodes (so that a lost host's shards have their twins on another), else 1.
  int twin_distance = 0;
};

struct PrecisionConfig {
  // What fp32 parameters' gradients and parameter syncs travel as (the optional 16-bit
  // communication of FairScale's broadcast_fp16 and DeepSpeed's fp16 reduction). bf16/fp16: the
  // owner steps an fp32 master and every rank's fp32 storage holds the same 16-bit-rounded value,
  // so ranks never drift apart. Without configure_optimizer() (the trainer's own optimizer) it is
  // PyTorch's fp16/bf16 compress hook: each bucket divided by the world size, cast, all-reduced and
  // cast back into the fp32 gradients (Note [Comm hooks]). 16-bit parameters always travel as
  // themselves.
  DType comm_dtype = DType::f32;
  // Dynamic loss scaling for fp16 training, as torch.cuda.amp.GradScaler does it (Note [Loss
  // scaling]): the trainer multiplies its loss by Runtime::loss_scale(); the runtime's optimizer
  // unscales the reduced gradients, and when any rank's gradients hold an inf or a NaN every rank
  // skips the step and the scale backs off; after growth_interval clean steps it grows. Needs
  // configure_optimizer(), host shards.
  bool dynamic_loss_scale = false;
  float init_scale = 65536.0f;
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  int growth_interval = 2000;
};

// Rank 0's values to every rank, as PyTorch DDP does at construction and before each forward.
struct SyncConfig {
  // At the end of registration (Runtime::finalize) every parameter and registered buffer is
  // broadcast from rank 0, so ranks that built or initialised their models apart train one model
  // (DDP's constructor always does this). Off: the trainer guarantees equal values itself (one
  // seed on every rank, or a checkpoint loaded before training).
  bool initial = true;
  // Every synchronised iteration, the registered buffers (Runtime::register_buffer) are broadcast
  // from rank 0 once backward ends, before the next forward can use them (DDP's broadcast_buffers,
  // also on by default there). Forward updates running statistics on each rank from its own
  // batch; this keeps every rank's copy equal to rank 0's. No buffers registered: nothing moves.
  bool buffers = true;
};

struct TraceConfig {
  // Writes a Chrome trace (chrome://tracing, ui.perfetto.dev) of what each rank did when (Note
  // [Timeline]): forward/backward spans the trainer adds (Runtime::span), every grad_ready, each
  // collective while it held the comm stream, casts, the shard's steps, every wait, each
  // iteration, the rebuild. Ranks that are threads of one process share the file (written when
  // the last Runtime goes); a rank that is a process of its own (under a launcher) writes
  // <stem>.rank<r>.json beside the path, or where "{rank}" says. A path that cannot be written is
  // a UsageError from the Runtime's constructor. Empty: off (Runtime::stats() works either way).
  std::string path;
};

// Uneven inputs (PyTorch's Join; Note [Uneven inputs]): ranks may run out of data at different
// iterations. Every synchronised iteration then starts with a count of the ranks still training
// (one small all-reduce), gradients are averaged over those ranks only, and a rank out of data
// calls Runtime::join(), which shadows the others' iterations until every rank has joined.
struct JoinConfig {
  bool uneven_inputs = false;
};

struct TimeoutConfig {
  // Every wait that involves another rank fails after this long with an error naming the bucket
  // and the ranks that did not arrive (PyTorch's default for NCCL is also 10 minutes).
  std::chrono::milliseconds collective = std::chrono::minutes(10);
};

// Snapshots the runtime takes and resumes from by itself (Note [Snapshots]): every `every`
// synchronised iterations each rank writes its shard of the parameters and optimizer state to
// dir/step-<N>/ in the background (a sharded checkpoint); the snapshot is complete once its index
// is written, at the end of the first iteration by which every rank's files are written (or at
// wait_checkpoint()): a lost rank costs `every` steps and the write's time at most.
// Runtime::resumed_step() loads the newest complete one and says its N, so that a restarted job
// (shardflow run --max-restarts) goes on where it was. The newest `keep` complete snapshots stay;
// older ones are removed. Empty dir: off.
// In memory (Note [Snapshots in memory]): under `shardflow run` the launcher holds memory that
// outlives the ranks (SHARDFLOW_SNAPSHOT_MEMORY, a tmpfs directory; across nodes each host also
// holds the copies of the node before it in the ring), and with `memory` the snapshots go there,
// double-buffered (the last complete one and the one being written), and only every `disk_every`
// iterations to `dir` (0: every 10 x `every`). Without that memory (no launcher, too little room)
// every snapshot goes to `dir`.
// With `trainer_state` each snapshot also carries the trainer's own state, which it hands over
// with Runtime::set_trainer_state() (Note [The trainer's state in a snapshot], snapshots.cpp): an
// LR scheduler's counter, say, which must go back to the snapshot's step with the model.
struct SnapshotConfig {
  std::string dir;
  int every = 0;
  int keep = 2;
  bool memory = true;
  int disk_every = 0;
  bool trainer_state = false;
};

struct Config {
  BucketConfig buckets;
  ZeroConfig zero;
  PrecisionConfig precision;
  SyncConfig sync;
  JoinConfig join;
  TraceConfig trace;
  TimeoutConfig timeouts;
  SnapshotConfig snapshot;
  // CAF scheduler threads of the process-wide actor system (0: min(2, hardware threads)). Actors
  // only route messages; the heavy lifting happens on comm streams and trainer threads, and each
  // Runtime's rank actor (shardflow/actor.hpp) has a thread of its own, so one worker is enough
  // for any number of ranks and a trainer's own actors.
  unsigned actor_threads = 0;
  // The first Runtime of a process has glibc's malloc keep freed blocks for reuse (mmap threshold
  // 32 MiB, trim threshold 2 GiB) instead of giving them back to the kernel, so that each forward
  // does not page its tensors in again: Note [Keeping the trainer's freed memory]
  // (runtime/process/freed_memory.hpp). false, or SHARDFLOW_KEEP_FREED_MEMORY=0, leaves malloc as
  // it is; so do glibc malloc settings of the user's own in the environment.
  bool keep_freed_memory = true;

  // How this program's users spell settings, for error messages: the setting's path in Config
  // ("zero.overlap") -> what they type (a CLI maps it to "--overlap"). A setting not in it is
  // named "Config::<path>".
  std::map<std::string, std::string> setting_names;

  // Throws UsageError naming the setting when a value makes no sense.
  void validate() const;
  // The settings of cfg.zero and cfg.precision act only through the runtime's optimizer: without
  // configure_optimizer() they would silently do nothing. UsageError naming the first one set, as
  // the user spells it, and what to do. Called by the Runtime at the first synchronised backward.
  void check_needs_optimizer() const;
  std::string name_of(const std::string& path) const;
};

}  // namespace shardflow
