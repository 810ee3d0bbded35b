// shardflow for libtorch: data parallelism, ZeRO-1/2 and every overlap mode for a torch::nn::Module
// in one call, the way DDP(model) does in Python (libtorch has no DDP, ZeRO or FSDP in C++).
//
//   auto comm = shardflow::init_process_group(shardflow::LaunchEnv::detect());  // under `shardflow run`
//   Net net;                                          // any torch::nn::Module
//   shardflow::libtorch::Options opts;
//   opts.config.zero.stage = shardflow::ZeroStage::optimizer_state;
//   opts.optimizer = shardflow::OptimizerConfig{shardflow::OptimizerConfig::Kind::adamw, 1e-3f};
//   shardflow::libtorch::DataParallel ddp(*net, comm, opts);   // rank 0's weights everywhere
//   for (...) {
//     ddp.zero_grad();
//     ddp.backward(torch::nn::functional::cross_entropy(net->forward(x), y));  // reduced, stepped
//   }
//
// Header-only: it needs libtorch's headers (Debian's libtorch-dev 1.13, or any later torch's, CUDA
// builds included) wherever it is included, and nothing of libtorch inside libshardflow. Note
// [libtorch gradients] says where gradients live, Note [CUDA modules] what changes on a GPU.
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <atomic>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "shardflow/shardflow.hpp"

namespace shardflow::libtorch {

// A tensor and the name shardflow knows it by (errors, checkpoints, `shardflow plan`).
using NamedTensor = std::pair<std::string, torch::Tensor>;

struct Options {
  Config config;  // buckets, ZeRO stage, overlap, prefetch, timeouts, tracing: config.hpp's defaults
  // The optimizer step inside shardflow: each rank steps its shard as its buckets' reductions land
  // (ZeRO stages 1-2, or every parameter at stage 0). None: backward() leaves the averaged
  // gradients in each parameter's .grad() for a torch::optim optimizer of the trainer's own.
  std::optional<OptimizerConfig> optimizer;
  // A CUDA module: the stream its forward and backward run on (a cudaStream_t; null is the legacy
  // default stream, torch's default). See Note [CUDA modules].
  void* cuda_stream = nullptr;
};

// Note [CUDA modules]
// A module on one GPU trains with its buckets, shards and optimizer state on that GPU: the
// communicator must reduce device memory (NCCL, or InProcessWorld::create_on_device for ranks as
// threads), which the Runtime checks. Readiness is the same post hook; it runs on the host right
// after autograd *enqueued* the accumulation, so the Runtime records an event on the compute
// stream there and the bucket's collective waits for that event on the device: the host never
// waits for backward. The compute stream is torch's current stream of the module's device (the
// caller passes it, Options::cuda_stream / set_stream(): torch's C++ stream API lives in its CUDA
// headers, which a CPU torch lacks). After backward() returns, the updated parameters are ordered
// before later work on that stream by the Runtime (Runtime::set_stream), so the next forward
// needs no host synchronisation either. Every parameter and buffer lives on the one device.

// Note [libtorch gradients]
// Each parameter's .grad() is a tensor over the parameter's slot in its bucket (from_blob, no
// ownership), set by zero_grad(). libtorch's AccumulateGrad then adds each new gradient into it in
// place ("variable_grad += new_grad" when a grad is defined and no double backward is being set up),
// so the gradient lands in the bucket with no copy of ours, as DDP's gradient_as_bucket_view. What
// libtorch 1.13 forces: autograd always computes a gradient into a fresh tensor of its own before
// accumulating it, so each gradient is written twice (that tensor, then the add into the bucket);
// no public API lets backward write into memory we choose. Readiness comes from a post hook on
// each parameter's AccumulateGrad node, which runs right after the add — the moment DDP's reducer
// marks a gradient ready. If something replaces a .grad() (module.zero_grad(true), an optimizer's
// set_to_none), the gradient is copied into the bucket once and the view restored. At ZeRO-2 no
// view is bound at all (Note [Gradients at ZeRO-2]).
class DataParallel {
 public:
  // Registers `module`'s parameters (named_parameters order: registration order, the forward order
  // of the usual Module) and buffers, broadcasts rank 0's values of both to every rank
  // (Config::sync.initial; with snapshots, the parameters at resumed_step() instead: a resumed run
  // takes them from the snapshot) and builds the buckets: a collective, every rank constructs one. CPU or
  // CUDA tensors, all on one device (Note [CUDA modules]), contiguous, float32 / float16 /
  // bfloat16; anything else is a UsageError naming the parameter. `module` must outlive this object.
  DataParallel(torch::nn::Module& module, std::shared_ptr<Communicator> comm, Options options = {})
      : DataParallel(named(module.named_parameters(/*recurse=*/true)), named(module.named_buffers(/*recurse=*/true)), std::move(comm),
                     std::move(options)) {}

