// The Gloo backend. Gloo's collectives block, so they run on the rank's StreamWorker (the CPU comm
// stream), never on a CAF or trainer thread. Gloo sums; the average is applied right after on the
// same thread (Gloo's algorithms take no scale). Gloo's all-reduce and all-gather are rings already;
// its new-style API has no reduce-scatter, so that one is ours (runtime/comm/gloo_ring.hpp).
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/pair.h>
#include <gloo/transport/tcp/device.h>

#include <signal.h>

#include <atomic>
#include <cstring>
#include <vector>

#include "kernels/cpu/dtype.hpp"
#include "kernels/cpu/elementwise.hpp"
#include "runtime/comm/gloo_ring.hpp"
#include "runtime/comm/stream_worker.hpp"
#include "shardflow/errors.hpp"
#include "shardflow/gloo.hpp"
#include "shardflow/store.hpp"

namespace shardflow {
namespace {

// Gloo's rendezvous on the shardflow store.
class StoreAdapter final : public gloo::rendezvous::Store {
 public:
  StoreAdapter(std::unique_ptr<shardflow::Store> client, std::string prefix, std::chrono::milliseconds timeout)
      : client_(std::move(client)), prefix_(std::move(prefix)), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    client_->set(prefix_ + key, std::string(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    const auto v = client_->get(prefix_ + key);
    return {v.begin(), v.end()};
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> full;
    for (const auto& k : keys) full.push_back(prefix_ + k);
    client_->wait(full, timeout);
  }

 private:
  std::unique_ptr<shardflow::Store> client_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
};

// Reduce functions for Gloo: fp32 natively, 16-bit through fp32 (each pairwise sum rounds once).
template <class Load, class Store>
void sum16(void* c, const void* a, const void* b, size_t n, Load load, Store store) {
  auto* out = static_cast<std::uint16_t*>(c);
  const auto* x = static_cast<const std::uint16_t*>(a);
  const auto* y = static_cast<const std::uint16_t*>(b);
  for (size_t i = 0; i < n; ++i) out[i] = store(load(x[i]) + load(y[i]));
}
void sum_bf16(void* c, const void* a, const void* b, size_t n) { sum16(c, a, b, n, kernels::bf16_to_f32, kernels::f32_to_bf16); }
void sum_f16(void* c, const void* a, const void* b, size_t n) { sum16(c, a, b, n, kernels::f16_to_f32, kernels::f32_to_f16); }
void sum_f32(void* c, const void* a, const void* b, size_t n) {
  auto* out = static_cast<float*>(c);
  const auto* x = static_cast<const float*>(a);
  const auto* y = static_cast<const float*>(b);
  for (size_t i = 0; i < n; ++i) out[i] = x[i] + y[i];
}

class GlooComm final : public Communicator {
 public:
  explicit GlooComm(const GlooOptions& o)
      : rank_(o.rank), world_(o.world_size), timeout_(o.timeout), stream_([this](const CollectiveOp& op) { execute(op); }) {
    if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size)
      throw UsageError("gloo: rank " + std::to_string(o.rank) + " is outside world size " + std::to_string(o.world_size));
    auto client = connect_store(o);
    StoreAdapter store(std::move(client), o.key_prefix, o.timeout);
    gloo::transport::tcp::attr attr;
    attr.hostname = o.hostname;
    auto device = gloo::transport::tcp::CreateDevice(attr);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(o.rank, o.world_size);
    ctx->setTimeout(o.timeout);
    try {
      ctx->connectFullMesh(store, device);
    } catch (const std::exception& e) {
      throw CommError("gloo: rank " + std::to_string(o.rank) + " could not connect to its " +
                      std::to_string(o.world_size - 1) + " peer(s): " + e.what());
    }
    context_ = std::move(ctx);
    ring_ = std::make_unique<GlooRing>(context_, timeout_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string backend_name() const override { return "gloo"; }
  bool supports(Device d) const override { return d.kind == Device::Kind::cpu; }
  // GlooRing::shift posts each side's own count; a shift inside the hosts is not Gloo's to run.
  bool shifts_unequal(bool in_host) const override { return !in_host; }
  void submit(CollectiveOp op, CollectiveDone done) override { stream_.push(std::move(op), std::move(done)); }
  // Gloo cannot interrupt a collective in progress; later ones fail at once. Peers learn of a dead
  // process from its closed connections, so an abort closes this rank's connections too: a peer
  // blocked on this rank fails now instead of at its timeout. That matters when the ranks recover
  // in place (Note [Recovering in place]): a survivor that abandons the old round must not leave
  // another survivor waiting on it for the whole collective timeout while the new round's
  // rendezvous times out without it (seen at world 3: rank 0 waited on rank 2, which had moved on).
  //
  // Note [A failed op closes this rank's connections]
  // The abort also comes at once from the op that failed, on the stream's thread, not only when
  // the runtime hears of the failure (record_failure, at the trainer's next wait or request).
  // recover() aborts the old communicator only after the next round's one is made, so a survivor
  // that reached the next round's rendezvous before its runtime recorded the failure left its old
  // connections open, and a peer blocked on it in the old round waited the whole timeout. Seen in
  // test_actor_api's shrinking case over Gloo, world 3, rank 0 killed (2 runs in 32 with both
  // cores busy; 0 in 80 after): rank 1 held 20 s (the run's timeout) in reduce_scatter #56, rank 0
  // being dead, so on rank 2, while rank 2 waited 20 s in the new round for rank 1's key. Rank 2
  // printed no "this round ended" of its own, so how it heard of the loss is not known. After a
  // failed op the Gloo context is not usable anyway: a pair's state after an error or a timeout
  // is unknown.
  void abort(const std::string& reason) override {
    {
      std::lock_guard lock(abort_mu_);
      if (aborted_) return;
      abort_reason_ = reason;
      aborted_ = true;
    }
    for (int r = 0; r < world_; ++r)
      if (r != rank_)
        if (auto& pair = context_->getPair(r)) pair->close();
  }

 private:
  void execute(const CollectiveOp& op) {
    {
      std::lock_guard lock(abort_mu_);
      if (aborted_) throw CommError("gloo rank " + std::to_string(rank_) + ": " + op.tag + ": aborted: " + abort_reason_);
    }
    check_shift(op, "gloo rank " + std::to_string(rank_), /*unequal=*/true);
    const std::size_t es = dtype_size(op.dtype);
    const auto tag = std::uint32_t(seq_++);
    try {
      switch (op.kind) {
        case CollectiveKind::barrier: {
          gloo::BarrierOptions o(context_);
          o.setTag(tag);
          o.setTimeout(timeout_);
          gloo::barrier(o);
          return;
        }
        case CollectiveKind::allreduce:
          if (op.send != op.recv && op.count) std::memcpy(op.recv, op.send, op.count * es);
          allreduce(op.recv, op.count, op.dtype, tag);
          if (op.scale != 1.0f) kernels::scale(op.dtype, op.recv, op.count, op.scale);
          return;
        case CollectiveKind::reduce_scatter:
          // A ring on Gloo's unbound buffers (Note [Ring reduce-scatter]): (world - 1) / world of
          // the buffer each way, half of what an all-reduce of a copy moved.
          ring_->reduce_scatter(op.send, op.recv, op.count, op.dtype, op.scale, tag);
          return;
        case CollectiveKind::allgather:
          ring_->allgather(op.send, op.recv, op.count, op.dtype, tag);
          return;
        case CollectiveKind::shift:
          ring_->shift(op.send, op.count, op.recv, shift_recv_count(op), op.dtype, op.distance, tag);
          return;
        case CollectiveKind::broadcast: {
          if (op.count == 0) return;
          gloo::BroadcastOptions o(context_);
          // In place at the root: no input. With one, Gloo sends from it and meanwhile memcpys it onto
          // the output, the same bytes, while its I/O thread reads them (ThreadSanitizer's report).
          if (rank_ == op.root && op.send != op.recv)
            o.setInput(const_cast<std::uint8_t*>(static_cast<const std::uint8_t*>(op.send)), op.count * es);
          o.setOutput(static_cast<std::uint8_t*>(op.recv), op.count * es);
          o.setRoot(op.root);
          o.setTag(tag);
          o.setTimeout(timeout_);
          gloo::broadcast(o);
          return;
        }
      }
    } catch (const Error& e) {
      abort(e.what());  // Note [A failed op closes this rank's connections]
      throw;
    } catch (const std::exception& e) {
      const std::string what = e.what();
      const std::string msg = "gloo rank " + std::to_string(rank_) + ": " + collective_name(op.kind) + " #" +
                              std::to_string(tag) + " ('" + op.tag + "') failed: " + what;
      abort(msg);  // Note [A failed op closes this rank's connections]
      if (what.find("imed out") != std::string::npos || what.find("imeout") != std::string::npos) {
        // Gloo does not say which peer it waited for; with two ranks there is only one.
        const std::string peer = world_ == 2 ? "rank " + std::to_string(1 - rank_) : "a peer";
        throw TimeoutError(msg + " (" + peer + " did not answer within Config::timeouts.collective)");
      }
      throw CommError(msg);
    }
  }

  void allreduce(void* buf, std::size_t count, DType t, std::uint32_t tag) {
    if (count == 0) return;
    gloo::AllreduceOptions o(context_);
    // Gloo sizes elements by the output pointer's type; the reduce function matches it.
    switch (t) {
      case DType::f32:
        o.setOutput(static_cast<float*>(buf), count);
        o.setReduceFunction(&sum_f32);
        break;
      case DType::bf16:
        o.setOutput(static_cast<std::uint16_t*>(buf), count);
        o.setReduceFunction(&sum_bf16);
        break;
      case DType::f16:
        o.setOutput(static_cast<std::uint16_t*>(buf), count);
        o.setReduceFunction(&sum_f16);
        break;
    }
    o.setTag(tag);
    o.setTimeout(timeout_);
    gloo::allreduce(o);
  }

  const int rank_, world_;
  const std::chrono::milliseconds timeout_;
  std::shared_ptr<gloo::Context> context_;
  std::unique_ptr<GlooRing> ring_;  // stream thread only
  std::uint64_t seq_ = 0;           // stream thread only
  std::mutex abort_mu_;
  bool aborted_ = false;
  std::string abort_reason_;
  StreamWorker stream_;  // last: its thread uses the members above
};

// Gloo's TCP pairs send with writev, which raises SIGPIPE when the peer has reset the connection:
// a rank whose peer died was killed outright, with no message and its buffered output lost
// (seen once in ~30 runs of test_launch's kill -9 scenario under load). Ignored, the write fails
// with EPIPE and Gloo's error names the peer. A handler the program installed itself is kept.
void ignore_sigpipe_unless_handled() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    ::sigemptyset(&ignore.sa_mask);
    ::sigaction(SIGPIPE, &ignore, nullptr);
  }
}

}  // namespace

std::shared_ptr<Communicator> make_gloo_communicator(const GlooOptions& options) {
  ignore_sigpipe_unless_handled();
  return std::make_shared<GlooComm>(options);
}

}  // namespace shardflow
