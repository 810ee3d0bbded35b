#include "runtime/process/process_actor_system.hpp"

#include "runtime/process/thread_priority.hpp"
#include "shardflow/actor.hpp"

#include <caf/all.hpp>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <thread>

namespace shardflow {
namespace {
// CAF's scheduler workers route every message of the runtime: Note [Runtime threads first].
struct RuntimeThreadHook final : caf::thread_hook {
  void init(caf::actor_system&) override {}
  void thread_started() override { runtime_thread_started("sf-actors"); }
  void thread_terminates() override {}
};
}  // namespace

ProcessActorSystem::ProcessActorSystem(unsigned threads) {
  if (threads == 0) threads = std::max(1u, std::min(2u, std::thread::hardware_concurrency()));
  // CAF starts 4 scheduler threads by default even on 2 cores. The sharing policy answers a
  // message sent from a non-actor thread (grad_ready from backward) an order of magnitude sooner
  // than work stealing, whose idle workers back off into sleeps.
  config_.set("scheduler.max-threads", std::size_t{threads});
  config_.set("scheduler.policy", caf::atom("sharing"));
  // Messages an actor handles per turn (CAF's default: no limit). For experiments only: the shard
  // actor yields between steps by itself (Note [One step per message]).
  if (const char* t = std::getenv("SHARDFLOW_ACTOR_THROUGHPUT"))
    config_.set("scheduler.max-throughput", std::size_t(std::max(1, std::atoi(t))));
  // CAF would otherwise read caf-application.ini from the working directory.
  config_.set("logger.console", caf::atom("none"));
  config_.add_thread_hook<RuntimeThreadHook>();
  // The rank actor's answers (shardflow/actor.hpp) print as "shardflow: timeout (rank 1: ...)".
  // (CAF 0.17's add_error_category<T> does not compile: the renderer is given as a function.)
  config_.add_error_category(caf::atom("shardflow"), [](std::uint8_t code, caf::atom_value, const caf::message& context) {
    const auto text = context.match_elements<std::string>() ? context.get_as<std::string>(0) : caf::to_string(context);
    return "shardflow: " + to_string(static_cast<errc>(code)) + " (" + text + ")";
  });
  system_ = std::make_unique<caf::actor_system>(config_);
}

ProcessActorSystem::~ProcessActorSystem() {
  // Runtimes stop their actors before releasing the actor system; this waits for them to finish.
  system_.reset();
}

std::shared_ptr<ProcessActorSystem> ProcessActorSystem::acquire(unsigned threads) {
  static std::mutex mu;
  static std::weak_ptr<ProcessActorSystem> current;
  std::lock_guard lock(mu);
  if (auto e = current.lock()) return e;
  std::shared_ptr<ProcessActorSystem> e(new ProcessActorSystem(threads));
  current = e;
  return e;
}

}  // namespace shardflow
