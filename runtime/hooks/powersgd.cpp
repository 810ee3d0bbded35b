// PowerSGD as torch.distributed's powerSGD_hook does it (comm_hook.hpp): per bucket, three
// phases. Issue: gradients + the error of the last iteration (error feedback) are the input M;
// each compressible M_i [n, m] gives P_i = M_i Q_i; the uncompressed gradients and every P go out.
// Then P is orthogonalised, Q_i = M_i^T P_i goes out (averaged). Then M_i ~ P_i Q_i^T, and the
// error is what this rank's input lost (the whole bucket, as PyTorch computes it: for the
// uncompressed gradients the ranks' errors sum to zero). The first phase runs on the comm stream
// actor, the others on the backend's stream thread.
#include <map>
#include <mutex>
#include <random>

#include "kernels/cpu/lowrank.hpp"
#include "shardflow/comm_hook.hpp"
#include "shardflow/errors.hpp"

namespace shardflow {
namespace {

struct Matrix {
  std::size_t offset, n, m;  // into the bucket; M_i is [n, m]
  std::size_t p_at, q_at;    // into P and Q
};

// One bucket's state, made on its first compressed iteration for its layout.
struct BucketState {
  std::vector<GradBucket::Entry> layout;
  std::vector<Matrix> matrices;
  std::vector<std::pair<std::size_t, std::size_t>> plain;  // (offset, numel) all-reduced as is
  std::vector<float> error, input, packed, P, Q;
  bool q_ready = false;
};

bool same_layout(const std::vector<GradBucket::Entry>& a, const std::vector<GradBucket::Entry>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].name != b[i].name || a[i].offset != b[i].offset || a[i].shape != b[i].shape) return false;
  return true;
}

class PowerSGDHook final : public CommHook {
 public:
  explicit PowerSGDHook(PowerSGDOptions o) : o_(o) {
    if (o_.rank < 1) throw UsageError("powersgd: rank " + std::to_string(o_.rank) + " must be >= 1");
    if (!(o_.min_compression_rate >= 1.0)) throw UsageError("powersgd: min_compression_rate must be >= 1");
  }
  std::string name() const override { return "powersgd"; }

  void reduce(const GradBucket& b, HookRun& run) override {
    const float inv = b.average;
    if (b.iteration < o_.start_iter) {  // plain all-reduce first (PyTorch's start_powerSGD_iter)
      run.allreduce(b.data, b.numel, b.dtype, inv);
      return;
    }
    if (b.dtype != DType::f32)
      throw UsageError("comm hook 'powersgd': bucket " + std::to_string(b.index) + " holds " + dtype_name(b.dtype) +
                       " gradients; it compresses fp32 ones");
    BucketState& s = state_for(b);
    auto* g = static_cast<float*>(b.data);
    const int r = o_.rank;
    if (o_.error_feedback)
      for (std::size_t i = 0; i < b.numel; ++i) g[i] += s.error[i];
    if (o_.error_feedback) s.input.assign(g, g + b.numel);
    std::size_t at = 0;
    for (const auto& [off, n] : s.plain) {
      std::copy(g + off, g + off + n, s.packed.begin() + std::ptrdiff_t(at));
      at += n;
    }
    if (!s.q_ready || !o_.warm_start) {
      // The same on every rank: seeded by the options, the bucket and the iteration only.
      std::mt19937_64 rng(o_.seed * 1000003u + b.index * 7919u + b.iteration);
      std::normal_distribution<float> normal(0.0f, 1.0f);
      for (auto& q : s.Q) q = normal(rng);
      for (const auto& mx : s.matrices) kernels::orthogonalize_columns(s.Q.data() + mx.q_at, int(mx.m), r, o_.orthogonalization_epsilon);
      s.q_ready = true;
    }
    for (const auto& mx : s.matrices)
      kernels::gemm(false, false, int(mx.n), r, int(mx.m), g + mx.offset, s.Q.data() + mx.q_at, s.P.data() + mx.p_at);
    if (!s.packed.empty()) run.allreduce(s.packed.data(), s.packed.size(), DType::f32, inv);
    if (!s.P.empty()) run.allreduce(s.P.data(), s.P.size(), DType::f32);  // orthogonalised next: no need to average
    run.then([this, &s, g, r, inv](HookRun& next) {
      std::size_t at = 0;
      for (const auto& [off, n] : s.plain) {
        std::copy(s.packed.begin() + std::ptrdiff_t(at), s.packed.begin() + std::ptrdiff_t(at + n), g + off);
        at += n;
      }
      if (s.matrices.empty()) return finish(s, g);
      for (const auto& mx : s.matrices) {
        kernels::orthogonalize_columns(s.P.data() + mx.p_at, int(mx.n), r, o_.orthogonalization_epsilon);
        kernels::gemm(true, false, int(mx.m), r, int(mx.n), g + mx.offset, s.P.data() + mx.p_at, s.Q.data() + mx.q_at);
      }
      next.allreduce(s.Q.data(), s.Q.size(), DType::f32, inv);
      next.then([this, &s, g, r](HookRun&) {
        for (const auto& mx : s.matrices)
          kernels::gemm(false, true, int(mx.n), int(mx.m), r, s.P.data() + mx.p_at, s.Q.data() + mx.q_at, g + mx.offset);
        finish(s, g);
      });
    });
  }

  std::size_t state_bytes() const override {
    std::lock_guard lock(mu_);
    std::size_t n = 0;
    for (const auto& [b, s] : buckets_) n += 4 * (s.error.size() + s.input.size() + s.packed.size() + s.P.size() + s.Q.size());
    return n;
  }

 private:
  void finish(BucketState& s, const float* g) {
    if (o_.error_feedback)
      for (std::size_t i = 0; i < s.error.size(); ++i) s.error[i] = s.input[i] - g[i];
  }

  // The bucket's state; made anew when its layout changed (the buckets were rebuilt).
  BucketState& state_for(const GradBucket& b) {
    std::lock_guard lock(mu_);
    auto& s = buckets_[b.index];
    if (same_layout(s.layout, b.params) && !s.layout.empty()) return s;
    s = BucketState{};
    s.layout = b.params;
    std::size_t p_at = 0, q_at = 0, plain = 0;
    const auto r = std::size_t(o_.rank);
    for (const auto& e : b.params) {
      const auto numel = std::size_t(shardflow::numel(e.shape));
      const std::size_t n = e.shape.size() >= 2 ? std::size_t(e.shape[0]) : 0, m = n ? numel / n : 0;
      if (n && m && double(n + m) * double(r) * o_.min_compression_rate < double(n * m)) {
        s.matrices.push_back({e.offset, n, m, p_at, q_at});
        p_at += n * r;
        q_at += m * r;
      } else {
        s.plain.emplace_back(e.offset, numel);
        plain += numel;
      }
    }
    s.P.assign(p_at, 0.0f);
    s.Q.assign(q_at, 0.0f);
    s.packed.assign(plain, 0.0f);
    if (o_.error_feedback) s.error.assign(b.numel, 0.0f);
    return s;
  }

  const PowerSGDOptions o_;
  mutable std::mutex mu_;
  std::map<std::uint32_t, BucketState> buckets_;  // nodes stay where they are while others are added
};

}  // namespace

std::shared_ptr<CommHook> powersgd_hook(PowerSGDOptions options) { return std::make_shared<PowerSGDHook>(options); }

}  // namespace shardflow
