#include "kernels/cpu/host_memory.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

namespace shardflow {

std::shared_ptr<std::byte> alloc_zeroed(std::size_t bytes) {
  // 64-byte aligned and zeroed: a bucket is a gradient accumulator from the start, and padding
  // must reduce as zeros. Large blocks come straight from the kernel, whose fresh pages read as
  // zero and take no memory until written: memset would make every page resident at once (a
  // migrating optimizer slot, a bucket's padding, a stage 2 pool buffer not yet used), and freed
  // they go back to the system instead of staying in the allocator's heap.
  constexpr std::size_t kMapped = std::size_t{1} << 20;
  if (bytes >= kMapped) {
    void* m = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) throw std::bad_alloc();
    return std::shared_ptr<std::byte>(static_cast<std::byte*>(m), [bytes](std::byte* q) { ::munmap(q, bytes); });
  }
  const std::size_t rounded = std::max<std::size_t>(64, (bytes + 63) / 64 * 64);
  auto* p = static_cast<std::byte*>(std::aligned_alloc(64, rounded));
  if (!p) throw std::bad_alloc();
  std::memset(p, 0, rounded);
  return std::shared_ptr<std::byte>(p, [](std::byte* q) { std::free(q); });
}

}  // namespace shardflow
