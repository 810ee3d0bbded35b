// Row-major tensors in cuBLAS's column-major world: a row-major [r, c] matrix is a column-major
// [c, r] one with leading dimension c, so every product below is the transposed identity of the
// row-major formula in its comment.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>
#include <utility>
#include <vector>

#include "examples/mlp/device_model.hpp"
#include "examples/mlp/device_kernels.cuh"
#include "kernels/cuda/optim.cuh"
#include "shardflow/errors.hpp"

namespace shardflow::mlp {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string("mlp (cuda): ") + what + ": " + cudaGetErrorString(e));
}
void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) throw Error(std::string("mlp (cuda): ") + what + ": cuBLAS status " + std::to_string(int(s)));
}

struct DevBuf {
  float* p = nullptr;
  std::size_t n = 0;
  void ensure(std::size_t want) {
    if (want <= n) return;
    if (p) cudaFree(p);
    check(cudaMalloc(&p, std::max<std::size_t>(want, 1) * 4), "cudaMalloc");
    n = want;
  }
  DevBuf() = default;
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  DevBuf(DevBuf&& o) noexcept : p(std::exchange(o.p, nullptr)), n(std::exchange(o.n, 0)) {}
  DevBuf& operator=(DevBuf&& o) noexcept {
    std::swap(p, o.p);
    std::swap(n, o.n);
    return *this;
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
};

}  // namespace

struct DeviceModel::Impl {
  int device = 0;
  std::vector<int> sizes;
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  std::vector<DevBuf> weight, bias, acts;
  DevBuf x, y, dy, dx, ones, loss_sum;
  int rows = 0;
  std::size_t out_elems = 0;
  struct State {
    DevBuf a, b;
  };
  std::vector<State> state;
};

DeviceModel::DeviceModel(const Model& host, int device) : impl_(std::make_unique<Impl>()) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || device < 0 || device >= n) {
    cudaGetLastError();
    throw UsageError("--device cuda: cuda:" + std::to_string(device) + " is not available (" + std::to_string(n) +
                     " device(s) visible)");
  }
  auto& I = *impl_;
  I.device = device;
  I.sizes = host.sizes();
  check(cudaSetDevice(device), "cudaSetDevice");
  check(cudaStreamCreateWithFlags(&I.stream, cudaStreamNonBlocking), "cudaStreamCreate");
  check(cublasCreate(&I.blas), "cublasCreate");
  check(cublasSetStream(I.blas, I.stream), "cublasSetStream");
  const auto L = host.layers().size();
  I.weight.resize(L);
  I.bias.resize(L);
  I.acts.resize(L);
  for (std::size_t i = 0; i < L; ++i) {
    const auto& l = host.layers()[i];
    I.weight[i].ensure(l.weight.size());
    I.bias[i].ensure(l.bias.size());
    check(cudaMemcpy(I.weight[i].p, l.weight.data(), l.weight.size() * 4, cudaMemcpyHostToDevice), "upload weight");
    check(cudaMemcpy(I.bias[i].p, l.bias.data(), l.bias.size() * 4, cudaMemcpyHostToDevice), "upload bias");
  }
  I.loss_sum.ensure(1);
}

DeviceModel::~DeviceModel() {
  auto& I = *impl_;
  cudaSetDevice(I.device);
  if (I.stream) cudaStreamSynchronize(I.stream);
  if (I.blas) cublasDestroy(I.blas);
  if (I.stream) cudaStreamDestroy(I.stream);
}

void* DeviceModel::stream() const { return impl_->stream; }
float* DeviceModel::param(int layer, bool is_bias) const {
  return (is_bias ? impl_->bias : impl_->weight)[std::size_t(layer)].p;
}

void DeviceModel::forward(const float* xh, const float* yh, int rows, const std::function<void(int)>& before_layer) {
  auto& I = *impl_;
  cudaSetDevice(I.device);
  I.rows = rows;
  const int in0 = I.sizes.front(), outL = I.sizes.back();
  I.x.ensure(std::size_t(rows) * in0);
  I.y.ensure(std::size_t(rows) * outL);
  // Pageable sources: the driver stages them, so the host buffers may change once this returns.
  check(cudaMemcpyAsync(I.x.p, xh, std::size_t(rows) * in0 * 4, cudaMemcpyHostToDevice, I.stream), "upload x");
  check(cudaMemcpyAsync(I.y.p, yh, std::size_t(rows) * outL * 4, cudaMemcpyHostToDevice, I.stream), "upload y");
  const float one = 1.0f;
  const float* in = I.x.p;
  const std::size_t L = I.weight.size();
  for (std::size_t i = 0; i < L; ++i) {
    if (before_layer) before_layer(int(i));
    const int fin = I.sizes[i], fout = I.sizes[i + 1];
    const std::size_t n = std::size_t(rows) * fout;
    I.acts[i].ensure(n);
    dev::bias_rows(I.acts[i].p, I.bias[i].p, std::size_t(rows), fout, I.stream);
    // y[rows, out] = x[rows, in] W[out, in]^T + b
    check(cublasSgemm(I.blas, CUBLAS_OP_T, CUBLAS_OP_N, fout, rows, fin, &one, I.weight[i].p, fin, in, fin, &one,
                      I.acts[i].p, fout),
          "forward gemm");
    if (i + 1 < L) dev::relu(I.acts[i].p, n, I.stream);
    in = I.acts[i].p;
  }
  I.out_elems = std::size_t(rows) * outL;
}

