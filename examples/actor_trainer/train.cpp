#include "examples/actor_trainer/train.hpp"

#include <caf/all.hpp>

#include <thread>

#include "examples/actor_trainer/actors.hpp"
#include "kernels/cpu/linear.hpp"

namespace shardflow::actor_trainer {

namespace {

void check_supported(const mlp::TrainOptions& opt) {
  auto no = [](bool bad, const char* what) {
    if (bad) throw UsageError(std::string("actor_trainer: ") + what + " is mlp_train's; the actor trainer does not take it");
  };
  no(opt.device.kind != Device::Kind::cpu, "--device cuda");
  no(opt.sim.has_value(), "--backend sim");
  no(opt.accumulate != 1, "--accumulate");
  no(opt.param_dtype != DType::f32, "a 16-bit --param-dtype");
  no(!opt.optimizer_in_runtime, "the trainer's own optimizer");
  no(opt.shard_data, "--shard-data");
  no(opt.checkpoint_dir || opt.resume_dir, "--save-checkpoint / --resume");
  no(!opt.freeze.empty(), "--freeze");
  no(!opt.comm_hook.empty(), "--comm-hook");
}

// One rank: its model replica (the registered parameters) and runtime, and its actors.
struct Rank {
  mlp::Model model;
  std::unique_ptr<Runtime> rt;
  RankContext ctx;
  caf::actor trainer;
};

std::unique_ptr<Rank> make_rank(const mlp::TrainOptions& opt, const mlp::Prepared& prep, const std::shared_ptr<Communicator>& comm) {
  auto r = std::unique_ptr<Rank>(new Rank{mlp::Model(opt.sizes, opt.loss), nullptr, {}, {}});
  if (prep.init)
    r->model.load(*prep.init, "--init '" + *opt.init_path + "'");
  else
    r->model.init(opt.seed);
  r->rt = std::make_unique<Runtime>(comm, opt.runtime);
  for (std::size_t i = 0; i < r->model.layers().size(); ++i) {
    auto& l = r->model.layers()[i];
    for (bool bias : {false, true})
      r->ctx.params.push_back(r->rt->register_param({mlp::Model::param_name(int(i), bias), bias ? Shape{l.out} : Shape{l.out, l.in},
                                                     DType::f32, Device::cpu(), (bias ? l.bias : l.weight).data()}));
  }
  r->ctx.rank = comm->rank();
  r->ctx.world = comm->world_size();
  r->ctx.opt = &opt;
  r->ctx.data = &prep.data;
  r->ctx.rt = r->rt.get();
  r->ctx.runtime = rank_actor_of(*r->rt);
  r->ctx.model = &r->model;
  r->ctx.prefetch = opt.runtime.zero.forward_prefetch;
  return r;
}

// Spawns every rank's trainer (which spawns the rank's workers), runs them to the end and stops
// them all (before the runtimes go).
void run(std::vector<std::unique_ptr<Rank>>& ranks, mlp::TrainResult& result) {
  auto& sys = actor_system_of(*ranks.front()->rt);
  for (std::size_t slot = 0; slot < ranks.size(); ++slot) ranks[slot]->ctx.trainer = sys.spawn(rank_trainer, &ranks[slot]->ctx, &result, slot);
  caf::scoped_actor self{sys};
  std::vector<caf::error> errors;
  for (auto& r : ranks) self->send(r->ctx.trainer, run_atom::value);
  for (std::size_t n = 0; n < ranks.size(); ++n)
    self->receive([](run_atom) {}, [&](caf::error& e) { errors.push_back(std::move(e)); });
  // The workers of the trainers' last round (they replace them when recovering in place).
  std::vector<caf::actor> all;
  for (auto& r : ranks) {
    all.push_back(r->ctx.trainer);
    for (const auto& w : r->ctx.workers())
      if (w) all.push_back(w);
  }
  for (const auto& a : all) self->send_exit(a, caf::exit_reason::user_shutdown);
  for (const auto& a : all) self->wait_for(a);
  if (errors.empty()) return;
  // The root cause, not a peer's "aborted" consequence of it.
  auto cause = errors.front();
  for (const auto& e : errors)
    if (e.category() == caf::atom("shardflow") && static_cast<errc>(e.code()) != errc::comm) cause = e;
  rethrow(cause);
}

}  // namespace

mlp::TrainResult train(const mlp::TrainOptions& opt) {
  check_supported(opt);
  const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
  kernels::set_blas_threads(std::max(1, cores / std::max(1, opt.world_size)));  // as mlp::train: before the data
  const auto prep = mlp::prepare(opt);
  const auto world = InProcessWorld::create(opt.world_size, opt.runtime.timeouts.collective);
  mlp::TrainResult result;
  result.memory.resize(std::size_t(opt.world_size));
  result.memory_end.resize(std::size_t(opt.world_size));
  std::vector<std::unique_ptr<Rank>> ranks;
  for (int r = 0; r < opt.world_size; ++r) ranks.push_back(make_rank(opt, prep, world->communicator(r)));
  run(ranks, result);
  if (opt.save_path) save_safetensors(*opt.save_path, result.params, {{"format", "pt"}});
  return result;
}

mlp::TrainResult train_rank(const mlp::TrainOptions& opt, const std::shared_ptr<Communicator>& comm) {
  if (!comm) throw UsageError("actor_trainer::train_rank: communicator is null");
  if (opt.world_size != comm->world_size())
    throw UsageError("--world-size " + std::to_string(opt.world_size) + " differs from the launched world size " +
                     std::to_string(comm->world_size()));
  check_supported(opt);
  const auto prep = mlp::prepare(opt);
  mlp::TrainResult result;
  result.memory.resize(1);
  result.memory_end.resize(1);
  std::vector<std::unique_ptr<Rank>> ranks;
  ranks.push_back(make_rank(opt, prep, comm));
  try {
    run(ranks, result);
  } catch (const std::exception& e) {
    comm->abort("rank " + std::to_string(comm->rank()) + " failed: " + e.what());  // peers fail at once
    throw;
  }
  if (opt.save_path && result.rank_at_end == 0) save_safetensors(*opt.save_path, result.params, {{"format", "pt"}});
  return result;
}

}  // namespace shardflow::actor_trainer
