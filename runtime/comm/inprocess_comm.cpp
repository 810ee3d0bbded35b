// The in-process backend: N ranks are threads of one process and each passes its own buffers.
// Data really moves between the ranks' buffers, with the algorithms the shared-memory backend
// uses too (Note [Peer all-reduce]), reading the peers' own buffers directly.
//
// Note [In-process op protocol]
//   1. entry barrier: every rank has published its op (kind, count, dtype, buffers) in its slot
//      (Note [Parity slots], the same meeting place the one-GPU world uses);
//   2. every rank compares all slots with rank 0's: a mismatch fails the op on every rank alike;
//   3. the data phases, separated by barriers where a rank reads what another rank writes;
//   4. exit barrier: no rank returns (and lets its trainer touch the buffer) while a peer may still
//      be reading that buffer.
// Sums run in rank order, so every rank gets bitwise the same result, whatever the timing.

#include <array>
#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "runtime/comm/barrier.hpp"
#include "runtime/comm/parity_slots.hpp"
#include "runtime/comm/peer_collective.hpp"
#include "runtime/comm/rank_world.hpp"
#include "runtime/comm/stream_worker.hpp"
#include "shardflow/communicator.hpp"
#include "shardflow/errors.hpp"

namespace shardflow {
namespace {

struct Slot {
  CollectiveOp op;
  peer::OpSig sig;
};

class World {
 public:
  World(int n, std::chrono::milliseconds timeout) : n_(n), timeout_(timeout), barrier_(n), slots_(n) {}

  int size() const { return n_; }
  void abort(const std::string& reason) { barrier_.abort(reason); }

  void execute(int rank, const CollectiveOp& op, std::uint64_t seq) {
    const auto parity = std::size_t(seq & 1);
    slots_(rank, parity) = Slot{op, peer::OpSig::of(op, seq)};
    // The slot is read only while this op runs; it must not keep the op's buffers alive after it
    // (a replaced plan's buckets would stay allocated until two more ops came by).
    slots_(rank, parity).op.keep_alive.reset();
    auto what = [&] {
      return "rank " + std::to_string(rank) + ": in-process " + collective_name(op.kind) + " #" +
             std::to_string(seq) + " ('" + op.tag + "')";
    };
    const peer::Sync sync = [&] { barrier_.arrive_and_wait(rank, timeout_, what); };
    try {
      // Counted from before the entry barrier: a peer past it reads every slot at once, and a rank
      // that failed must not go on to write its slot of a later op under that read.
      const Reading reading(readers_);
      check_shift(op, what());  // before the entry barrier: the catch below fails the peers at once
      sync();
      slots_.check_matching(parity, barrier_);
      run(rank, op, parity, sync);
    } catch (...) {
      // Note [No peer reads a failed rank's buffers]
      // Every rank reads its peers' buffers directly. When this op fails (an abort, a timeout,
      // a mismatch: each leaves the barrier aborted), a peer may still be inside its share of the
      // op, reading ours, until it reaches its next sync and fails too. Returning at once let the
      // owner free the buffers under that read (ThreadSanitizer: a recovered rank's snapshot word,
      // freed with its runtime while a peer's allreduce still summed it). So the failure waits
      // until no rank is reading; every reader leaves at its next sync, which now throws (an
      // error of this rank's own, thrown by the work itself, aborts the barrier here first).
      barrier_.abort(what() + ": failed on this rank");  // the first reason stays
      while (readers_.load(std::memory_order_acquire) != 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
      throw;
    }
  }

 private:
  // Ranks inside an op: from its entry barrier to the end of its work on each other's slots and buffers.
  struct Reading {
    explicit Reading(std::atomic<int>& n) : n_(n) { n_.fetch_add(1, std::memory_order_acq_rel); }
    ~Reading() { n_.fetch_sub(1, std::memory_order_acq_rel); }
    std::atomic<int>& n_;
  };

  void run(int rank, const CollectiveOp& op, std::size_t parity, const peer::Sync& sync) {
    std::vector<const void*> send(static_cast<std::size_t>(n_));
    std::vector<void*> recv(static_cast<std::size_t>(n_));
    for (int i = 0; i < n_; ++i) {
      send[std::size_t(i)] = slots_(i, parity).op.send;
      recv[std::size_t(i)] = slots_(i, parity).op.recv;
    }
    const std::size_t es = dtype_size(op.dtype);
    switch (op.kind) {
      case CollectiveKind::barrier:
        return;  // the entry barrier was the whole op
      case CollectiveKind::allreduce:
        peer::allreduce(op.dtype, op.count, op.scale, rank, n_, send, recv, op.recv, sync);
        break;
      case CollectiveKind::reduce_scatter:
        for (auto& b : send) b = static_cast<const char*>(b) + std::size_t(rank) * op.count * es;  // our block
        peer::reduce_scatter(op.dtype, op.count, op.scale, n_, send, op.recv);
        break;
      case CollectiveKind::allgather:
        peer::allgather(op.dtype, op.count, op.count, n_, send, op.recv);
        break;
      case CollectiveKind::broadcast:
        peer::copy(op.recv, send[std::size_t(op.root)], op.count * es);
        break;
      case CollectiveKind::shift:
        peer::copy(op.recv, send[std::size_t(shift_source(rank, n_, op.distance))], op.count * es);
        break;
    }
    sync();  // Note [In-process op protocol] step 4
  }

  const int n_;
  const std::chrono::milliseconds timeout_;
  RankBarrier barrier_;
  ParitySlots<Slot> slots_;  // Note [Parity slots]
  std::atomic<int> readers_{0};
};

class InProcessComm final : public Communicator {
 public:
  InProcessComm(std::shared_ptr<World> world, int rank)
      : world_(std::move(world)), rank_(rank),
        stream_([this](const CollectiveOp& op) { world_->execute(rank_, op, seq_++); }) {}

  ~InProcessComm() override {
    // Peers would otherwise wait for our share of their collective until the timeout.
    if (stream_.busy()) world_->abort("rank " + std::to_string(rank_) + "'s communicator was destroyed with collectives pending");
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_->size(); }
  std::string backend_name() const override { return "in-process"; }
  bool supports(Device d) const override { return d.kind == Device::Kind::cpu; }
  void submit(CollectiveOp op, CollectiveDone done) override { stream_.push(std::move(op), std::move(done)); }
  void abort(const std::string& reason) override { world_->abort("rank " + std::to_string(rank_) + " aborted: " + reason); }

 private:
  std::shared_ptr<World> world_;
  const int rank_;
  std::uint64_t seq_ = 0;  // touched by the stream thread only
  StreamWorker stream_;    // last: its thread uses the members above
};

}  // namespace

std::shared_ptr<InProcessWorld> InProcessWorld::create(int world_size, std::chrono::milliseconds timeout) {
  if (world_size < 1) throw UsageError("InProcessWorld::create: world_size must be >= 1, got " + std::to_string(world_size));
  if (timeout.count() <= 0) throw UsageError("InProcessWorld::create: timeout must be positive");
  return std::make_shared<RankWorld<World, InProcessComm>>(std::make_shared<World>(world_size, timeout));
}

}  // namespace shardflow
