// Host memory for buckets, shards and staging areas: zeroed, 64-byte aligned, large blocks mapped
// straight from the kernel. The CPU counterpart of the device allocations in kernels/cuda.
#pragma once

#include <cstddef>
#include <memory>

namespace shardflow {

std::shared_ptr<std::byte> alloc_zeroed(std::size_t bytes);

// SHARDFLOW_HUGE_PAGES's value (null: not set) -> whether blocks of 2 MiB or more are advised onto
// transparent huge pages (Note [Huge pages for large blocks]); anything but 0 or 1 raises, naming it.
bool huge_pages_setting(const char* value);

// Marks the 2 MiB-aligned part of [p, p + bytes) for transparent huge pages, as alloc_zeroed's own
// large blocks are (unless SHARDFLOW_HUGE_PAGES=0): for a trainer's large buffers, called before
// they are first written (a std::vector reserved, then filled). Advice only; nothing below 2 MiB.
void advise_huge_pages(void* p, std::size_t bytes);

}  // namespace shardflow
