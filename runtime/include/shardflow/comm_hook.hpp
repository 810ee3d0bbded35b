// Communication hooks (Note [Comm hooks]): how a bucket's gradients are reduced, replaceable as in
// PyTorch's DDP register_comm_hook. A hook runs in the bucket's place in the collective schedule
// (every rank issues the same collectives in the same order, whatever the hook does) and reduces
// the bucket in phases: a phase submits collectives; when they complete, its continuation runs on
// the backend's stream thread (never on a scheduler thread) and may start another phase. The
// bucket is reduced when a phase ends without starting another; by then `data` must hold the
// average over all ranks (or what the hook makes of it: a compressed approximation).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shardflow/types.hpp"

namespace shardflow {

// What a hook sees of a bucket when its reduction is due.
struct GradBucket {
  std::uint32_t index = 0;
  std::uint64_t iteration = 0;  // the runtime's synchronised iteration, from 0
  int rank = 0, world = 1;
  // What turns the ranks' sum into their average: 1 / world, or with uneven inputs 1 / the ranks
  // still training (Note [Uneven inputs]).
  float average = 1.0f;
  DType dtype = DType::f32;
  void* data = nullptr;  // the bucket's flat gradients (host memory), reduced in place
  std::size_t numel = 0;
  struct Entry {
    std::string name;
    Shape shape;
    std::size_t offset = 0;  // elements into `data`
  };
  std::vector<Entry> params;  // in the order they sit in `data`
};

// One phase of a hook's reduction: the collectives it submits go out together, in order.
class HookRun {
 public:
  // Sums `count` elements of `data` over the ranks in place, then multiplies by `scale`. The
  // memory must stay valid until the continuation runs (the hook's own state, or the bucket).
  void allreduce(void* data, std::size_t count, DType dtype, float scale = 1.0f);
  // Runs once this phase's collectives completed, on the backend's stream thread; may submit the
  // next phase's collectives (and set its continuation) into the HookRun it is given.
  void then(std::function<void(HookRun&)> next) { next_ = std::move(next); }

  struct Op {
    void* data;
    std::size_t count;
    DType dtype;
    float scale;
  };
  const std::vector<Op>& ops() const { return ops_; }
  std::function<void(HookRun&)>& next() { return next_; }

 private:
  std::vector<Op> ops_;
  std::function<void(HookRun&)> next_;
};

class CommHook {
 public:
  virtual ~CommHook() = default;
  virtual std::string name() const = 0;
  // Starts the reduction of `bucket`: the first phase's collectives into `run`. Called on the comm
  // stream actor (keep it light: heavy work belongs in a continuation, on the stream thread).
  virtual void reduce(const GradBucket& bucket, HookRun& run) = 0;
  // Bytes of state the hook keeps (error feedback, low-rank factors), for memory reports.
  virtual std::size_t state_bytes() const { return 0; }
};

// PyTorch's built-in hooks. allreduce: the plain average (what shardflow does without a hook).
// fp16 / bf16: the bucket divided by the world size, cast to 16 bits, all-reduced, cast back
// (half the bytes on the link). Host buckets of fp32 gradients.
std::shared_ptr<CommHook> allreduce_hook();
std::shared_ptr<CommHook> fp16_compress_hook();
std::shared_ptr<CommHook> bf16_compress_hook();

// PowerSGD (Vogels et al., 2019), with the semantics of torch.distributed's powerSGD_hook: each
// gradient of two or more dimensions, viewed as [shape[0], rest], is approximated by P Q^T of
// rank `rank` (two all-reduces: P, then Q) when that is at least `min_compression_rate` times
// smaller; the other gradients are all-reduced as they are. Plain all-reduce for the first
// `start_iter` iterations. Error feedback adds what the approximation lost to the next
// iteration's gradient; warm start keeps Q from one iteration to the next (the first Q is random
// from `seed`, the same on every rank, and orthogonalised). fp32 host buckets.
struct PowerSGDOptions {
  int rank = 1;
  std::uint64_t start_iter = 10;
  double min_compression_rate = 2.0;
  bool error_feedback = true;
  bool warm_start = true;
  std::uint64_t seed = 0;
  float orthogonalization_epsilon = 0.0f;
};
std::shared_ptr<CommHook> powersgd_hook(PowerSGDOptions options = {});

// "allreduce", "fp16", "bf16", "powersgd" (with `powersgd`'s options) -> the hook; UsageError
// naming the choices otherwise.
std::shared_ptr<CommHook> make_comm_hook(const std::string& name, const PowerSGDOptions& powersgd = {});

}  // namespace shardflow
