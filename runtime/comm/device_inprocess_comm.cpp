// The in-process backend over the memory of one GPU: N ranks are threads of one process, each with
// its own comm stream, and the data moves between their device buffers with kernels and copies
// enqueued on those streams. This is how a machine with one GPU runs N ranks (NCCL refuses two
// ranks on one device), with the same overlap of collectives, compute and each other as N GPUs.
//
// Note [Device in-process protocol]
// The host only coordinates *enqueueing*; the GPU orders the data with events:
//   1. each rank records `in` on its stream (its inputs are ready there) and publishes the op;
//      host barrier; every rank compares the ops (MismatchError on all ranks alike);
//   2. each rank's stream waits for every peer's `in`, then runs its data phase(s) reading the
//      peers' buffers (all-reduce: reduce own chunk, record `mid`, barrier, wait peers' `mid`,
//      copy the other chunks — Note [Peer all-reduce]);
//   3. each rank records `out`; barrier; its stream waits for every peer's `out`, so its own
//      buffers are not released (the completion event) while a peer's kernel may still read them.
// An event is re-recorded only two ops later (slots by op parity), after barriers every peer
// passes only once it has enqueued its waits on the previous recording.

#include <array>
#include <memory>
#include <vector>

#include "kernels/cuda/device.hpp"
#include "kernels/cuda/stream.hpp"
#include "runtime/comm/barrier.hpp"
#include "runtime/comm/parity_slots.hpp"
#include "runtime/comm/device_comm.hpp"
#include "runtime/comm/peer_collective.hpp"
#include "runtime/comm/rank_world.hpp"
#include "shardflow/communicator.hpp"
#include "shardflow/errors.hpp"

#ifdef SHARDFLOW_WITH_CUDA_KERNELS
#include "kernels/cuda/collective.cuh"
#endif

namespace shardflow {
namespace {

struct DevSlot {
  CollectiveOp op;
  peer::OpSig sig;
  cuda::Event in = nullptr, mid = nullptr, out = nullptr;
};

class DeviceWorld {
 public:
  DeviceWorld(int n, int device, std::chrono::milliseconds timeout)
      : n_(n), device_(device), timeout_(timeout), barrier_(n), slots_(n) {}

  ~DeviceWorld() {
    for (auto& rank : slots_)
      for (auto& s : rank)
        for (auto e : {s.in, s.mid, s.out}) cuda::event_destroy(e);
  }

