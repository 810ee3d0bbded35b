// The plain and 16-bit hooks of Note [Comm hooks], HookRun, and the hooks by name.
#include <map>
#include <mutex>

#include "kernels/cpu/elementwise.hpp"
#include "shardflow/comm_hook.hpp"
#include "shardflow/errors.hpp"

namespace shardflow {

void HookRun::allreduce(void* data, std::size_t count, DType dtype, float scale) {
  if (!data && count) throw UsageError("comm hook: allreduce of " + std::to_string(count) + " elements from a null pointer");
  ops_.push_back({data, count, dtype, scale});
}

namespace {

class AllreduceHook final : public CommHook {
 public:
  std::string name() const override { return "allreduce"; }
  void reduce(const GradBucket& b, HookRun& run) override { run.allreduce(b.data, b.numel, b.dtype, b.average); }
};

// PyTorch's fp16_compress_hook / bf16_compress_hook: divided by the world size before the cast,
// so the 16-bit sum cannot overflow where the fp32 average would not.
class CompressHook final : public CommHook {
 public:
  explicit CompressHook(DType wire) : wire_(wire) {}
  std::string name() const override { return wire_ == DType::f16 ? "fp16" : "bf16"; }
  void reduce(const GradBucket& b, HookRun& run) override {
    if (b.dtype != DType::f32) {  // 16-bit gradients travel as themselves
      run.allreduce(b.data, b.numel, b.dtype, b.average);
      return;
    }
    std::vector<std::uint16_t>* wire;
    {
      std::lock_guard lock(mu_);
      wire = &wires_[b.index];
    }
    wire->resize(b.numel);
    auto* g = static_cast<float*>(b.data);
    const float inv = b.average;
    for (std::size_t i = 0; i < b.numel; ++i) g[i] *= inv;
    kernels::convert_from_f32(wire_, wire->data(), g, b.numel);
    run.allreduce(wire->data(), b.numel, wire_);
    run.then([wire, g, n = b.numel, dt = wire_](HookRun&) { kernels::convert_to_f32(dt, g, wire->data(), n); });
  }
  std::size_t state_bytes() const override {
    std::lock_guard lock(mu_);
    std::size_t n = 0;
    for (const auto& [b, w] : wires_) n += w.size() * 2;
    return n;
  }

 private:
  const DType wire_;
  mutable std::mutex mu_;
  std::map<std::uint32_t, std::vector<std::uint16_t>> wires_;  // per bucket; nodes stay where they are
};

}  // namespace

std::shared_ptr<CommHook> allreduce_hook() { return std::make_shared<AllreduceHook>(); }
std::shared_ptr<CommHook> fp16_compress_hook() { return std::make_shared<CompressHook>(DType::f16); }
std::shared_ptr<CommHook> bf16_compress_hook() { return std::make_shared<CompressHook>(DType::bf16); }

std::shared_ptr<CommHook> make_comm_hook(const std::string& name, const PowerSGDOptions& powersgd) {
  if (name == "allreduce") return allreduce_hook();
  if (name == "fp16") return fp16_compress_hook();
  if (name == "bf16") return bf16_compress_hook();
  if (name == "powersgd") return powersgd_hook(powersgd);
  throw UsageError("comm hook '" + name + "' is not one of allreduce, fp16, bf16, powersgd");
}

}  // namespace shardflow
