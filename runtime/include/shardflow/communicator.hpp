// The collective backend interface. Every backend (in-process threads, Gloo, shared memory, NCCL)
// implements it; the actors only ever talk to this.
//
// Note [Ordered asynchronous collectives]
// submit() returns at once. Operations run in submission order on the rank's comm stream (a worker
// thread for CPU backends, a CUDA stream for NCCL), and `done` is invoked when the operation has
// completed on this rank — from the stream's thread, never from the caller's. Every rank must
// submit the same operations in the same order; backends check what they can (kind, count, dtype)
// and report a MismatchError rather than silently mixing buffers. A buffer handed to submit() must
// not be touched until `done` has run: that is when the backend releases it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <string>

#include "shardflow/types.hpp"

namespace shardflow {

struct CollectiveOp {
  CollectiveKind kind = CollectiveKind::allreduce;
  DType dtype = DType::f32;
  // allreduce: count elements, send == recv allowed (in place).
  // reduce_scatter: send holds world*count elements, recv receives this rank's `count`.
  // allgather: send holds count elements, recv receives world*count (rank-major).
  // broadcast: count elements from `root`'s send into everyone's recv (send == recv allowed).
  // shift: count elements from rank (rank - distance) mod world's send into this rank's recv, so
  //   this rank's send goes to rank (rank + distance) mod world (Note [Shift]); send != recv.
  const void* send = nullptr;
  void* recv = nullptr;
  std::size_t count = 0;
  int root = 0;
  // Sums are multiplied by this before they are written out: averaging (1/world) is fused into
  // the reduction rather than a separate pass over memory.
  float scale = 1.0f;
  std::string tag;  // what the op is for ("bucket 3"): errors and traces name it
  // Held by the backend until `done` has run, so the buffers cannot be freed under a collective
  // even if their owner goes away mid-iteration.
  std::shared_ptr<const void> keep_alive;
  // Device backends (nccl, in-process on a GPU): a cudaEvent_t recorded on the stream that produced
  // `send` (the trainer's compute stream). The backend's comm stream waits for it on the device
  // before the collective runs: the host never synchronises. CPU backends ignore it (there the
  // host has already finished writing). Only needs to stay valid until submit() returns.
  void* wait_event = nullptr;
  int distance = 0;  // shift: how many ranks on each rank's data moves (any integer, taken mod world)
  // shift, on a backend that shifts_unequal(op.in_host): the elements this rank receives when they differ
  // from the `count` it sends (the source's `count` must be this). kSameCount: `count`.
  static constexpr std::size_t kSameCount = ~std::size_t{0};
  std::size_t recv_count = kSameCount;
  // allgather, on a backend whose in_host_ranks() is nonzero: every rank's recv already holds
  // the block of its own local index from every host, and only the gathers inside each host run
  // (Note [Syncs from the twin, two levels]). Elsewhere it is ignored: the whole all-gather runs
  // from `send`, which gives the same bytes.
  // shift, on such a backend only: a shift inside each host (Note [Shift]), local rank l's send
  // to local rank (l + distance) mod L of the same host, nothing between the hosts. Elsewhere
  // refused: it would move other blocks than asked. Any other kind: refused.
  bool in_host = false;
};

// Note [Shift]
// A cyclic shift of one block per rank (MPI's Sendrecv along a ring of stride `distance`, XLA's
// collective permute of a rotation): what a rank hands to one peer and takes from another at the
// same time, one block each way per rank on the wire: what a mirrored shard needs (its reduced
// gradient slice handed to its twin `distance` ranks on, on another host). Every rank's data moves by
// the same distance, so every rank issues the same op and the collectives stay ordered
// (Note [Ordered asynchronous collectives]). Not in place: a rank's send is read by its
// successor while the rank's recv is written from its predecessor.
// The source of `rank`'s block in a shift by `distance` over `world` ranks.
int shift_source(int rank, int world, int distance);
// A shift whose send is its recv, or one that receives another count than it sends on a backend
// that cannot (`unequal`: it can), or a recv_count on another kind of op: UsageError naming `who`
// and the op (every backend checks every op).
// A shift inside the hosts (CollectiveOp::in_host) where `in_host` is false, or in_host on a kind
// other than a shift or an all-gather: refused too.
void check_shift(const CollectiveOp& op, const std::string& who, bool unequal = false, bool in_host = false);
// The elements a shift receives on this rank.
inline std::size_t shift_recv_count(const CollectiveOp& op) { return op.recv_count == CollectiveOp::kSameCount ? op.count : op.recv_count; }

// The bytes a collective moves as a whole: the buffer (all-reduce, broadcast), the full unscattered
// or gathered buffer (reduce-scatter, all-gather: world * count elements).
std::size_t collective_bytes(const CollectiveOp& op, int world);
// The bytes one rank puts on the link for the collective under bandwidth-optimal (ring)
// algorithms, averaged over the ranks: 2 (world - 1) / world of an all-reduce's buffer, (world - 1)
// / world of a reduce-scatter's, all-gather's or broadcast's full buffer, a shift's block once (none
// when it moves by a multiple of the world: a local copy). What a slow link charges
// for: a ZeRO stage that reduce-scatters and all-gathers moves what an all-reduce moves.
std::size_t wire_bytes(const CollectiveOp& op, int world);

// nullptr on success; otherwise the reason (TimeoutError, MismatchError, CommError).
using CollectiveDone = std::function<void(std::exception_ptr)>;

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string backend_name() const = 0;
  // Whether this backend can reduce buffers that live on `d`.
  virtual bool supports(Device d) const = 0;
  // Zeroed, 64-byte aligned host memory that this backend moves without an extra copy: the shm
  // backend hands out shared memory its peers map, so a collective on it reads the peers' bytes
  // in place instead of staging them. Any buffer works with submit(); these are just faster.
  // The runtime allocates its bucket buffers here. Default: ordinary memory.
  virtual std::shared_ptr<std::byte> allocate(std::size_t bytes);
  virtual void submit(CollectiveOp op, CollectiveDone done) = 0;
  // Whether a shift by `distance` ranks runs here (Note [Shift]). Two levels move only whole
  // hosts; every other backend moves any distance. Ask before submitting one that may not.
  virtual bool shifts_by(int distance) const {
    (void)distance;
    return true;
  }
  // Whether a shift may receive another count than it sends (CollectiveOp::recv_count): Gloo can,
  // so that nothing is padded on its link; the others pad (a copy in memory for the in-process
  // and shm backends). `in_host`: a shift inside each host (CollectiveOp::in_host). Two levels
  // answer for each of their levels: Gloo's lanes move the shifts by whole hosts, unequal, and
  // shared memory the shifts inside a host, padded.
  virtual bool shifts_unequal(bool in_host = false) const {
    (void)in_host;
    return false;
  }
  // The ranks a host when an all-gather or a shift can run inside the hosts alone
  // (CollectiveOp::in_host): two levels. 0: every collective is the whole world's.
  virtual int in_host_ranks() const { return 0; }
  // This rank gives up (a usage error, a failed peer): pending and future collectives of every
  // rank fail promptly with `reason` instead of waiting for the timeout.
  virtual void abort(const std::string& reason) = 0;

