// Host memory for buckets, shards and staging areas: zeroed, 64-byte aligned, large blocks mapped
// straight from the kernel. The CPU counterpart of the device allocations in kernels/cuda.
#pragma once

#include <cstddef>
#include <memory>

namespace shardflow {

std::shared_ptr<std::byte> alloc_zeroed(std::size_t bytes);

}  // namespace shardflow
