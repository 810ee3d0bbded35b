// CUDA shards (Note [Shard streams]): buffers in device memory, every operation enqueued on the
// shard's own stream with the kernels of kernels/cuda/optim.cuh; the host never waits except in
// the synchronous transfers and last_norm(), which only the trainer's thread calls.
#include "runtime/zero/shard_ops.hpp"

#include "shardflow/errors.hpp"

#ifdef SHARDFLOW_WITH_CUDA_KERNELS
#include "kernels/cuda/optim.cuh"
#include "runtime/zero/optimizer_hyper.hpp"

namespace shardflow {

namespace cuda {

void launch_update(const OptimizerConfig& h, const ShardBuffers& b, bool first, std::int64_t step, cudaStream_t stream) {
  if (h.kind == OptimizerConfig::Kind::sgd)
    launch_sgd_step(b, sgd_hyper(h), first, stream);
  else
    launch_adam_step(b, adam_hyper(h), step, stream);
}

}  // namespace cuda

namespace {

class CudaShardOps final : public ShardOps {
 public:
  explicit CudaShardOps(std::shared_ptr<const MemoryOps> mem) : mem_(std::move(mem)), device_(mem_->device.index) {
    stream_ = cuda::stream_create(device_, false);  // the comm streams get the high priority
    scalars_ = cuda::device_alloc(device_, 2 * sizeof(float));  // [0] clip coefficient, [1] norm
    norm_host_ = cuda::pinned_alloc(sizeof(float));
    // The trainer initialised its parameters on the compute stream: masters are copied after that.
    after_compute();
  }
  ~CudaShardOps() override {
    // Buffers the stream still writes are freed after this (cudaFree waits for the device).
    for (auto e : events_) cuda::event_destroy(e);
    cuda::stream_destroy(stream_);
  }

  bool on_gpu() const override { return true; }
  std::shared_ptr<std::byte> alloc(std::size_t bytes) override { return cuda::device_alloc(device_, bytes); }
  void copy(void* dst, const void* src, std::size_t bytes) override {
    if (!bytes || dst == src) return;
    cuda::set_device(device_);
    cuda::memcpy_async(dst, src, bytes, stream_);
  }
  void zero(void* dst, std::size_t bytes) override {
    cuda::set_device(device_);
    cuda::memset_async(dst, bytes, stream_);
  }
  void cast(DType dt, void* dst, DType st, const void* src, std::size_t n) override {
    if (dt == st) return copy(dst, src, n * dtype_size(dt));
    cuda::set_device(device_);
    cuda::launch_cast(dt, dst, st, src, n, s());
  }
  void download(void* host, const void* src, std::size_t bytes) override {
    copy(host, src, bytes);
    cuda::stream_sync(stream_);
  }
  void upload(void* dst, const void* host, std::size_t bytes) override {
    copy(dst, host, bytes);
    cuda::stream_sync(stream_);  // `host` may be gone once this returns
  }

  void update(const OptimizerConfig& h, const Update& u) override {
    if (u.from_master) throw Error("device shard: a step from other buffers than it writes (a twin's) runs on host shards only");
    cuda::set_device(device_);
    cuda::ShardBuffers b;
    b.master = u.master;
    b.param16 = u.param && u.param_dtype != DType::f32 ? u.param : nullptr;
    b.param_dtype = u.param_dtype;
    b.grad = u.grad;
    b.grad_dtype = u.grad_dtype;
    b.grad_scale = u.clip.device ? 1.0f : u.clip.host;
    b.grad_scale_ptr = u.clip.device;
    b.state_a = u.state_a;
    b.state_b = u.state_b;
    b.n = u.n;
    cuda::launch_update(h, b, u.first, u.step, s());
    if (u.param && u.param_dtype == DType::f32) cuda::launch_round_to(u.round_as, static_cast<float*>(u.param), u.master, u.n, s());
  }

  void partial_norm(const std::vector<NormPart>& parts, bool inf, float* out) override {
    cuda::set_device(device_);
    cuda::memset_async(out, sizeof(float), stream_);
    for (const auto& p : parts) {
      if (inf)
        cuda::launch_abs_max(p.dtype, p.data, p.n, out, s());
      else
        cuda::launch_sq_norm(p.dtype, p.data, p.n, out, s());
    }
  }
  ClipCoef clip_coef(const float* partials, int count, bool inf, float max_norm) override {
    cuda::set_device(device_);
    auto* f = reinterpret_cast<float*>(scalars_.get());
    cuda::launch_clip_coef(partials, count, inf, max_norm, f, f + 1, s());
    return ClipCoef{1.0f, f};
  }
  float last_norm() override {
    auto* f = reinterpret_cast<float*>(scalars_.get());
    download(norm_host_.get(), f + 1, sizeof(float));
    return *reinterpret_cast<const float*>(norm_host_.get());
  }

  void make_events(std::size_t slots) override {
    while (events_.size() < slots) events_.push_back(cuda::event_create(device_));
  }
  cuda::Event record(std::size_t slot) override {
    cuda::set_device(device_);
    cuda::event_record(events_.at(slot), stream_);
    return events_[slot];
  }
  cuda::Event event(std::size_t slot) const override { return events_.at(slot); }
  void after_compute() override {
    cuda::set_device(device_);
    auto e = cuda::event_create(device_);
    cuda::event_record(e, mem_->stream);
    cuda::stream_wait_event(stream_, e);
    cuda::event_destroy(e);  // released once the wait is done with it (CUDA keeps it alive)
  }
  void after(cuda::Event e) override {
    if (!e) return;
    cuda::set_device(device_);
    cuda::stream_wait_event(stream_, e);
  }
  void compute_after(std::size_t slot) override {
    cuda::set_device(device_);
    cuda::stream_wait_event(mem_->stream, events_.at(slot));
  }

 private:
  cudaStream_t s() const { return static_cast<cudaStream_t>(stream_); }

  std::shared_ptr<const MemoryOps> mem_;
  int device_;
  cuda::Stream stream_ = nullptr;
  std::shared_ptr<std::byte> scalars_, norm_host_;
  std::vector<cuda::Event> events_;
};

}  // namespace

std::unique_ptr<ShardOps> make_cuda_shard_ops(std::shared_ptr<const MemoryOps> mem) {
  return std::make_unique<CudaShardOps>(std::move(mem));
}

}  // namespace shardflow

#else

namespace shardflow {

std::unique_ptr<ShardOps> make_cuda_shard_ops(std::shared_ptr<const MemoryOps> mem) {
  throw UsageError("the runtime optimizer on " + mem->device.str() + ": this build has no CUDA kernels");
}

}  // namespace shardflow

#endif
