// An outside CAF application against the installed library: shardflow::actor (tests/install/run.sh).
// Two ranks as threads, each driven by a scoped actor through its rank actor: setup in a RankCall,
// then a few iterations of one parameter, whose average every rank must hold.
#include <caf/all.hpp>

#include <cstdio>
#include <thread>
#include <vector>

#include "shardflow/actor.hpp"

int main() {
  using namespace shardflow;
  auto world = InProcessWorld::create(2);
  std::vector<float> w(2, 0.0f);
  std::vector<int> ok(2, 0);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      Runtime rt(world->communicator(r));
      const Param p = rt.register_param({"w", {1}, DType::f32, Device::cpu(), &w[std::size_t(r)]});
      caf::scoped_actor self{actor_system_of(rt)};
      const auto rank = rank_actor_of(rt);
      auto fail = [](caf::error& e) { std::printf("rank actor: %s\n", what(e).c_str()); };
      self->request(rank, std::chrono::seconds(30), rank_api::call_atom::value, rank_api::RankCall{[](Runtime& x) { x.finalize(); }})
          .receive([](rank_api::call_atom) {}, fail);
      for (int step = 0; step < 3; ++step) {
        self->request(rank, std::chrono::seconds(30), rank_api::grad_atom::value, p)
            .receive([&](GradSlot g) { *static_cast<float*>(g.data) = float(r + 1); }, fail);
        self->send(rank, rank_api::grad_ready_atom::value, p);
        self->request(rank, std::chrono::seconds(30), rank_api::iteration_atom::value)
            .receive([&](rank_api::step_done_atom, std::uint64_t n) { ok[std::size_t(r)] += n == std::uint64_t(step + 1); }, fail);
        self->request(rank, std::chrono::seconds(30), rank_api::grad_atom::value, p)
            .receive([&](GradSlot g) { ok[std::size_t(r)] += *static_cast<float*>(g.data) == 1.5f; }, fail);  // the average
      }
    });
  for (auto& t : ranks) t.join();
  std::printf("actor consumer: %d and %d of 6 checks\n", ok[0], ok[1]);
  return ok[0] == 6 && ok[1] == 6 ? 0 : 1;
}
