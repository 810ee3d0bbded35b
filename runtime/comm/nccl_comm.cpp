// The NCCL backend (shardflow/nccl.hpp). NCCL does the data movement; this file adds what a
// runtime needs around it: ordered enqueueing on the comm stream after the producer's event, a
// deadline on every op, asynchronous-error polling, and abort that really unblocks the GPU.
//
// Note [Non-blocking NCCL]
// The communicator is created with config.blocking = 0: init and every call may return
// ncclInProgress and finish in the background. That is what makes init bounded (a peer that never
// joins would otherwise hang ncclCommInitRank forever) and lets ncclCommAbort from the watcher
// thread interrupt an enqueue that waits on a dead peer. Each call is followed by `settle`, which
// polls ncclCommGetAsyncError until the call's work is enqueued, with the timeout.
#include "shardflow/nccl.hpp"

#include "shardflow/errors.hpp"

#ifdef SHARDFLOW_WITH_NCCL
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "kernels/cpu/dtype.hpp"
#include "kernels/cuda/device.hpp"
#include "runtime/comm/device_comm.hpp"
#endif

namespace shardflow {

#ifndef SHARDFLOW_WITH_NCCL

bool nccl_compiled() { return false; }
std::shared_ptr<Communicator> make_nccl_communicator(const NcclOptions&) {
  throw UsageError("backend nccl: shardflow was built without NCCL (configure with the CUDA toolkit and libnccl under "
                   "/usr/local/cuda, SHARDFLOW_CUDA=ON)");
}

#else

namespace {

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::bf16: return ncclBfloat16;
    case DType::f16: return ncclFloat16;
    default: return ncclFloat32;
  }
}

class NcclComm final : public DeviceComm {
 public:
  NcclComm(const NcclOptions& o, int device)
      : DeviceComm(o.rank, o.world_size, device, o.timeout, "nccl") {
    // Rank 0 makes the id; everyone reads it from the store (bounded by the store's timeout).
    ncclUniqueId id{};
    {
      const auto client = connect_store(o);
      PrefixStore store(*client, o.key_prefix);
      if (o.rank == 0) {
        check(ncclGetUniqueId(&id), "ncclGetUniqueId");
        store.set("unique_id", std::string(reinterpret_cast<const char*>(&id), sizeof(id)));
      } else {
        const std::string v = store.get("unique_id");
        if (v.size() != sizeof(id))
          throw CommError(who() + ": the NCCL unique id in the store has " + std::to_string(v.size()) + " bytes, expected " +
                          std::to_string(sizeof(id)));
        std::memcpy(&id, v.data(), sizeof(id));
      }
    }
    cuda::set_device(device);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // Note [Non-blocking NCCL]
    ncclComm_t c = nullptr;
    const ncclResult_t r = ncclCommInitRankConfig(&c, o.world_size, id, o.rank, &config);
    comm_ = c;
    try {
      settle(r, "ncclCommInitRankConfig (waiting for all " + std::to_string(o.world_size) + " ranks to join)");
    } catch (...) {
      if (comm_) ncclCommAbort(comm_);
      comm_ = nullptr;
      throw;
    }
    start();
  }

  ~NcclComm() override {
    stop();
    std::lock_guard lock(mu_);
    if (!comm_) return;
    // Flush, then free; an unfinished flush (a dead peer) falls back to abort.
    try {
      settle(ncclCommFinalize(comm_), "ncclCommFinalize");
      ncclCommDestroy(comm_);
    } catch (const std::exception&) {
      ncclCommAbort(comm_);
    }
    comm_ = nullptr;
  }

 private:
  void enqueue(const CollectiveOp& op, std::uint64_t, cuda::Stream s) override {
    std::lock_guard lock(mu_);
    if (!comm_) throw CommError(who() + ": " + op.tag + ": the communicator was aborted");
    auto* stream = static_cast<cudaStream_t>(s);
    const auto type = nccl_type(op.dtype);
    const std::string what = std::string(collective_name(op.kind)) + " '" + op.tag + "'";
    switch (op.kind) {
      case CollectiveKind::barrier: {
        // NCCL has no barrier: an all-reduce of one float in scratch of its own does the job.
        if (!barrier_buf_) barrier_buf_ = cuda::device_alloc(device(), sizeof(float));
        settle(ncclAllReduce(barrier_buf_.get(), barrier_buf_.get(), 1, ncclFloat32, ncclSum, comm_, stream), what);
        return;
      }
      case CollectiveKind::allreduce:
      case CollectiveKind::reduce_scatter: {
        ReduceOp red(*this, op);
        const auto r = op.kind == CollectiveKind::allreduce
                           ? ncclAllReduce(op.send, op.recv, op.count, type, red.op, comm_, stream)
                           : ncclReduceScatter(op.send, op.recv, op.count, type, red.op, comm_, stream);
        settle(r, what);
        return;
      }
      case CollectiveKind::allgather:
        settle(ncclAllGather(op.send, op.recv, op.count, type, comm_, stream), what);
        return;
      case CollectiveKind::broadcast:
        settle(ncclBroadcast(op.send, op.recv, op.count, type, op.root, comm_, stream), what);
        return;
      case CollectiveKind::shift: {
        // Note [Shift]: a send and a receive in one group, so that neither waits for the other.
        const int to = (rank() + op.distance % world_size() + world_size()) % world_size();
        const int from = shift_source(rank(), world_size(), op.distance);
        if (to == rank()) {
          cuda::memcpy_async(op.recv, op.send, op.count * dtype_size(op.dtype), s);
          return;
        }
        settle(ncclGroupStart(), what);
        const auto sent = ncclSend(op.send, op.count, type, to, comm_, stream);
        const auto received = ncclRecv(op.recv, op.count, type, from, comm_, stream);
        const auto ended = ncclGroupEnd();
        settle(sent, what + " (its send to rank " + std::to_string(to) + ")");
        settle(received, what + " (its receive from rank " + std::to_string(from) + ")");
        settle(ended, what);
        return;
      }
    }
  }

