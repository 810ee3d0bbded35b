// Where the in-process worlds' ranks (CPU threads, or streams of one GPU) meet for an op.
//
// Note [Parity slots]
// Each rank publishes the op it is about to run (its buffers, and its signature: kind, count,
// dtype, op number) in its own slot; after the entry barrier every rank compares every slot's
// signature with rank 0's, so a mismatch fails the op on every rank alike (and aborts the barrier,
// so later ops fail at once instead of hanging). Slots are indexed by the op number's parity: a
// rank that finished op k may publish op k+1 while a slower peer still reads op k's slots (a
// barrier op has no exit barrier). A slot is reused two ops later, after barriers every rank passed.
#pragma once

#include <array>
#include <cstddef>
#include <vector>

#include "runtime/comm/barrier.hpp"
#include "runtime/comm/peer_collective.hpp"
#include "shardflow/errors.hpp"

namespace shardflow {

// Slot must have a `peer::OpSig sig` member.
template <class Slot>
class ParitySlots {
 public:
  explicit ParitySlots(int ranks) : slots_(std::size_t(ranks)) {}
  Slot& operator()(int rank, std::size_t parity) { return slots_[std::size_t(rank)][parity]; }
  std::array<Slot, 2>& of_rank(int rank) { return slots_[std::size_t(rank)]; }
  auto begin() { return slots_.begin(); }
  auto end() { return slots_.end(); }

  // Every rank's signature against rank 0's; MismatchError otherwise. Every rank runs the same
  // comparison, so they all fail together (no rank is left waiting in a data phase the others skipped).
  void check_matching(std::size_t parity, RankBarrier& barrier) const {
    std::vector<peer::OpSig> sigs;
    for (const auto& s : slots_) sigs.push_back(s[parity].sig);
    if (auto msg = peer::mismatch(sigs.data(), int(sigs.size()))) {
      barrier.abort(*msg);  // every rank reaches the same verdict; later ops fail at once
      throw MismatchError(*msg);
    }
  }

 private:
  std::vector<std::array<Slot, 2>> slots_;
};

}  // namespace shardflow
