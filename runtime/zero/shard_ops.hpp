// How a ZeRO shard touches its memory. The Shard (runtime/zero/shard.cpp) decides which pieces move
// where; a ShardOps does the moving, the casts, the update and the norms: with loops on the calling
// (actor) thread for CPU parameters, with kernels on a stream of the shard's own for CUDA ones.
//
// Note [Shard streams]
// A CUDA shard enqueues all its work on one stream and never waits for the device on the host (a
// step runs on a CAF scheduler thread). What orders that stream with the others:
//  - inputs: a bucket's reduced gradients are read only after the host heard its reduction
//    complete, so no device wait is needed. The one exception is the 16-bit wire cast at issue,
//    which waits for the bucket's event on the compute stream (Shard::to_wire).
//  - to the comm stream: events recorded after the norm partial and after each bucket's pack are
//    the CollectiveOp::wait_event of the norm exchange and of the bucket's sync.
//  - to the trainer's compute stream: Runtime::wait() (and wait_param, with forward prefetch) makes
//    the compute stream wait for what the shard enqueued (updated parameters, zeroed buckets). A
//    pooled buffer given back to the pool (ZeRO-2) first makes the compute stream wait as well:
//    the trainer's next gradients may be written into it.
// At construction the shard stream waits for the compute stream, where the trainer initialised
// its parameters.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "kernels/cuda/stream.hpp"
#include "runtime/core/device_memory.hpp"
#include "shardflow/optimizer.hpp"
#include "shardflow/types.hpp"

namespace shardflow {

// The gradient clipping factor: a host value (CPU shards), or a device float the CUDA shard's
// kernel computed from the exchanged norms, which the step kernels read.
struct ClipCoef {
  float host = 1.0f;
  const float* device = nullptr;
};

class ShardOps {
 public:
  virtual ~ShardOps() = default;
  virtual bool on_gpu() const = 0;

  virtual std::shared_ptr<std::byte> alloc(std::size_t bytes) = 0;  // zeroed, where the shard lives
  virtual void copy(void* dst, const void* src, std::size_t bytes) = 0;
  virtual void zero(void* dst, std::size_t bytes) = 0;
  // dst[i] = src[i] converted (the same type: a copy).
  virtual void cast(DType dst_t, void* dst, DType src_t, const void* src, std::size_t n) = 0;
  // Synchronous transfers to and from host memory: state migration (once, after the first step).
  virtual void download(void* host, const void* src, std::size_t bytes) = 0;
  virtual void upload(void* dst, const void* host, std::size_t bytes) = 0;
  // The contents of [p, p + bytes) are no longer needed (migrated away): host memory gives its
  // whole pages back at once; device memory waits for its buffer's release.
  virtual void discard(void* p, std::size_t bytes) {
    (void)p;
    (void)bytes;
  }

  // One optimizer update of a piece the shard owns.
  struct Update {
    float* master = nullptr;       // the fp32 values stepped: the parameter itself, or its master
    void* param = nullptr;         // the trainer's storage refreshed from the master (null: none)
    DType param_dtype = DType::f32;
    DType round_as = DType::f32;   // fp32 storage on a 16-bit wire: the value it will travel as
    void* grad = nullptr;          // the reduced gradient (scaled in place by the clip on the CPU)
    DType grad_dtype = DType::f32;
    ClipCoef clip;
    float* state_a = nullptr;
    float* state_b = nullptr;
    // What the step reads when it is not where it writes (null: in place): the twin's step ahead
    // keeps the values and state it stepped from (Note [Syncs from the twin]). Host shards only.
    const float* from_master = nullptr;
    const float* from_a = nullptr;
    const float* from_b = nullptr;
    std::size_t n = 0;
    bool first = false;
    std::int64_t step = 1;
    const std::string* param_name = nullptr;  // for step rules (StepArgs)
    std::size_t offset = 0;
  };
  virtual void update(const OptimizerConfig& h, const Update& u) = 0;

  // *out = this rank's partial norm over `parts` (sum of squares; max |g| when `inf`).
  struct NormPart {
    DType dtype;
    const void* data;
    std::size_t n;
  };
  virtual void partial_norm(const std::vector<NormPart>& parts, bool inf, float* out) = 0;
  // The clip coefficient from `count` partials (this rank's alone, or every rank's after the
  // exchange); also keeps the norm for last_norm().
  virtual ClipCoef clip_coef(const float* partials, int count, bool inf, float max_norm) = 0;
  virtual float last_norm() = 0;  // CUDA: waits for the shard's stream (the trainer's thread only)
  virtual void set_last_norm(float) {}  // the unscaled norm, with loss scaling (host shards)

  // Events, by slots the shard numbers itself (CUDA only; nothing and null on the CPU).
  virtual void make_events(std::size_t slots) {}
  virtual cuda::Event record(std::size_t slot) { return nullptr; }  // after the work enqueued so far
  virtual cuda::Event event(std::size_t slot) const { return nullptr; }
  virtual void after(cuda::Event e) {}                               // the shard's stream waits for e
  virtual void after_compute() {}  // the shard's stream waits for what the compute stream has now
  virtual void compute_after(std::size_t slot) {}                    // the compute stream waits for slot
  void fence_compute(std::size_t slot) {  // the compute stream waits for everything enqueued so far
    record(slot);
    compute_after(slot);
  }
};

// A CPU or CUDA shard for the buckets' device (`mem`: the device and the compute stream).
std::unique_ptr<ShardOps> make_shard_ops(std::shared_ptr<const MemoryOps> mem);
std::unique_ptr<ShardOps> make_cpu_shard_ops();
std::unique_ptr<ShardOps> make_cuda_shard_ops(std::shared_ptr<const MemoryOps> mem);  // shard_ops_cuda.cpp

// Tests only: shards made from now on get their ops from `f` (empty: by device, as above). A
// suite wraps the CPU ops with fake events to check the protocol of Note [Shard streams] on a
// machine without a GPU.
using ShardOpsFactory = std::function<std::unique_ptr<ShardOps>(std::shared_ptr<const MemoryOps>)>;
void set_shard_ops_factory_for_tests(ShardOpsFactory f);

}  // namespace shardflow
