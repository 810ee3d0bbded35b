// What the two device backends (NCCL, in-process over GPU memory) share: one rank's comm stream
// (a high-priority CUDA stream), the thread that enqueues onto it in submission order, completion
// events watched by a CompletionQueue (Note [Device completions]) and the staging of host buffers.
// A backend only says how one op is put on the stream (enqueue) and how it is torn down (abort).
//
// Note [Device op lifecycle]
//   submit (any thread, returns at once)
//   -> enqueue thread: the comm stream waits for op.wait_event (the producer's stream, on the
//      device), host buffers are copied in, the backend enqueues the collective, host buffers are
//      copied out, a completion event is recorded
//   -> completion thread: the event fired -> `done` (an actor message), buffers released.
// The enqueue thread may wait for peers to *enqueue* (the in-process world's host barriers; NCCL's
// enqueue never waits), never for the GPU to finish, except for the rare ops on host memory
// (set-up checks), whose copy out of the device has to complete before the host reads it.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kernels/cuda/stream.hpp"
#include "runtime/comm/completion_queue.hpp"
#include "runtime/comm/stream_worker.hpp"
#include "shardflow/communicator.hpp"

namespace shardflow {

class DeviceComm : public Communicator {
 public:
  DeviceComm(int rank, int world, int device, std::chrono::milliseconds timeout, std::string backend);
  ~DeviceComm() override;

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string backend_name() const override { return backend_; }
  bool supports(Device d) const override { return d.kind == Device::Kind::cuda && d.index == device_; }
  // Zeroed device memory on this rank's GPU: the runtime puts its buckets there.
  std::shared_ptr<std::byte> allocate(std::size_t bytes) override;
  void submit(CollectiveOp op, CollectiveDone done) override;
  void abort(const std::string& reason) override;

  int device() const { return device_; }
  cuda::Stream stream() const { return stream_; }

 protected:
  // Starts the threads; the derived constructor calls it last, once enqueue() can run.
  void start();
  // Stops the threads (pending ops fail); the derived destructor calls it first.
  void stop();
  // Puts `op` (device pointers only) on `stream`. Runs on the enqueue thread, in submission order.
  virtual void enqueue(const CollectiveOp& op, std::uint64_t seq, cuda::Stream stream) = 0;
  // Tears down what may be blocking the stream (NCCL: ncclCommAbort). Any thread; once.
  virtual void abort_backend(const std::string& reason) = 0;
  // An asynchronous error of the backend (a peer died), polled while ops are pending.
  virtual std::optional<std::string> health() { return std::nullopt; }
  std::string who() const { return "rank " + std::to_string(rank_) + " (" + backend_ + " on cuda:" + std::to_string(device_) + ")"; }
  std::chrono::milliseconds timeout() const { return timeout_; }

 private:
  void run_one(CollectiveOp& op, CollectiveDone& done);
  cuda::Event take_event();
  void give_event(cuda::Event e);
  // Device scratch for host buffers, grown as needed (host ops are rare and small).
  std::byte* scratch(std::size_t bytes);

  const int rank_, world_, device_;
  const std::chrono::milliseconds timeout_;
  const std::string backend_;
  cuda::Stream stream_ = nullptr;
  std::uint64_t seq_ = 0;  // enqueue thread only
  std::mutex events_mu_;
  std::vector<cuda::Event> free_events_, all_events_;
  std::shared_ptr<std::byte> scratch_;
  std::size_t scratch_bytes_ = 0;
  std::once_flag aborted_;
  std::unique_ptr<CompletionQueue> completions_;
  std::unique_ptr<StreamWorker> enqueuer_;
};

}  // namespace shardflow