  // The same for a model that is no torch::nn::Module (a Python nn.Module: its named_parameters()
  // and named_buffers(), dotted names and all): the parameters in registration order.
  DataParallel(const std::vector<NamedTensor>& params, const std::vector<NamedTensor>& buffers, std::shared_ptr<Communicator> comm,
               Options options = {})
      : rt_(refuse_shared_autograd_thread(params, std::move(comm), options.config), options.config) {
    if (!params.empty() && params.front().second.defined()) device_ = params.front().second.device();
    if (options.cuda_stream) rt_.set_stream(options.cuda_stream);
    for (const auto& [name, b] : buffers) {
      check_tensor(name, b, "buffer");
      rt_.register_buffer(BufferSpec{name, b.data_ptr(), std::size_t(b.nbytes()), device_of(b)});
    }
    for (const auto& [name, p] : params) {
      check_tensor(name, p, "parameter");
      ParamSpec spec{name, Shape(p.sizes().begin(), p.sizes().end()), dtype_of(name, p), device_of(p), p.data_ptr()};
      spec.requires_grad = p.requires_grad();
      // Without gradient_as_bucket_view the gradient is a tensor of ours that the runtime copies
      // into the bucket and the average back out of; .grad() views it the same way.
      torch::Tensor own;
      if (!options.config.buckets.gradient_as_bucket_view && spec.requires_grad) {
        own = torch::zeros_like(p, p.options().requires_grad(false));
        spec.grad = own.data_ptr();
      }
      Entry e{p, rt_.register_param(spec), nullptr, nullptr, 0, own, name};
      by_impl_[p.unsafeGetTensorImpl()] = Index{e.handle, entries_.size()};
      entries_.push_back(std::move(e));
    }
    if (entries_.empty()) throw UsageError("shardflow::libtorch::DataParallel: the module has no parameters");
    rt_.finalize();
    if (options.optimizer) rt_.configure_optimizer(*options.optimizer);
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      auto& e = entries_[i];
      if (!e.param.requires_grad()) continue;
      // The accumulator is held weakly by the parameter: keep it alive, or the hook dies with it.
      e.accumulator = torch::autograd::impl::grad_accumulator(e.param);
      e.hook_key = e.accumulator->add_post_hook(std::make_unique<ReadyHook>(this, i));
    }
    zero_grad();
  }

  ~DataParallel() {
    for (auto& e : entries_)
      if (e.accumulator) e.accumulator->del_post_hook(e.hook_key);
  }
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  Runtime& runtime() { return rt_; }
  // Where the module lives (every parameter and buffer: checked at construction).
  torch::Device device() const { return device_; }
  // A CUDA module: the stream the next forward and backward run on (Note [CUDA modules]); between
  // iterations, as Runtime::set_stream.
  void set_stream(void* cuda_stream) { rt_.set_stream(cuda_stream); }

  // Zeroes the buckets and points each trainable parameter's .grad() at its slot (the slots move
  // once, when the buckets are rebuilt after the first iteration). With forward prefetch the views
  // are pointed when backward starts instead (Note [Binding .grad() with forward prefetch]).
  void zero_grad() {
    rt_.zero_grad();
    if (!prefetch_) bind_all();
  }

  // loss.backward(), with each gradient reduced as it completes; returns once the gradients are
  // averaged over the ranks (and, with the runtime's optimizer, the parameters stepped; with
  // forward prefetch the parameter syncs may still be landing: wait_for() each module in forward).
  void backward(const torch::Tensor& loss) {
    before_backward();
    {
      auto span = rt_.span("backward", "backward");
      loss.backward();
    }
    after_backward();
  }