  // The scale fused into the reduction: 1 is a sum, 1/world NCCL's average, anything else a
  // pre-multiplied sum (each input scaled before it is summed) with the scalar in the op's type.
  struct ReduceOp {
    NcclComm& c;
    ncclRedOp_t op = ncclSum;
    bool custom = false;
    ReduceOp(NcclComm& comm, const CollectiveOp& x) : c(comm) {
      if (x.scale == 1.0f) return;
      if (x.scale == 1.0f / float(c.world_size())) {
        op = ncclAvg;
        return;
      }
      float f = x.scale;
      std::uint16_t h = x.dtype == DType::bf16 ? kernels::f32_to_bf16(f) : kernels::f32_to_f16(f);
      void* scalar = x.dtype == DType::f32 ? static_cast<void*>(&f) : static_cast<void*>(&h);
      c.settle(ncclRedOpCreatePreMulSum(&op, scalar, nccl_type(x.dtype), ncclScalarHostImmediate, c.comm_),
               "ncclRedOpCreatePreMulSum");
      custom = true;
    }
    ~ReduceOp() {
      if (custom && c.comm_) ncclRedOpDestroy(op, c.comm_);  // allowed once the op using it returned
    }
  };

  void abort_backend(const std::string&) override {
    aborting_.store(true);
    std::lock_guard lock(mu_);
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  std::optional<std::string> health() override {
    std::unique_lock lock(mu_, std::try_to_lock);  // the enqueue thread holds it only briefly
    if (!lock.owns_lock() || !comm_) return std::nullopt;
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &async) != ncclSuccess || async == ncclSuccess || async == ncclInProgress)
      return std::nullopt;
    return std::string("NCCL reports ") + ncclGetErrorString(async) + ": " + last_error();
  }

  std::string last_error() const {
    const char* e = comm_ ? ncclGetLastError(comm_) : ncclGetLastError(nullptr);
    return e && *e ? e : "(no detail)";
  }

  static void check(ncclResult_t r, const std::string& what) {
    if (r != ncclSuccess) throw CommError(what + " failed: " + ncclGetErrorString(r));
  }

  // Note [Non-blocking NCCL]: waits (bounded) until the call's work is enqueued.
  void settle(ncclResult_t r, const std::string& what) {
    const auto deadline = std::chrono::steady_clock::now() + timeout();
    while (r == ncclInProgress) {
      if (aborting_.load()) throw CommError(who() + ": " + what + ": aborted");
      if (std::chrono::steady_clock::now() > deadline)
        throw TimeoutError(who() + ": " + what + " did not finish within " + std::to_string(timeout().count()) +
                           " ms (a peer is missing, stuck or dead)");
      std::this_thread::sleep_for(std::chrono::microseconds(20));
      if (ncclCommGetAsyncError(comm_, &r) != ncclSuccess) break;
    }
    if (r != ncclSuccess) throw CommError(who() + ": " + what + " failed: " + ncclGetErrorString(r) + ": " + last_error());
  }

  std::mutex mu_;  // comm_ between the enqueue thread, the watcher's health check and abort
  ncclComm_t comm_ = nullptr;
  std::atomic<bool> aborting_{false};
  std::shared_ptr<std::byte> barrier_buf_;
};

}  // namespace

bool nccl_compiled() { return true; }

std::shared_ptr<Communicator> make_nccl_communicator(const NcclOptions& o) {
  if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size)
    throw UsageError("nccl: rank " + std::to_string(o.rank) + " is outside world size " + std::to_string(o.world_size));
  const int devices = cuda::device_count();
  if (devices == 0)
    throw UsageError("nccl: rank " + std::to_string(o.rank) + " sees no CUDA device (" + cuda::describe() +
                     "); use backend shm or gloo on CPUs");
  const int device = o.device >= 0 ? o.device : o.rank % devices;
  if (device >= devices)
    throw UsageError("nccl: rank " + std::to_string(o.rank) + " asked for cuda:" + std::to_string(device) + " but sees " +
                     std::to_string(devices) + " device(s)");
  return std::make_shared<NcclComm>(o, device);
}

#endif

}  // namespace shardflow
