#include <future>

#include "shardflow/communicator.hpp"
#include "kernels/cpu/host_memory.hpp"
#include "shardflow/errors.hpp"

namespace shardflow {

std::size_t collective_bytes(const CollectiveOp& op, int world) {
  const std::size_t b = op.count * dtype_size(op.dtype);
  return op.kind == CollectiveKind::reduce_scatter || op.kind == CollectiveKind::allgather ? b * std::size_t(world) : b;
}

int shift_source(int rank, int world, int distance) {
  const int d = distance % world;
  return ((rank - d) % world + world) % world;
}

void check_shift(const CollectiveOp& op, const std::string& who, bool unequal, bool in_host) {
  if (op.kind != CollectiveKind::shift) {
    if (op.recv_count != CollectiveOp::kSameCount)
      throw UsageError(who + ": " + collective_name(op.kind) + " '" + op.tag + "' sets recv_count, which only a shift takes");
    if (op.in_host && op.kind != CollectiveKind::allgather)
      throw UsageError(who + ": " + collective_name(op.kind) + " '" + op.tag + "' sets in_host, which only an all-gather or a shift takes");
    return;
  }
  if (op.in_host && !in_host)
    throw UsageError(who + ": shift '" + op.tag + "' sets in_host, a shift inside each host, which only a backend of two levels runs " +
                     "(Communicator::in_host_ranks)");
  if ((op.count || shift_recv_count(op)) && op.send == op.recv)
    throw UsageError(who + ": shift '" + op.tag + "' has one buffer as its send and its recv; a shift is not in place (Note [Shift])");
  if (!unequal && shift_recv_count(op) != op.count)
    throw UsageError(who + ": shift '" + op.tag + "' sends " + std::to_string(op.count) + " element(s) and receives " +
                     std::to_string(op.recv_count) + ": this backend shifts equal counts only (Communicator::shifts_unequal)");
}

std::size_t wire_bytes(const CollectiveOp& op, int world) {
  const auto W = std::size_t(world);
  const std::size_t full = collective_bytes(op, world);
  switch (op.kind) {
    case CollectiveKind::allreduce: return 2 * full * (W - 1) / W;
    case CollectiveKind::barrier: return 0;
    case CollectiveKind::shift: return op.distance % world == 0 ? 0 : full;
    default: return full * (W - 1) / W;
  }
}

std::shared_ptr<std::byte> Communicator::allocate(std::size_t bytes) { return alloc_zeroed(bytes); }

void Communicator::run(CollectiveOp op, std::chrono::milliseconds timeout) {
  auto started = start(std::move(op));
  wait(started, timeout);
}

Communicator::Started Communicator::start(CollectiveOp op) {
  auto promise = std::make_shared<std::promise<void>>();
  Started started{promise->get_future(), std::string(collective_name(op.kind)) + " '" + op.tag + "'"};
  submit(std::move(op), [promise](std::exception_ptr e) {
    if (e)
      promise->set_exception(e);
    else
      promise->set_value();
  });
  return started;
}

void Communicator::wait(Started& op, std::chrono::milliseconds timeout) {
  // The backend enforces the timeout itself and names the missing ranks; this bound only catches a
  // backend that never answers at all.
  if (op.done.wait_for(timeout + std::chrono::seconds(5)) != std::future_status::ready)
    throw TimeoutError("rank " + std::to_string(rank()) + ": " + op.what + " on backend " + backend_name() +
                       " did not complete within " + std::to_string(timeout.count()) + " ms");
  op.done.get();
}

}  // namespace shardflow
