#include "examples/synthetic/trainer.hpp"

#include <sys/prctl.h>

#include <algorithm>
#include <exception>
#include <fstream>
#include <sstream>
#include <mutex>
#include <thread>

namespace shardflow::synthetic {

std::chrono::nanoseconds reduce_time(const Options& opt) {
  const auto& z = opt.runtime.zero;
  const bool rs = z.stage == ZeroStage::gradients || (z.stage == ZeroStage::optimizer_state && z.reduce_scatter);
  const auto kind = rs && z.partition == Partition::flat ? CollectiveKind::reduce_scatter : CollectiveKind::allreduce;
  return opt.link.cost(kind, opt.numel * 4, opt.world);
}

std::chrono::nanoseconds sync_time(const Options& opt) {
  return opt.runtime.zero.stage >= ZeroStage::optimizer_state ? opt.link.cost(CollectiveKind::allgather, opt.numel * 4, opt.world) : std::chrono::nanoseconds(0);
}

std::vector<std::pair<std::string, std::size_t>> load_param_list(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw UsageError("parameter list '" + path + "': cannot open");
  std::vector<std::pair<std::string, std::size_t>> out;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (const auto c = line.find('#'); c != std::string::npos) line.erase(c);
    std::istringstream ls(line);
    std::string name;
    long long numel = 0;
    if (!(ls >> name)) continue;
    if (!(ls >> numel) || numel <= 0)
      throw UsageError("parameter list '" + path + "' line " + std::to_string(n) + ": expected 'name numel' with numel > 0");
    out.emplace_back(name, std::size_t(numel));
  }
  if (out.empty()) throw UsageError("parameter list '" + path + "': no parameters");
  return out;
}

Result run(Options opt) {
  const bool custom = !opt.params.empty();
  if (!custom) {
    if (opt.world < 1 || opt.layers < 1 || opt.numel == 0 || opt.iterations < 1)
      throw UsageError("synthetic trainer: world, layers, numel and iterations must be positive");
    for (int l = 0; l < opt.layers; ++l) opt.params.emplace_back("layers." + std::to_string(l) + ".weight", opt.numel);
    opt.runtime.buckets.first_cap_bytes = opt.runtime.buckets.cap_bytes = opt.numel * 4;  // one layer per bucket
    opt.forward_total = opt.forward_per_layer * opt.layers;
    opt.backward_total = opt.backward_per_layer * opt.layers;
  }
  opt.runtime.buckets.rebuild = false;  // backward's order is fixed: no rebuild
  std::size_t total = 0;
  std::vector<std::size_t> offset;
  for (const auto& [name, n] : opt.params) {
    offset.push_back(total);
    total += n;
  }
  // Each parameter's share of forward and backward.
  auto share = [&](std::chrono::microseconds t, std::size_t n) {
    return std::chrono::nanoseconds(std::int64_t(double(t.count()) * 1e3 * double(n) / double(total)));
  };
  const auto world = make_sim_world(opt.world, opt.link, opt.runtime.timeouts.collective);
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
        const auto L = opt.params.size();
        std::vector<float> params(total);
        std::size_t largest = 0;
        for (const auto& p : opt.params) largest = std::max(largest, p.second);
        std::vector<float> pattern(largest);  // the gradients' shape, scaled per rank, iteration and layer
        for (std::size_t i = 0; i < largest; ++i) pattern[i] = float(int(i % 13) - 6);
        for (std::size_t i = 0; i < params.size(); ++i) params[i] = 0.01f * float(int(i % 97) - 48);  // the same on every rank
        Runtime rt(world->communicator(r), opt.runtime);
        std::vector<Param> layer;
        for (std::size_t l = 0; l < L; ++l)
          layer.push_back(rt.register_param({opt.params[l].first, {std::int64_t(opt.params[l].second)}, DType::f32, Device::cpu(),
                                             params.data() + offset[l]}));
        rt.configure_optimizer(opt.optimizer);
        using Clock = std::chrono::steady_clock;
        // log_loss: a loss all-reduce of the trainer's own after every wait(), read after the next.
        float loss = 0.0f;
        std::future<void> loss_reduced;
        for (int it = 0; it < opt.iterations; ++it) {
          rt.zero_grad();
          {
            auto span = rt.span("forward", "forward");
            // Deadlines accumulate, so that short shares do not each pay a sleep's overshoot; time
            // the runtime held the trainer up moves them on.
            auto due = Clock::now();
            for (std::size_t l = 0; l < L; ++l) {
              const auto t0 = Clock::now();
              rt.wait_param(layer[l]);  // forward prefetch: this layer's update from the last step
              due += (Clock::now() - t0) + share(opt.forward_total, opt.params[l].second);
              std::this_thread::sleep_until(due);
            }
          }
          {
            auto span = rt.span("backward", "backward");
            auto due = Clock::now();
            for (std::size_t l = L; l-- > 0;) {
              // The layer's backward writes its gradient and ends at its deadline: writing it is
              // part of the modelled time, so grad_ready comes when the model says (writing after
              // the deadline put each reduction ~0.15 ms late and took a core from the runtime).
              due += share(opt.backward_total, opt.params[l].second);
              if (it == 0 && r == opt.world - 1) due += opt.first_backward_late;
              const auto t0 = Clock::now();
              float* g = rt.grad_f32(layer[l]);  // stage 2: may wait for a bucket buffer (backpressure)
              due += Clock::now() - t0;
              const float v = 1e-3f * float((r + 1) * (it % 5 + 1)) * float(l + 1);
              const float* pat = pattern.data();
              for (std::size_t i = 0; i < opt.params[l].second; ++i) g[i] = v * pat[i];
              std::this_thread::sleep_until(due);
              rt.grad_ready(layer[l]);
            }
          }
          rt.finish_backward();
          rt.wait();
          if (opt.log_loss) {
            if (loss_reduced.valid()) loss_reduced.get();
            loss = float(it);
            loss_reduced = rt.collective({CollectiveKind::allreduce, DType::f32, &loss, &loss, 1, 0, 1.0f, "loss"});
          }
        }
        if (loss_reduced.valid()) loss_reduced.get();
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
