#include "runtime/comm/device_comm.hpp"

#include <algorithm>
#include <cstdint>
#include <utility>

#include "shardflow/errors.hpp"

namespace shardflow {
namespace {

// Bytes of the send and receive sides of `op` on a world of `world`.
std::pair<std::size_t, std::size_t> op_bytes(const CollectiveOp& op, int world) {
  const std::size_t n = op.count * dtype_size(op.dtype), w = std::size_t(world);
  switch (op.kind) {
    case CollectiveKind::reduce_scatter: return {n * w, n};
    case CollectiveKind::allgather: return {n, n * w};
    case CollectiveKind::barrier: return {0, 0};
    default: return {n, n};
  }
}

bool overlaps(const void* a, std::size_t an, const void* b, std::size_t bn) {
  const auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
  return x < y + bn && y < x + an;
}

}  // namespace

DeviceComm::DeviceComm(int rank, int world, int device, std::chrono::milliseconds timeout, std::string backend)
    : rank_(rank), world_(world), device_(device), timeout_(timeout), backend_(std::move(backend)) {
  if (world < 1 || rank < 0 || rank >= world)
    throw UsageError(backend_ + ": rank " + std::to_string(rank) + " is outside world size " + std::to_string(world));
  if (timeout.count() <= 0) throw UsageError(backend_ + ": timeout must be positive");
  stream_ = cuda::stream_create(device, /*high_priority=*/true);
}

DeviceComm::~DeviceComm() {
  // stop() ran in the derived destructor; the stream may still run work the backend enqueued.
  try {
    cuda::stream_sync(stream_);
  } catch (const std::exception&) {
  }
  for (auto e : all_events_) cuda::event_destroy(e);
  cuda::stream_destroy(stream_);
}

void DeviceComm::start() {
  CompletionQueue::Options o;
  o.who = who();
  o.timeout = timeout_;
  o.on_start = [d = device_] { cuda::set_device(d); };
  o.health = [this] { return health(); };
  o.on_failure = [this](const std::string& reason) { abort(reason); };
  completions_ = std::make_unique<CompletionQueue>(std::move(o));
  enqueuer_ = std::make_unique<StreamWorker>(StreamWorker::Enqueue([this](CollectiveOp& op, CollectiveDone& done) {
    thread_local int current = -1;  // CUDA's current device is per thread
    if (current != device_) {
      cuda::set_device(device_);
      current = device_;
    }
    run_one(op, done);
  }));
}

void DeviceComm::stop() {
  if (enqueuer_ && (enqueuer_->busy() || completions_->busy()))
    abort(who() + "'s communicator was destroyed with collectives pending");
  enqueuer_.reset();     // drains: later ops fail fast once aborted
  completions_.reset();  // fails what is still pending
}

std::shared_ptr<std::byte> DeviceComm::allocate(std::size_t bytes) { return cuda::device_alloc(device_, bytes); }

void DeviceComm::submit(CollectiveOp op, CollectiveDone done) { enqueuer_->push(std::move(op), std::move(done)); }

void DeviceComm::abort(const std::string& reason) {
  std::call_once(aborted_, [&] {
    abort_backend(reason);
    if (completions_) completions_->fail(who() + " aborted: " + reason);
  });
}

cuda::Event DeviceComm::take_event() {
  std::lock_guard lock(events_mu_);
  if (!free_events_.empty()) {
    auto e = free_events_.back();
    free_events_.pop_back();
    return e;
  }
  auto e = cuda::event_create(device_);
  all_events_.push_back(e);
  return e;
}

void DeviceComm::give_event(cuda::Event e) {
  std::lock_guard lock(events_mu_);
  free_events_.push_back(e);
}

std::byte* DeviceComm::scratch(std::size_t bytes) {
  if (bytes > scratch_bytes_) {
    // The old scratch may still be read by ops on the stream: it is kept until the stream is done
    // with it, i.e. handed to the op's keep_alive below (see run_one).
    scratch_ = cuda::device_alloc(device_, bytes);
    scratch_bytes_ = bytes;
  }
  return scratch_.get();
}

void DeviceComm::run_one(CollectiveOp& op, CollectiveDone& done) {
  if (auto f = completions_->failure()) std::rethrow_exception(f);
  const std::string what = std::string(collective_name(op.kind)) + " '" + op.tag + "'";
  if (op.kind == CollectiveKind::broadcast && (op.root < 0 || op.root >= world_))
    throw UsageError(who() + ": " + what + ": broadcast root " + std::to_string(op.root) + " is not a rank of world " +
                     std::to_string(world_));
  check_shift(op, who());
  if (op.wait_event) cuda::stream_wait_event(stream_, op.wait_event);

  // Host buffers (set-up checks, the rebuild order) go through device scratch: in through the
  // driver's staging, out through page-locked memory so that the copy stays asynchronous.
  const auto [sb, rb] = op_bytes(op, world_);
  auto place = [&](const void* p, std::size_t n) -> int {
    if (!p || !n) return device_;
    const int d = cuda::pointer_device(p);
    if (d >= 0 && d != device_)
      throw UsageError(who() + ": " + what + " got a buffer on cuda:" + std::to_string(d) +
                       "; this communicator's ranks use cuda:" + std::to_string(device_));
    return d;
  };
  const bool host_send = place(op.send, sb) < 0, host_recv = place(op.recv, rb) < 0;
  CollectiveOp dev = op;
  std::shared_ptr<std::byte> pinned, scratch_hold;
  std::byte* out_src = nullptr;
  if (host_send || host_recv) {
    // One region for both sides when they overlap (in-place ops, a send slice inside recv).
    const auto* s = static_cast<const std::byte*>(op.send);
    auto* r = static_cast<std::byte*>(op.recv);
    if (host_send && host_recv && overlaps(s, sb, r, rb)) {
      const std::byte* lo = std::min<const std::byte*>(s, r);
      const std::byte* hi = std::max<const std::byte*>(s + sb, r + rb);
      std::byte* base = scratch(std::size_t(hi - lo));
      cuda::memcpy_async(base, lo, std::size_t(hi - lo), stream_);
      dev.send = base + (s - lo);
      dev.recv = base + (r - lo);
    } else {
      std::byte* base = scratch((host_send ? sb : 0) + (host_recv ? rb + 256 : 0));
      if (host_send) {
        cuda::memcpy_async(base, s, sb, stream_);
        dev.send = base;
      }
      if (host_recv) dev.recv = base + (host_send ? (sb + 255) / 256 * 256 : 0);
    }
    scratch_hold = scratch_;
    if (host_recv && rb) {
      pinned = cuda::pinned_alloc(rb);
      out_src = static_cast<std::byte*>(dev.recv);
    }
  }
  dev.keep_alive = nullptr;
  enqueue(dev, seq_++, stream_);
  if (pinned) cuda::memcpy_async(pinned.get(), out_src, rb, stream_);
  cuda::Event e = take_event();
  cuda::event_record(e, stream_);

  auto user_done = std::exchange(done, nullptr);
  CollectiveDone on_done = [this, e, user_done = std::move(user_done), pinned, recv = op.recv, rb = rb](std::exception_ptr x) {
    if (!x && pinned) std::copy_n(pinned.get(), rb, static_cast<std::byte*>(recv));
    if (!x) give_event(e);  // a failed op's event may still be pending on the stream: never reused
    if (user_done) user_done(x);
  };
  auto keep = std::make_shared<std::pair<std::shared_ptr<const void>, std::shared_ptr<std::byte>>>(op.keep_alive, scratch_hold);
  completions_->push(
      what,
      [e](std::string& err) {
        switch (cuda::event_query(e, &err)) {
          case cuda::Query::done: return CompletionQueue::State::done;
          case cuda::Query::pending: return CompletionQueue::State::pending;
          default: return CompletionQueue::State::failed;
        }
      },
      std::move(on_done), std::move(keep));
}

}  // namespace shardflow
