#include "runtime/core/device_memory.hpp"

#include <cstring>

namespace shardflow {

void MemoryOps::copy(void* dst, const void* src, std::size_t bytes) const {
  if (!bytes || dst == src) return;
  if (on_gpu())
    cuda::memcpy_async(dst, src, bytes, stream);
  else
    std::memcpy(dst, src, bytes);
}

void MemoryOps::zero(void* dst, std::size_t bytes) const {
  if (!bytes) return;
  if (on_gpu())
    cuda::memset_async(dst, bytes, stream);
  else
    std::memset(dst, 0, bytes);
}

BucketEvents::BucketEvents(std::shared_ptr<const MemoryOps> mem, std::size_t buckets) : mem_(std::move(mem)) {
  if (!mem_->on_gpu()) return;
  for (std::size_t b = 0; b < buckets; ++b) events_.push_back(cuda::event_create(mem_->device.index));
}

BucketEvents::~BucketEvents() {
  for (auto e : events_) cuda::event_destroy(e);
}

void BucketEvents::record(std::size_t b) {
  if (!events_.empty()) cuda::event_record(events_[b], mem_->stream);
}

}  // namespace shardflow