float DeviceModel::loss() {
  auto& I = *impl_;
  float sum = 0.0f;
  check(cudaMemcpyAsync(&sum, I.loss_sum.p, 4, cudaMemcpyDeviceToHost, I.stream), "loss download");
  check(cudaStreamSynchronize(I.stream), "loss");
  return I.out_elems ? sum / float(I.out_elems) : 0.0f;
}

void DeviceModel::backward(double denom, const Model::GradSlot& grads, const Model::GradReady& ready) {
  auto& I = *impl_;
  cudaSetDevice(I.device);
  const int L = int(I.weight.size()), rows = I.rows;
  I.dy.ensure(I.out_elems);
  check(cudaMemsetAsync(I.loss_sum.p, 0, 4, I.stream), "zero loss");
  dev::mse(I.acts.back().p, I.y.p, I.dy.p, I.out_elems, float(1.0 / denom), I.loss_sum.p, I.stream);
  I.ones.ensure(std::size_t(rows));
  dev::fill(I.ones.p, std::size_t(rows), 1.0f, I.stream);
  const float one = 1.0f, zero = 0.0f;
  for (int i = L - 1; i >= 0; --i) {
    const int fin = I.sizes[std::size_t(i)], fout = I.sizes[std::size_t(i) + 1];
    const float* in = i == 0 ? I.x.p : I.acts[std::size_t(i) - 1].p;
    float* dW = grads(i, false);
    float* db = grads(i, true);
    // dW[out, in] += dy[rows, out]^T x[rows, in]   (accumulates: no_sync passes add up)
    check(cublasSgemm(I.blas, CUBLAS_OP_N, CUBLAS_OP_T, fin, fout, rows, &one, in, fin, I.dy.p, fout, &one, dW, fin),
          "dW gemm");
    // db[out] += sum over rows of dy
    check(cublasSgemv(I.blas, CUBLAS_OP_N, fout, rows, &one, I.dy.p, fout, I.ones.p, 1, &one, db, 1), "db gemv");
    if (i > 0) {
      // dx[rows, in] = dy[rows, out] W[out, in]
      I.dx.ensure(std::size_t(rows) * fin);
      check(cublasSgemm(I.blas, CUBLAS_OP_N, CUBLAS_OP_N, fin, rows, fout, &one, I.weight[std::size_t(i)].p, fin, I.dy.p,
                        fout, &zero, I.dx.p, fin),
            "dx gemm");
    }
    // Enqueued, not finished: the runtime's event after this point covers them.
    ready(i, false);
    ready(i, true);
    if (i > 0) {
      const std::size_t n = std::size_t(rows) * fin;
      dev::relu_back(I.acts[std::size_t(i) - 1].p, I.dx.p, n, I.stream);
      std::swap(I.dy, I.dx);
    }
  }
  check(cudaGetLastError(), "backward kernels");
}

void DeviceModel::step(const OptimizerConfig& h, float* param, const float* grad, std::size_t n, std::size_t slot,
                       std::int64_t step) {
  auto& I = *impl_;
  if (I.state.size() <= slot) I.state.resize(slot + 1);
  auto& st = I.state[slot];
  const bool fresh = st.a.n == 0;
  st.a.ensure(n);
  if (fresh) check(cudaMemsetAsync(st.a.p, 0, n * 4, I.stream), "zero state");
  cuda::ShardBuffers b;
  b.master = param;
  b.grad = grad;
  b.state_a = st.a.p;
  b.n = n;
  if (h.kind != OptimizerConfig::Kind::sgd) {
    if (st.b.n == 0) {
      st.b.ensure(n);
      check(cudaMemsetAsync(st.b.p, 0, n * 4, I.stream), "zero state");
    }
    b.state_b = st.b.p;
  }
  cuda::launch_update(h, b, fresh, step, I.stream);  // the runtime's CUDA shard steps with the same call
}

void DeviceModel::download(Model& host) const {
  auto& I = *impl_;
  check(cudaStreamSynchronize(I.stream), "download");
  for (std::size_t i = 0; i < host.layers().size(); ++i) {
    auto& l = host.layers()[i];
    check(cudaMemcpy(l.weight.data(), I.weight[i].p, l.weight.size() * 4, cudaMemcpyDeviceToHost), "download weight");
    check(cudaMemcpy(l.bias.data(), I.bias[i].p, l.bias.size() * 4, cudaMemcpyDeviceToHost), "download bias");
  }
}

}  // namespace shardflow::mlp
