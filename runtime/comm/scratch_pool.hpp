// Scratch blocks kept from one collective to the next (Note [Scratch kept between collectives]).
#pragma once

#include <algorithm>
#include <cstddef>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "kernels/cpu/host_memory.hpp"

namespace shardflow {

// Note [Scratch kept between collectives]
// The two-level collectives hold what lies between the levels in scratch of their own, one block
// or two per collective. Allocated per collective, a block of 32 MiB or more (a 64 MiB bucket's
// reduce-scatter at 2 hosts) is above glibc's largest mmap threshold: every collective mapped it,
// zeroed it page by page and gave it back, 8,192 faults of 4 KiB at 9.6 us each on the CI's VM.
// Blocks now come from this pool and go back to it when their collective is done (Gloo's ring keeps
// its reduce-scatter scratch in a pool of one the same way, so a new context's first call is the
// only one that maps); the pool keeps
// the few largest, so a steady run allocates nothing. What it keeps is what the collectives held at
// their busiest (at most `keep` blocks idle), now held between them too; like the collectives'
// scratch before, it is the communicator's and not in `memory_report()`. Blocks are not zeroed on
// reuse: the caller zeroes what it reads before it writes.
class ScratchPool {
 public:
  explicit ScratchPool(std::size_t keep = 4) : state_(std::make_shared<State>()) { state_->keep = keep; }

  // A block of at least `bytes` that returns here when its last owner lets go (or is freed, once
  // the pool is gone).
  std::shared_ptr<std::byte> take(std::size_t bytes) {
    std::shared_ptr<std::byte> block;
    std::size_t size = 0;
    {
      std::lock_guard lock(state_->mu);
      auto& free = state_->free;
      auto best = free.end();
      for (auto it = free.begin(); it != free.end(); ++it)
        if (it->first >= bytes && (best == free.end() || it->first < best->first)) best = it;
      if (best != free.end()) {
        size = best->first;
        block = std::move(best->second);
        free.erase(best);
      }
    }
    if (!block) {
      size = std::max<std::size_t>(bytes, 64);
      block = alloc_zeroed(size);
    }
    std::byte* raw = block.get();
    return std::shared_ptr<std::byte>(raw, [weak = std::weak_ptr<State>(state_), block = std::move(block), size](std::byte*) mutable {
      if (auto state = weak.lock()) state->give_back(size, std::move(block));
    });
  }

 private:
  struct State {
    std::mutex mu;
    std::size_t keep = 4;
    std::vector<std::pair<std::size_t, std::shared_ptr<std::byte>>> free;
    void give_back(std::size_t size, std::shared_ptr<std::byte> block) {
      std::shared_ptr<std::byte> dropped;  // freed outside the lock
      std::lock_guard lock(mu);
      free.emplace_back(size, std::move(block));
      if (free.size() > keep) {
        auto smallest = std::min_element(free.begin(), free.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
        dropped = std::move(smallest->second);
        free.erase(smallest);
      }
    }
  };
  std::shared_ptr<State> state_;
};

}  // namespace shardflow
