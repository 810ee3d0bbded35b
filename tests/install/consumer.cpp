// A trainer outside the shardflow tree, built against the installed library: two ranks (threads of
// this process) average their gradients, then take ZeRO-1 SGD steps inside the runtime. Exits 0
// when every number is what the arithmetic says, and prints what differs otherwise.
#include <shardflow/shardflow.hpp>

#include <cmath>
#include <cstdio>
#include <thread>
#include <utility>
#include <vector>

int main() {
  constexpr int kWorld = 2, kSteps = 3;
  constexpr float kLr = 0.1f;
  auto world = shardflow::InProcessWorld::create(kWorld);
  std::vector<std::vector<float>> weights(kWorld, std::vector<float>(12, 1.0f)), biases(kWorld, std::vector<float>(3, 1.0f));
  std::vector<int> bad(kWorld, 0);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kWorld; ++r)
    ranks.emplace_back([&, r] {
      shardflow::Config cfg;
      cfg.zero.stage = shardflow::ZeroStage::optimizer_state;
      shardflow::Runtime rt(world->communicator(r), cfg);
      auto w = rt.register_param({"layer.weight", {4, 3}, shardflow::DType::f32, shardflow::Device::cpu(), weights[r].data()});
      auto b = rt.register_param({"layer.bias", {3}, shardflow::DType::f32, shardflow::Device::cpu(), biases[r].data()});
      shardflow::OptimizerConfig sgd;
      sgd.lr = kLr;
      rt.configure_optimizer(sgd);
      for (int step = 0; step < kSteps; ++step) {
        rt.zero_grad();
        // Rank r's gradient is r + 1 everywhere: the average over two ranks is 1.5.
        for (auto [p, n] : {std::pair{b, 3}, std::pair{w, 12}}) {  // backward: the last layer's bias first
          float* g = rt.grad_f32(p);
          for (int i = 0; i < n; ++i) g[i] = float(r + 1);
          rt.grad_ready(p);
        }
        rt.finish_backward();
        rt.wait();
      }
      float want = 1.0f;
      for (int step = 0; step < kSteps; ++step) want -= kLr * 1.5f;
      for (const auto* v : {&weights[r], &biases[r]})
        for (float x : *v)
          if (std::fabs(x - want) > 1e-6f) {
            std::printf("rank %d: parameter %.7f, want %.7f\n", r, x, want);
            ++bad[r];
          }
    });
  for (auto& t : ranks) t.join();
  if (bad[0] || bad[1]) return 1;
  std::printf("consumer: world %d, %d ZeRO-1 SGD steps: every parameter is %.4f on both ranks\n", kWorld, kSteps,
              weights[0][0]);
  return 0;
}
