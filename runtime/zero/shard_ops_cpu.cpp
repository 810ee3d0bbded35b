// CPU shards: everything on the calling thread, in host memory.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>

#include "kernels/cpu/elementwise.hpp"
#include "runtime/core/bucket_buffers.hpp"
#include "runtime/zero/shard_ops.hpp"

namespace shardflow {
namespace {

class CpuShardOps final : public ShardOps {
 public:
  bool on_gpu() const override { return false; }
  std::shared_ptr<std::byte> alloc(std::size_t bytes) override { return alloc_zeroed(bytes); }
  void copy(void* dst, const void* src, std::size_t bytes) override {
    if (bytes && dst != src) std::memcpy(dst, src, bytes);
  }
  void zero(void* dst, std::size_t bytes) override {
    if (bytes) std::memset(dst, 0, bytes);
  }
  void cast(DType dt, void* dst, DType st, const void* src, std::size_t n) override {
    if (dt == st)
      copy(dst, src, n * dtype_size(dt));
    else if (dt == DType::f32)
      kernels::convert_to_f32(st, static_cast<float*>(dst), src, n);
    else if (st == DType::f32)
      kernels::convert_from_f32(dt, dst, static_cast<const float*>(src), n);
    else {  // 16-bit to another 16-bit type: through fp32
      if (scratch_.size() < n) scratch_.resize(n);
      kernels::convert_to_f32(st, scratch_.data(), src, n);
      kernels::convert_from_f32(dt, dst, scratch_.data(), n);
    }
  }
  void download(void* host, const void* src, std::size_t bytes) override { copy(host, src, bytes); }
  void upload(void* dst, const void* host, std::size_t bytes) override { copy(dst, host, bytes); }
  void discard(void* p, std::size_t bytes) override {
    const auto page = std::uintptr_t(::sysconf(_SC_PAGESIZE));
    const auto lo = (std::uintptr_t(p) + page - 1) / page * page, hi = (std::uintptr_t(p) + bytes) / page * page;
    if (lo < hi) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
  }

  void update(const OptimizerConfig& h, const Update& u) override {
    float* g = static_cast<float*>(u.grad);
    if (u.grad_dtype != DType::f32) {  // 16-bit gradients are stepped from an fp32 copy
      if (scratch_.size() < u.n) scratch_.resize(u.n);
      kernels::convert_to_f32(u.grad_dtype, scratch_.data(), u.grad, u.n);
      g = scratch_.data();
    }
    // In place, as torch.nn.utils.clip_grad_norm_ leaves the gradients it clipped.
    if (u.clip.host < 1.0f) kernels::scale(DType::f32, g, u.n, u.clip.host);
    apply_update(h, u.master, g, u.state_a, u.state_b, u.n, u.first, u.step, u.param_name ? *u.param_name : std::string(), u.offset,
                 UpdateFrom{u.from_master, u.from_a, u.from_b});
    if (!u.param) return;
    if (u.param_dtype != DType::f32)  // the trainer's 16-bit storage gets the master, rounded once
      kernels::convert_from_f32(u.param_dtype, u.param, u.master, u.n);
    else  // fp32 storage, 16-bit wire: keep exactly what the other ranks will receive
      kernels::round_to(u.round_as, static_cast<float*>(u.param), u.master, u.n);
  }

  void partial_norm(const std::vector<NormPart>& parts, bool inf, float* out) override {
    double acc = 0.0;
    std::vector<float> tmp;
    for (const auto& part : parts) {
      const float* g = static_cast<const float*>(part.data);
      if (part.dtype != DType::f32) {
        tmp.resize(part.n);
        kernels::convert_to_f32(part.dtype, tmp.data(), part.data, part.n);
        g = tmp.data();
      }
      if (inf)
        for (std::size_t i = 0; i < part.n; ++i) acc = std::max(acc, double(std::fabs(g[i])));
      else
        for (std::size_t i = 0; i < part.n; ++i) acc += double(g[i]) * double(g[i]);
    }
    *out = float(acc);
  }

  ClipCoef clip_coef(const float* partials, int count, bool inf, float max_norm) override {
    double total = 0.0;
    for (int r = 0; r < count; ++r) total = inf ? std::max(total, double(partials[r])) : total + double(partials[r]);
    const double norm = inf ? total : std::sqrt(total);
    last_norm_ = float(norm);
    // torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), applied when below 1.
    const double coef = double(max_norm) / (norm + 1e-6);
    return ClipCoef{coef < 1.0 ? float(coef) : 1.0f, nullptr};
  }
  float last_norm() override { return last_norm_; }
  void set_last_norm(float n) override { last_norm_ = n; }

 private:
  std::vector<float> scratch_;
  float last_norm_ = 0.0f;
};

std::mutex factory_mu;
ShardOpsFactory factory_for_tests;

}  // namespace

std::unique_ptr<ShardOps> make_cpu_shard_ops() { return std::make_unique<CpuShardOps>(); }

std::unique_ptr<ShardOps> make_shard_ops(std::shared_ptr<const MemoryOps> mem) {
  {
    std::lock_guard lock(factory_mu);
    if (factory_for_tests) return factory_for_tests(std::move(mem));
  }
  if (mem->on_gpu()) return make_cuda_shard_ops(std::move(mem));
  return make_cpu_shard_ops();
}

void set_shard_ops_factory_for_tests(ShardOpsFactory f) {
  std::lock_guard lock(factory_mu);
  factory_for_tests = std::move(f);
}

}  // namespace shardflow
