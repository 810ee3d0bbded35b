// An llm.c-style train loop on shardflow's raw-buffer API (Note [Flat buffers]): the model is one
// flat parameter buffer and one flat gradient buffer with a table of offsets, backward reports a
// layer's range when it is done, and the runtime's ZeRO-1 AdamW steps the shards. Two ranks as
// threads on the CPU, a two-layer linear model learning a fixed random map.
//
//   build/examples/llmc_flat
#include <cmath>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include "shardflow/shardflow.hpp"

using namespace shardflow;

namespace {

constexpr int kIn = 16, kHidden = 32, kOut = 4, kBatch = 32, kSteps = 200, kWorld = 2;
// The table, as llm.c's ParameterTensors: w1 [hidden, in], w2 [out, hidden], end to end.
constexpr std::size_t kW1 = 0, kW2 = kW1 + kHidden * kIn, kTotal = kW2 + kOut * kHidden;

void train_rank(const std::shared_ptr<Communicator>& comm, float* first_loss, float* last_loss) {
  std::vector<float> params(kTotal), grads(kTotal), teacher(kOut * kIn);
  std::mt19937 rng(7);  // every rank the same init (rank 0's is broadcast at finalize anyway)
  std::normal_distribution<float> n01(0.0f, 1.0f);
  for (auto& p : params) p = 0.1f * n01(rng);
  for (auto& t : teacher) t = n01(rng);
  Config cfg;
  cfg.buckets.gradient_as_bucket_view = false;  // gradients live in the engine's flat buffer
  cfg.zero.stage = ZeroStage::optimizer_state;
  cfg.zero.overlap = Overlap::interleaved;
  Runtime rt(comm, cfg);
  rt.register_flat({params.data(), grads.data(), kTotal, DType::f32, Device::cpu(),
                    {{"w1", {kHidden, kIn}, kW1}, {"w2", {kOut, kHidden}, kW2}}});
  OptimizerConfig adamw;
  adamw.kind = OptimizerConfig::Kind::adamw;
  adamw.lr = 3e-3f;
  rt.configure_optimizer(adamw);
  std::mt19937 data(100 + unsigned(comm->rank()));  // each rank its own batches
  std::vector<float> x(kIn), h(kHidden), y(kOut), dy(kOut), dh(kHidden);
  for (int step = 0; step < kSteps; ++step) {
    rt.zero_grad();
    std::fill(grads.begin(), grads.end(), 0.0f);
    float loss = 0.0f;
    for (int b = 0; b < kBatch; ++b) {
      for (auto& v : x) v = n01(data);
      for (int i = 0; i < kHidden; ++i) {  // forward: h = w1 x, y = w2 h
        h[i] = 0.0f;
        for (int j = 0; j < kIn; ++j) h[i] += params[kW1 + std::size_t(i * kIn + j)] * x[j];
      }
      for (int o = 0; o < kOut; ++o) {
        y[o] = 0.0f;
        for (int i = 0; i < kHidden; ++i) y[o] += params[kW2 + std::size_t(o * kHidden + i)] * h[i];
        float target = 0.0f;
        for (int j = 0; j < kIn; ++j) target += teacher[std::size_t(o * kIn + j)] * x[j];
        dy[o] = (y[o] - target) / float(kBatch * kOut);
        loss += 0.5f * (y[o] - target) * (y[o] - target) / float(kBatch * kOut);
      }
      std::fill(dh.begin(), dh.end(), 0.0f);
      for (int o = 0; o < kOut; ++o)
        for (int i = 0; i < kHidden; ++i) {
          grads[kW2 + std::size_t(o * kHidden + i)] += dy[o] * h[i];
          dh[i] += params[kW2 + std::size_t(o * kHidden + i)] * dy[o];
        }
      for (int i = 0; i < kHidden; ++i)
        for (int j = 0; j < kIn; ++j) grads[kW1 + std::size_t(i * kIn + j)] += dh[i] * x[j];
    }
    // Backward is done layer by layer in a real engine; here the last layer's range goes first.
    rt.grads_ready(kW2, kTotal - kW2);
    rt.grads_ready(kW1, kW2 - kW1);
    rt.wait();  // averaged, stepped on each rank's shard, synced into `params`
    if (step == 0) *first_loss = loss;
    *last_loss = loss;
  }
  rt.wait_all_params();
}

}  // namespace

int main() {
  auto world = InProcessWorld::create(kWorld);
  std::vector<float> first(kWorld), last(kWorld);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kWorld; ++r)
    ranks.emplace_back([&, r] { train_rank(world->communicator(r), &first[std::size_t(r)], &last[std::size_t(r)]); });
  for (auto& t : ranks) t.join();
  std::printf("llmc_flat: world %d, ZeRO-1 AdamW on one flat buffer of %zu parameters: rank 0's loss %.4f -> %.6f\n", kWorld, kTotal,
              double(first[0]), double(last[0]));
  return last[0] < 0.5f * first[0] ? 0 : 1;
}