  // backward() in two halves, for a trainer that runs loss.backward() itself (a Python one):
  // before_backward() right before it, after_backward() right after it.
  void before_backward() {
    if (prefetch_) bind_all();  // forward has waited for its parameters: no slot is still a sync's
  }
  void after_backward() {
    throw_if_peer_lost();
    if (prefetch_) {
      // A parameter forward read without wait_for() may have been read before its sync landed:
      // refuse, naming it, rather than train on last step's values.
      std::string unwaited;
      for (auto& e : entries_) {
        if (e.used && !e.waited && unwaited.empty()) unwaited = e.name;
        e.used = e.waited = false;
      }
      if (!unwaited.empty())
        throw UsageError("shardflow::libtorch::DataParallel: with forward prefetch (Config::zero.forward_prefetch) forward read parameter '" +
                         unwaited + "' without wait_for() on its module first; its parameter sync may not have landed");
    }
    landed_ = 0;
    rt_.finish_backward();
    rt_.wait();
    // The first iteration's end rebuilt the buckets: .grad() follows the averages there.
    if (!prefetch_) bind_all();
  }

  // After a lost peer (a CommError or TimeoutError from backward() or after_backward()), under
  // `shardflow run --recovery in-place`: Runtime::recover(comm) (Note [Recovering in place]), and
  // each .grad() pointed at the new runtime's buckets. The old buckets went with the old runtime:
  // a gradient autograd added into a view of them would land in freed memory. Returns the
  // iteration to go on from (the failed one is discarded on every rank); the module's parameters
  // hold that snapshot's values.
  std::uint64_t recover(std::shared_ptr<Communicator> comm) {
    const std::uint64_t step = rt_.recover(std::move(comm));
    landed_ = 0;
    {
      std::lock_guard lock(lost_mu_);
      lost_ = nullptr;  // the loss it was
    }
    torch::NoGradGuard no_grad;
    for (auto& e : entries_) {
      e.used = e.waited = false;
      e.bound = nullptr;
      if (e.param.requires_grad()) e.param.mutable_grad() = torch::Tensor();  // no view of the old buckets survives
    }
    if (!prefetch_) bind_all();  // with prefetch, before_backward() binds them (Note [Binding .grad() with forward prefetch])
    return step;
  }

  // Gradients that landed since the last after_backward(): a backward pass left open (a Python
  // loop runs loss.backward() several times inside no_sync() without ending each pass).
  std::size_t grads_this_pass() const { return landed_.load(std::memory_order_acquire); }

  // Gradient accumulation (DDP's no_sync): backward passes inside the guard's life accumulate
  // locally and are reduced with the first backward after it.
  Runtime::NoSync no_sync() { return rt_.no_sync(); }

  // Config::zero.forward_prefetch: call right before `submodule`'s forward reads its parameters.
  void wait_for(const torch::nn::Module& submodule) { wait_for(submodule.parameters(/*recurse=*/true), submodule.name()); }
  // The same for parameters given one by one (a Python module's own parameters, in its forward
  // pre-hook); `owner` names them in the error for one that was never registered.
  void wait_for(const std::vector<torch::Tensor>& params, const std::string& owner) {
    for (const auto& p : params) {
      auto it = by_impl_.find(p.unsafeGetTensorImpl());
      if (it == by_impl_.end()) throw UsageError("shardflow::libtorch::DataParallel::wait_for: a parameter of '" + owner + "' was not registered (another module's?)");
      rt_.wait_param(it->second.handle);
      entries_[it->second.index].waited = true;
    }
  }

 private:
  struct Entry {
    torch::Tensor param;
    Param handle;
    std::shared_ptr<torch::autograd::Node> accumulator;
    void* bound;  // the slot .grad() views
    std::uintptr_t hook_key;
    torch::Tensor own_grad;  // without gradient_as_bucket_view: the gradient's own storage
    std::string name;
    bool used = false, waited = false;  // this step: a gradient landed / wait_for() covered it
  };
  struct Index {
    Param handle;
    std::size_t index;
  };

