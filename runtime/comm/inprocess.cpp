// The in-process backend: N ranks are threads of one process and each passes its own buffers.
// Data really moves between the ranks' buffers, with the same algorithm shape a shared-memory
// backend uses: every rank reduces one contiguous chunk of the op (so the work is spread over the
// ranks' comm streams), then copies the other ranks' finished chunks.
//
// Note [In-process op protocol]
//   1. entry barrier: every rank has published its op (kind, count, dtype, buffers) in its slot;
//   2. every rank compares all slots with rank 0's: a mismatch fails the op on every rank alike;
//   3. the data phases, separated by barriers where a rank reads what another rank writes;
//   4. exit barrier: no rank returns (and lets its trainer touch the buffer) while a peer may still
//      be reading that buffer.
// Sums run in rank order, so every rank gets bitwise the same result, whatever the timing.

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "kernels/cpu/elementwise.hpp"
#include "runtime/comm/barrier.hpp"
#include "runtime/comm/stream_worker.hpp"
#include "shardflow/communicator.hpp"
#include "shardflow/errors.hpp"

namespace shardflow {
namespace {

struct Slot {
  CollectiveOp op;
  std::uint64_t seq = 0;
};

std::string describe(const Slot& s) {
  return std::string(collective_name(s.op.kind)) + " of " + std::to_string(s.op.count) + " " +
         dtype_name(s.op.dtype) + (s.op.kind == CollectiveKind::broadcast ? " from root " + std::to_string(s.op.root) : "") +
         " ('" + s.op.tag + "')";
}

class World {
 public:
  World(int n, std::chrono::milliseconds timeout) : n_(n), timeout_(timeout), barrier_(n), slots_(std::size_t(n)) {}

  int size() const { return n_; }
  void abort(const std::string& reason) { barrier_.abort(reason); }

  void execute(int rank, const CollectiveOp& op, std::uint64_t seq) {
    slots_[std::size_t(rank)] = Slot{op, seq};
    auto what = [&] {
      return "rank " + std::to_string(rank) + ": in-process " + collective_name(op.kind) + " #" +
             std::to_string(seq) + " ('" + op.tag + "')";
    };
    sync(rank, what);
    check_matching(rank, what);

    const std::size_t esize = dtype_size(op.dtype);
    switch (op.kind) {
      case CollectiveKind::barrier:
        return;  // the entry barrier was the whole op
      case CollectiveKind::allreduce: {
        auto [lo, hi] = chunk(op.count, rank);
        std::vector<const void*> srcs(static_cast<std::size_t>(n_));
        for (int i = 0; i < n_; ++i) srcs[std::size_t(i)] = byte_ptr(slots_[std::size_t(i)].op.send) + lo * esize;
        kernels::reduce_sum(op.dtype, byte_ptr(op.recv) + lo * esize, srcs.data(), n_, hi - lo, op.scale);
        sync(rank, what);
        for (int j = 0; j < n_; ++j) {
          if (j == rank) continue;
          auto [jlo, jhi] = chunk(op.count, j);
          copy(byte_ptr(op.recv) + jlo * esize, byte_ptr(slots_[std::size_t(j)].op.recv) + jlo * esize,
               (jhi - jlo) * esize);
        }
        break;
      }
      case CollectiveKind::reduce_scatter: {
        std::vector<const void*> srcs(static_cast<std::size_t>(n_));
        for (int i = 0; i < n_; ++i)
          srcs[std::size_t(i)] = byte_ptr(slots_[std::size_t(i)].op.send) + std::size_t(rank) * op.count * esize;
        kernels::reduce_sum(op.dtype, op.recv, srcs.data(), n_, op.count, op.scale);
        break;
      }
      case CollectiveKind::allgather:
        for (int j = 0; j < n_; ++j)
          copy(byte_ptr(op.recv) + std::size_t(j) * op.count * esize, slots_[std::size_t(j)].op.send, op.count * esize);
        break;
      case CollectiveKind::broadcast:
        copy(op.recv, slots_[std::size_t(op.root)].op.send, op.count * esize);
        break;
    }
    sync(rank, what);  // Note [In-process op protocol] step 4
  }