  int size() const { return n_; }
  int device() const { return device_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  void abort(const std::string& reason) { barrier_.abort(reason); }

  // Events of rank r, created by rank r's enqueue thread (the device is current there).
  void create_events(int rank) {
    for (auto& s : slots_.of_rank(rank)) {
      s.in = cuda::event_create(device_);
      s.mid = cuda::event_create(device_);
      s.out = cuda::event_create(device_);
    }
  }

  void enqueue(int rank, const CollectiveOp& op, std::uint64_t seq, cuda::Stream stream) {
    const auto parity = std::size_t(seq & 1);
    auto& mine = slots_(rank, parity);
    if (!mine.in) create_events(rank);
    mine.op = op;
    mine.sig = peer::OpSig::of(op, seq);
    cuda::event_record(mine.in, stream);
    auto what = [&] {
      return "rank " + std::to_string(rank) + ": in-process (cuda:" + std::to_string(device_) + ") " +
             collective_name(op.kind) + " #" + std::to_string(seq) + " ('" + op.tag + "')";
    };
    auto sync = [&] { barrier_.arrive_and_wait(rank, timeout_, what); };
    auto wait_peers = [&](cuda::Event DevSlot::*which) {
      for (int i = 0; i < n_; ++i)
        if (i != rank) cuda::stream_wait_event(stream, slots_(i, parity).*which);
    };
    sync();
    slots_.check_matching(parity, barrier_);
    wait_peers(&DevSlot::in);

    const std::size_t es = dtype_size(op.dtype);
    auto peer_op = [&](int i) -> const CollectiveOp& { return slots_(i, parity).op; };
    auto at = [](const void* p, std::size_t off) { return static_cast<const std::byte*>(p) + off; };
    switch (op.kind) {
      case CollectiveKind::barrier:
        break;
      case CollectiveKind::allreduce: {
        const auto [lo, hi] = peer::chunk(op.count, n_, rank);
        reduce(op, [&](int i) { return at(peer_op(i).send, lo * es); }, static_cast<std::byte*>(op.recv) + lo * es,
               hi - lo, stream);
        cuda::event_record(mine.mid, stream);
        sync();
        wait_peers(&DevSlot::mid);
        for (int j = 0; j < n_; ++j) {
          if (j == rank) continue;
          const auto [jlo, jhi] = peer::chunk(op.count, n_, j);
          cuda::memcpy_async(static_cast<std::byte*>(op.recv) + jlo * es, at(peer_op(j).recv, jlo * es), (jhi - jlo) * es,
                             stream);
        }
        break;
      }
      case CollectiveKind::reduce_scatter:
        reduce(op, [&](int i) { return at(peer_op(i).send, std::size_t(rank) * op.count * es); }, op.recv, op.count,
               stream);
        break;
      case CollectiveKind::allgather:
        for (int j = 0; j < n_; ++j)
          if (static_cast<std::byte*>(op.recv) + std::size_t(j) * op.count * es != peer_op(j).send)
            cuda::memcpy_async(static_cast<std::byte*>(op.recv) + std::size_t(j) * op.count * es, peer_op(j).send,
                               op.count * es, stream);
        break;
      case CollectiveKind::broadcast:
        if (rank != op.root) cuda::memcpy_async(op.recv, peer_op(op.root).send, op.count * es, stream);
        else if (op.recv != op.send) cuda::memcpy_async(op.recv, op.send, op.count * es, stream);
        break;
      case CollectiveKind::shift:
        if (op.count) cuda::memcpy_async(op.recv, peer_op(shift_source(rank, n_, op.distance)).send, op.count * es, stream);
        break;
    }
    cuda::event_record(mine.out, stream);
    sync();
    wait_peers(&DevSlot::out);
  }

 private:
  template <class Src>
  void reduce(const CollectiveOp& op, Src src, void* out, std::size_t count, cuda::Stream stream) {
#ifdef SHARDFLOW_WITH_CUDA_KERNELS
    cuda::PeerPtrs p{};
    for (int i = 0; i < n_; ++i) p.p[i] = src(i);
    cuda::launch_reduce_peers(op.dtype, p, n_, out, count, op.scale, static_cast<cudaStream_t>(stream));
#else
    throw CommError("in-process on cuda: shardflow was built without CUDA kernels");
#endif
  }

  const int n_, device_;
  const std::chrono::milliseconds timeout_;
  RankBarrier barrier_;
  ParitySlots<DevSlot> slots_;  // Note [Parity slots]
};

class DeviceInProcessComm final : public DeviceComm {
 public:
  DeviceInProcessComm(std::shared_ptr<DeviceWorld> world, int rank)
      : DeviceComm(rank, world->size(), world->device(), world->timeout(), "in-process"), world_(std::move(world)) {
    start();
  }
  ~DeviceInProcessComm() override { stop(); }

 private:
  void enqueue(const CollectiveOp& op, std::uint64_t seq, cuda::Stream stream) override {
    world_->enqueue(rank(), op, seq, stream);
  }
  void abort_backend(const std::string& reason) override {
    world_->abort("rank " + std::to_string(rank()) + " aborted: " + reason);
  }

  std::shared_ptr<DeviceWorld> world_;
};

}  // namespace

std::shared_ptr<InProcessWorld> InProcessWorld::create_on_device(int world_size, int device,
                                                                 std::chrono::milliseconds timeout) {
  if (world_size < 1 || world_size > 16)
    throw UsageError("InProcessWorld::create_on_device: world_size must be 1..16, got " + std::to_string(world_size));
  if (timeout.count() <= 0) throw UsageError("InProcessWorld::create_on_device: timeout must be positive");
  const int devices = cuda::device_count();
  if (device < 0 || device >= devices)
    throw UsageError("InProcessWorld::create_on_device: cuda:" + std::to_string(device) + " does not exist (" +
                     std::to_string(devices) + " CUDA device(s) visible: " + cuda::describe() + ")");
  return std::make_shared<RankWorld<DeviceWorld, DeviceInProcessComm>>(std::make_shared<DeviceWorld>(world_size, device, timeout));
}

}  // namespace shardflow