  struct ReadyHook final : torch::autograd::FunctionPostHook {
    ReadyHook(DataParallel* owner, std::size_t index) : owner_(owner), index_(index) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list&) override {
      // A lost peer is kept for after_backward() (Note [A peer lost inside backward]); anything
      // else (a misuse) ends backward here, as before.
      try {
        owner_->grad_landed(index_);
      } catch (const CommError&) {
        owner_->peer_lost(std::current_exception());
      } catch (const TimeoutError&) {
        owner_->peer_lost(std::current_exception());
      }
      return outputs;
    }
    DataParallel* owner_;
    std::size_t index_;
  };

  // Note [A peer lost inside backward]
  // A readiness hook can see a peer's loss (a pooled bucket at ZeRO-2 never freed, a failure the
  // runtime already recorded). Thrown from the hook, it left backward as autograd's own error: a
  // RuntimeError in Python, not the CommError or TimeoutError a trainer recovering in place
  // catches. So the hooks keep the first one and let backward finish (each later hook fails as
  // fast), and after_backward() throws it as it was.
  void peer_lost(std::exception_ptr e) {
    std::lock_guard lock(lost_mu_);
    if (!lost_) lost_ = std::move(e);
  }
  void throw_if_peer_lost() {
    std::exception_ptr e;
    {
      std::lock_guard lock(lost_mu_);
      e = std::exchange(lost_, nullptr);
    }
    if (e) std::rethrow_exception(e);
  }

  void grad_landed(std::size_t i) {
    landed_.fetch_add(1, std::memory_order_acq_rel);
    auto& e = entries_[i];
    e.used = true;
    if (late_) {
      // ZeRO-2: autograd's own tensor, added into the slot the runtime hands out now (a pooled
      // bucket, zeroed, or the one no_sync accumulates in), then dropped (Note [Gradients at
      // ZeRO-2]).
      torch::NoGradGuard no_grad;
      const torch::Tensor got = e.param.grad();
      if (got.defined()) torch::from_blob(rt_.grad(e.handle), e.param.sizes(), e.param.options().requires_grad(false)).add_(got);
      e.param.mutable_grad() = torch::Tensor();
      rt_.grad_ready(e.handle);
      return;
    }
    const auto& g = e.param.grad();
    if (!g.defined() || g.data_ptr() != e.bound) {
      // Replaced behind our back (see the note): into the bucket once, and the view back.
      torch::NoGradGuard no_grad;
      const torch::Tensor got = g;
      bind(e, e.bound);
      if (got.defined()) e.param.mutable_grad().copy_(got);
    }
    rt_.grad_ready(e.handle);
  }

  void bind_all() {
    if (late_) return;
    torch::NoGradGuard no_grad;
    for (auto& e : entries_) {
      if (!e.param.requires_grad()) continue;
      void* slot = rt_.grad(e.handle);
      if (slot != e.bound || !e.param.grad().defined() || e.param.grad().data_ptr() != slot) bind(e, slot);
    }
  }

  void bind(Entry& e, void* slot) {
    e.bound = slot;
    e.param.mutable_grad() = torch::from_blob(slot, e.param.sizes(), e.param.options().requires_grad(false));
  }

  static std::vector<NamedTensor> named(const torch::OrderedDict<std::string, torch::Tensor>& items) {
    std::vector<NamedTensor> out;
    for (const auto& item : items) out.emplace_back(item.key(), item.value());
    return out;
  }

  void check_tensor(const std::string& name, const torch::Tensor& t, const char* what) const {
    if (!t.defined()) throw UsageError(std::string("shardflow::libtorch: ") + what + " '" + name + "' is an undefined tensor");
    if (!t.device().is_cpu() && !t.device().is_cuda())
      throw UsageError(std::string("shardflow::libtorch: ") + what + " '" + name + "' is on " + t.device().str() +
                       "; shardflow trains CPU and CUDA tensors");
    if (t.device() != device_)
      throw UsageError(std::string("shardflow::libtorch: ") + what + " '" + name + "' is on " + t.device().str() + " but the first parameter is on " +
                       device_.str() + "; shardflow trains a module that lives on one device (Note [CUDA modules])");
    if (!t.is_contiguous())
      throw UsageError(std::string("shardflow::libtorch: ") + what + " '" + name +
                       "' is not contiguous; shardflow steps and syncs it in place as one run of elements");
  }

  // Note [Ranks as threads on one GPU]
  // torch runs the backward of every CUDA tensor of one device on one autograd thread of the
  // process, whichever thread called backward(). Ranks that are threads of one process on one GPU
  // (InProcessWorld::create_on_device) therefore run their backward passes one after the other on
  // that thread, and a readiness hook must never wait for a peer. At ZeRO-2 it can: the gradient
  // buckets are pooled, and a hook asking for a further bucket waits until one is reduced, which
  // needs the peers' backward, queued behind this one. That world hung (gpt_train --device cuda
  // --world-size 2 --zero-stage 2, on an H200); it is refused here instead. Stages 0 and 1 never
  // wait in a hook, and one process per GPU (NCCL) has an autograd thread per rank.
  static std::shared_ptr<Communicator> refuse_shared_autograd_thread(const std::vector<NamedTensor>& params, std::shared_ptr<Communicator> comm,
                                                                     const Config& cfg) {
    const bool cuda = !params.empty() && params.front().second.defined() && params.front().second.is_cuda();
    if (cuda && comm && comm->world_size() > 1 && comm->backend_name() == "in-process" && cfg.zero.stage == ZeroStage::gradients &&
        cfg.buckets.gradient_as_bucket_view)
      throw UsageError("shardflow::libtorch: ZeRO-2 (Config::zero.stage) with " + std::to_string(comm->world_size()) +
                       " ranks as threads of one process on " + params.front().second.device().str() +
                       ": torch runs every rank's backward on its one autograd thread for that GPU, and at stage 2 a rank's backward "
                       "waits for its peers' reductions, so the ranks would wait for each other (Note [Ranks as threads on one GPU]). "
                       "Use stage 0 or 1 for ranks as threads, or one process per GPU (shardflow run, NCCL)");
    return comm;
  }

  static Device device_of(const torch::Tensor& t) {
    return t.device().is_cuda() ? Device::cuda(t.device().has_index() ? t.device().index() : 0) : Device::cpu();
  }

  static DType dtype_of(const std::string& name, const torch::Tensor& p) {
    switch (p.scalar_type()) {
      case torch::kFloat: return DType::f32;
      case torch::kHalf: return DType::f16;
      case torch::kBFloat16: return DType::bf16;
      default:
        throw UsageError("shardflow::libtorch: parameter '" + name + "' is " + std::string(c10::toString(p.scalar_type())) +
                         "; shardflow trains float32, float16 and bfloat16 parameters");
    }
  }

  // Note [Binding .grad() with forward prefetch]
  // At ZeRO stages 1-2 a bucket is also its parameters' sync staging, so asking the runtime for a
  // gradient slot (Runtime::grad) waits until that bucket's sync of the last step has landed.
  // With forward prefetch the syncs are still landing when wait() returns, in the order the next
  // forward needs them: binding every .grad() then (after wait(), or in zero_grad()) made the next
  // forward wait for all of them, and the parameter all-gathers no longer overlapped it (a GPT at
  // 1 Gbit/s: the forward started ~170 ms late, after the last sync). So with prefetch the views
  // are bound when backward starts: by then forward has waited for every parameter it reads, and
  // nothing reads .grad() in between (the runtime's optimizer steps; the bucket holds parameters
  // until backward writes gradients into it).
  // Note [Gradients at ZeRO-2]
  // Stage 2 holds a bucket's gradient buffer only while the bucket is in flight (a pool of a few),
  // so its gradient memory is a fraction of stage 1's. Pointing every .grad() at its slot before
  // backward asks the runtime for every bucket at once, and the pool then held them all: a 10.7 M
  // parameter GPT at world 2 reported 61 MiB of gradient buffers at stage 2 against 41 MiB at
  // stage 1. So at stage 2 no .grad() is bound: autograd stores each gradient in a tensor of its
  // own (as it does anyway, Note [libtorch gradients]), the readiness hook adds it into the slot
  // the runtime hands out then and drops it. One add per gradient, which the in-place binding's
  // accumulation costs too; .grad() stays undefined (at stage 2 no rank holds whole gradients).
  torch::Device device_{torch::kCPU};  // before rt_: the constructor's checks read it
  Runtime rt_;
  bool late_ = rt_.config().zero.stage == ZeroStage::gradients && rt_.config().buckets.gradient_as_bucket_view;
  bool prefetch_ = rt_.config().zero.forward_prefetch;
  std::vector<Entry> entries_;
  std::atomic<std::size_t> landed_{0};  // autograd's hooks may run on its worker threads
  std::unordered_map<const void*, Index> by_impl_;
  std::mutex lost_mu_;       // the hooks run on autograd's threads
  std::exception_ptr lost_;  // Note [A peer lost inside backward]
};

}  // namespace shardflow::libtorch