 private:
  static char* byte_ptr(void* p) { return static_cast<char*>(p); }
  static const char* byte_ptr(const void* p) { return static_cast<const char*>(p); }
  static void copy(void* dst, const void* src, std::size_t bytes) {
    if (bytes && dst != src) std::memcpy(dst, src, bytes);
  }

  // Rank r's chunk of an allreduce, boundaries aligned to 16 elements (64 bytes of fp32) so that no
  // two ranks write the same cache line.
  std::pair<std::size_t, std::size_t> chunk(std::size_t count, int r) const {
    auto edge = [&](int k) -> std::size_t {
      if (k >= n_) return count;
      return std::min(count, (count * std::size_t(k) / std::size_t(n_)) & ~std::size_t{15});
    };
    return {edge(r), edge(r + 1)};
  }

  template <class What>
  void sync(int rank, const What& what) {
    barrier_.arrive_and_wait(rank, timeout_, what);
  }

  // Every rank runs the same comparison against rank 0, so they all fail together (no rank is left
  // waiting in a data phase the others skipped).
  template <class What>
  void check_matching(int rank, const What& what) {
    const Slot& ref = slots_[0];
    for (int r = 1; r < n_; ++r) {
      const Slot& s = slots_[std::size_t(r)];
      if (s.seq != ref.seq || s.op.kind != ref.op.kind || s.op.count != ref.op.count ||
          s.op.dtype != ref.op.dtype || s.op.root != ref.op.root) {
        const std::string msg = "collective mismatch: rank 0 issued " + describe(ref) + " as op #" +
                                std::to_string(ref.seq) + ", rank " + std::to_string(r) + " issued " +
                                describe(s) + " as op #" + std::to_string(s.seq) +
                                ". Every rank must issue the same collectives in the same order.";
        sync(rank, what);  // everyone has read the slots before anyone leaves
        barrier_.abort(msg);
        throw MismatchError(msg);
      }
    }
    const auto& op = slots_[std::size_t(rank)].op;
    if (op.kind == CollectiveKind::broadcast && (op.root < 0 || op.root >= n_))
      throw UsageError(what() + ": broadcast root " + std::to_string(op.root) + " is not a rank of world " +
                       std::to_string(n_));
  }

  const int n_;
  const std::chrono::milliseconds timeout_;
  RankBarrier barrier_;
  std::vector<Slot> slots_;
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

class InProcessWorldImpl final : public InProcessWorld {
 public:
  InProcessWorldImpl(int n, std::chrono::milliseconds timeout)
      : world_(std::make_shared<World>(n, timeout)), comms_(std::size_t(n)) {}

  int world_size() const override { return world_->size(); }

  std::shared_ptr<Communicator> communicator(int rank) override {
    if (rank < 0 || rank >= world_->size())
      throw UsageError("InProcessWorld::communicator: rank " + std::to_string(rank) + " is outside world size " +
                       std::to_string(world_->size()));
    std::lock_guard lock(mu_);
    auto& c = comms_[std::size_t(rank)];
    if (!c) c = std::make_shared<InProcessComm>(world_, rank);
    return c;
  }

 private:
  std::shared_ptr<World> world_;
  std::mutex mu_;
  std::vector<std::shared_ptr<Communicator>> comms_;
};

}  // namespace

std::shared_ptr<InProcessWorld> InProcessWorld::create(int world_size, std::chrono::milliseconds timeout) {
  if (world_size < 1) throw UsageError("InProcessWorld::create: world_size must be >= 1, got " + std::to_string(world_size));
  if (timeout.count() <= 0) throw UsageError("InProcessWorld::create: timeout must be positive");
  return std::make_shared<InProcessWorldImpl>(world_size, timeout);
}

}  // namespace shardflow
