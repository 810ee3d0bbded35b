#include "kernels/cpu/host_memory.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "shardflow/errors.hpp"

namespace shardflow {

namespace {

constexpr std::size_t kMapped = std::size_t{1} << 20;  // from here on, straight from the kernel
constexpr std::size_t kHugePage = std::size_t{2} << 20;
constexpr std::size_t kPage = 4096;

// Note [Huge pages for large blocks]
// A fresh page costs a fault when it is first written. On a virtual machine each 4 KiB fault is
// dear (9.6 us on the 2-core VM this was measured on: 2.4 ms a MiB, 620 ms for 256 MiB), and every large block of the
// runtime is written first on the training's path: an optimizer slot and the twins' undo copies
// in the first step (313 ms of a 16 MiB shard's step at world 4, against 8 ms once warm), a
// restored slot as the restore's windows land, each bucket's staging in its first collective.
// So blocks of a huge page or more are placed on a 2 MiB boundary and marked MADV_HUGEPAGE: where
// the kernel's transparent huge pages are `madvise` (Ubuntu's and many clouds' default) or
// `always`, a fault then brings 2 MiB (15 ms for the 256 MiB above). The blocks still take no
// memory until written, in 2 MiB steps instead of 4 KiB; under `never` the advice is ignored.
// SHARDFLOW_HUGE_PAGES=0 keeps 4 KiB pages.
bool huge_pages_wanted() {
  static const bool wanted = huge_pages_setting(std::getenv("SHARDFLOW_HUGE_PAGES"));
  return wanted;
}

std::shared_ptr<std::byte> map_zeroed(std::size_t bytes) {
  const std::size_t length = (bytes + kPage - 1) / kPage * kPage;
  const bool huge = length >= kHugePage && huge_pages_wanted();
  // A huge page needs a 2 MiB-aligned range: map one huge page more and give back the ends.
  const std::size_t span = huge ? length + kHugePage : length;
  void* m = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) throw std::bad_alloc();
  auto* base = static_cast<std::byte*>(m);
  if (huge) {
    const auto at = reinterpret_cast<std::uintptr_t>(base);
    auto* aligned = base + ((kHugePage - at % kHugePage) % kHugePage);
    if (aligned > base) ::munmap(base, std::size_t(aligned - base));
    if (auto* end = aligned + length; end < base + span) ::munmap(end, std::size_t(base + span - end));
    base = aligned;
    advise_huge_pages(base, length);
  }
  return std::shared_ptr<std::byte>(base, [length](std::byte* q) { ::munmap(q, length); });
}

}  // namespace

bool huge_pages_setting(const char* value) {
  if (!value || std::strcmp(value, "1") == 0) return true;
  if (std::strcmp(value, "0") == 0) return false;
  throw UsageError(std::string("SHARDFLOW_HUGE_PAGES='") + value + "': 1 (large blocks on transparent huge pages, the default) or 0 (4 KiB pages)");
}

void advise_huge_pages(void* p, std::size_t bytes) {
  if (!huge_pages_wanted()) return;
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  const auto lo = (at + kHugePage - 1) / kHugePage * kHugePage, hi = (at + bytes) / kHugePage * kHugePage;
  if (hi > lo) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);  // advice: refused (EINVAL without THP) changes nothing
}

std::shared_ptr<std::byte> alloc_zeroed(std::size_t bytes) {
  // 64-byte aligned and zeroed: a bucket is a gradient accumulator from the start, and padding
  // must reduce as zeros. Large blocks come straight from the kernel, whose fresh pages read as
  // zero and take no memory until written: memset would make every page resident at once (a
  // migrating optimizer slot, a bucket's padding, a stage 2 pool buffer not yet used), and freed
  // they go back to the system instead of staying in the allocator's heap.
  if (bytes >= kMapped) return map_zeroed(bytes);
  const std::size_t rounded = std::max<std::size_t>(64, (bytes + 63) / 64 * 64);
  auto* p = static_cast<std::byte*>(std::aligned_alloc(64, rounded));
  if (!p) throw std::bad_alloc();
  std::memset(p, 0, rounded);
  return std::shared_ptr<std::byte>(p, [](std::byte* q) { std::free(q); });
}

}  // namespace shardflow