  // Convenience for non-actor callers (set-up, trainers): submit and wait, rethrowing failures.
  // The wait is bounded by `timeout` plus a grace period: the backend reports its own timeout first.
  void run(CollectiveOp op, std::chrono::milliseconds timeout);
  // The same in two halves, for a caller that keeps several in flight (their buffers must outlive
  // the wait): submitted now, in order with every other op of this communicator; and its end.
  // `what` names the op in the timeout's message (collective_name and tag: started's).
  struct Started {
    std::future<void> done;
    std::string what;
  };
  Started start(CollectiveOp op);
  void wait(Started& op, std::chrono::milliseconds timeout);
};

// N ranks as threads of one process; each rank passes its own buffers. Create the world once and
// hand communicator(r) to the thread playing rank r.
class InProcessWorld {
 public:
  static std::shared_ptr<InProcessWorld> create(int world_size,
                                                std::chrono::milliseconds timeout = std::chrono::minutes(10));
  // The same over the memory of one GPU (NCCL refuses two ranks on one device): each rank has its
  // own CUDA stream, reads its peers' device buffers with kernels, and waits for them with events,
  // so the ranks' collectives overlap each other and compute as they would on N GPUs. Buffers must
  // be device memory (Communicator::allocate hands some out); host buffers are staged.
  static std::shared_ptr<InProcessWorld> create_on_device(int world_size, int device,
                                                          std::chrono::milliseconds timeout = std::chrono::minutes(10));
  virtual ~InProcessWorld() = default;
  virtual int world_size() const = 0;
  virtual std::shared_ptr<Communicator> communicator(int rank) = 0;
};

}  // namespace shardflow
