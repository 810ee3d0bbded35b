// The data phases that CPU backends share when every rank can read its peers' buffers: the
// in-process backend (threads, the peers' own buffers) and the shared-memory backend (processes,
// the peers' staging areas in one POSIX shared-memory segment). The backend supplies `sync`, its
// barrier across the ranks; these functions only say what each rank reads and writes between them.
//
// Note [Peer all-reduce]
// Every rank reduces one contiguous chunk of the op (reading that chunk from all N ranks, summing
// in rank order so that every rank gets bitwise the same result), writes it into its own `recv`
// view, and after a barrier copies the other ranks' finished chunks. The reduction work is spread
// over the N ranks' comm streams; each byte is read N times and written twice, in total.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "shardflow/communicator.hpp"

namespace shardflow::peer {

// What a rank says it is about to run: compared across ranks before any data moves.
struct OpSig {
  CollectiveKind kind = CollectiveKind::barrier;
  DType dtype = DType::f32;
  std::uint64_t count = 0;
  std::int32_t root = 0;  // a shift's distance
  std::uint64_t seq = 0;
  char tag[56] = {};  // truncated; only for messages

  static OpSig of(const CollectiveOp& op, std::uint64_t seq);
  std::string describe() const;
};

// The message every rank raises when the ranks' next collectives differ (null if they agree), or
// a bad broadcast root. Every rank computes the same answer from the same signatures.
std::optional<std::string> mismatch(const OpSig* sigs, int n);

// Note [A dead rank's signature is not a mismatch]
// The signatures are compared once the op's entry barrier is passed. A rank whose process died
// left the signature of the last op it posted, behind the others', and if the barrier ever lets
// the living through without it (it did once, under ThreadSanitizer: test_launch's shrink case,
// docs/hardening.md) the comparison would call that a collective mismatch: the job blamed on the
// trainer's code, and a rank that in-place recovery could have healed lost as an error. So before
// the verdict of mismatch() the backend asks here for the first rank whose signature is not for
// op `seq` and whose process is dead (`dead(r)`), -1 if none, and reports that rank's death.
int dead_behind(const OpSig* sigs, int n, std::uint64_t seq, const std::function<bool(int)>& dead);

// Rank r's chunk [lo, hi) of an all-reduce of `count` elements: boundaries on 16 elements (64 bytes
// of fp32) so that no two ranks write the same cache line.
std::pair<std::size_t, std::size_t> chunk(std::size_t count, int n, int r);

using Sync = std::function<void()>;

// All-reduce (Note [Peer all-reduce]): send[i] / recv[i] are rank i's buffers as this rank sees
// them; `out` is where this rank's result goes (recv[rank], or a private buffer when recv[] are
// staging areas). One sync in the middle; the caller syncs before (inputs ready) and after (no
// peer still reads).
void allreduce(DType t, std::size_t count, float scale, int rank, int n, const std::vector<const void*>& send,
               const std::vector<void*>& recv, void* out, const Sync& sync);
// Reduce-scatter: blocks[i] is rank i's block for this rank; `count` elements of each are summed
// into out.
void reduce_scatter(DType t, std::size_t count, float scale, int n, const std::vector<const void*>& blocks, void* out);
// All-gather: rank j's `count` elements go to out + j * out_stride elements.
void allgather(DType t, std::size_t count, std::size_t out_stride, int n, const std::vector<const void*>& send,
               void* out);

void copy(void* dst, const void* src, std::size_t bytes);

}  // namespace shardflow::peer
