#include "examples/synthetic/trainer.hpp"

#include <sys/prctl.h>

#include <exception>
#include <mutex>
#include <thread>

namespace shardflow::synthetic {

std::chrono::nanoseconds reduce_time(const Options& opt) {
  const auto kind = opt.runtime.zero_stage == 2 ? CollectiveKind::reduce_scatter : CollectiveKind::allreduce;
  return opt.link.cost(kind, opt.numel * 4, opt.world);
}

std::chrono::nanoseconds sync_time(const Options& opt) {
  return opt.runtime.zero_stage >= 1 ? opt.link.cost(CollectiveKind::allgather, opt.numel * 4, opt.world) : std::chrono::nanoseconds(0);
}

Result run(Options opt) {
  if (opt.world < 1 || opt.layers < 1 || opt.numel == 0 || opt.iterations < 1)
    throw UsageError("synthetic trainer: world, layers, numel and iterations must be positive");
  opt.runtime.first_bucket_cap_bytes = opt.runtime.bucket_cap_bytes = opt.numel * 4;  // one layer per bucket
  opt.runtime.static_graph = true;  // backward's order is fixed: no rebuild
  const auto world = make_sim_world(opt.world, opt.link, opt.runtime.timeout);
  Result res;
  res.stats.resize(std::size_t(opt.world));
  res.params.resize(std::size_t(opt.world));
  std::mutex mu;
  std::exception_ptr error;
  std::vector<std::thread> ranks;
  for (int r = 0; r < opt.world; ++r)
    ranks.emplace_back([&, r] {
      try {
        // Sleeps as long as asked: the default 50 us timer slack would add up over 2 sleeps a layer.
        prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
        const auto L = std::size_t(opt.layers);
        std::vector<float> params(L * opt.numel);
        for (std::size_t i = 0; i < params.size(); ++i) params[i] = 0.01f * float(int(i % 97) - 48);  // the same on every rank
        Runtime rt(world->communicator(r), opt.runtime);
        std::vector<Param> layer;
        for (std::size_t l = 0; l < L; ++l)
          layer.push_back(rt.register_param({"layers." + std::to_string(l) + ".weight", {std::int64_t(opt.numel)}, DType::f32,
                                             Device::cpu(), params.data() + l * opt.numel}));
        rt.configure_optimizer(opt.optimizer);
        for (int it = 0; it < opt.iterations; ++it) {
          rt.zero_grad();
          {
            auto span = rt.span("forward", "forward");
            for (std::size_t l = 0; l < L; ++l) {
              rt.wait_param(layer[l]);  // forward prefetch: this layer's update from the last step
              std::this_thread::sleep_for(opt.forward_per_layer);
            }
          }
          {
            auto span = rt.span("backward", "backward");
            for (std::size_t l = L; l-- > 0;) {
              std::this_thread::sleep_for(opt.backward_per_layer);
              float* g = rt.grad_f32(layer[l]);
              const float v = 1e-3f * float((r + 1) * (it % 5 + 1)) * float(l + 1);
              for (std::size_t i = 0; i < opt.numel; ++i) g[i] = v * float(int(i % 13) - 6);
              rt.grad_ready(layer[l]);
            }
          }
          rt.finish_backward();
          rt.wait();
        }
        rt.wait_all_params();
        std::lock_guard lock(mu);
        res.stats[std::size_t(r)] = rt.stats();
        res.params[std::size_t(r)] = params;
      } catch (...) {
        std::lock_guard lock(mu);
        if (!error) error = std::current_exception();
        world->communicator(r)->abort("rank " + std::to_string(r) + " failed");
      }
    });
  for (auto& t : ranks) t.join();
  if (error) std::rethrow_exception(error);
  return res;
}

}  // namespace shardflow::synthetic
