// Where a Runtime's bucket memory lives and how the runtime touches it. CPU buckets are written
// with memcpy/memset on the calling thread; CUDA buckets with asynchronous copies on the
// trainer's compute stream (Runtime::set_stream), so that they are ordered with the backward
// kernels that produce the gradients and the events that hand buckets to the comm stream.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "kernels/cuda/stream.hpp"
#include "shardflow/types.hpp"

namespace shardflow {

struct MemoryOps {
  Device device;
  cuda::Stream stream = nullptr;  // the trainer's compute stream (CUDA only; null: legacy default)

  bool on_gpu() const { return device.kind == Device::Kind::cuda; }
  void copy(void* dst, const void* src, std::size_t bytes) const;
  void zero(void* dst, std::size_t bytes) const;
};

// One event per bucket, recorded on the compute stream when the bucket's last gradient is ready
// (CollectiveOp::wait_event). Re-recorded each iteration: the previous reduction has completed by
// then, so no comm stream still needs the old recording.
class BucketEvents {
 public:
  // Records go on mem->stream as it is at record time (Runtime::set_stream may change it).
  BucketEvents(std::shared_ptr<const MemoryOps> mem, std::size_t buckets);
  ~BucketEvents();
  BucketEvents(const BucketEvents&) = delete;
  BucketEvents& operator=(const BucketEvents&) = delete;
  void record(std::size_t b);
  cuda::Event get(std::size_t b) const { return events_.empty() ? nullptr : events_[b]; }

 private:
  std::shared_ptr<const MemoryOps> mem_;
  std::vector<cuda::Event> events_;  // empty for CPU buckets
};

}  // namespace shardflow
