// The trainer's side of the rank actor (Note [The rank actor], rank_actor.cpp): its handle, its
// subscribers, the thread it runs on, and Runtime's blocking calls, which ask it from a scoped
// actor on the calling thread.
#pragma once

#include <caf/all.hpp>

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>

#include "runtime/core/rank_context.hpp"
#include "runtime/core/rank_events.hpp"
#include "shardflow/actor.hpp"

namespace shardflow {

class RankClient {
 public:
  explicit RankClient(const RankContext& ctx) : ctx_(ctx) {}

  rank_api::actor actor;  // spawned with the Runtime, stopped first when it goes
  std::shared_ptr<RankEvents> subscribers = std::make_shared<RankEvents>();
  std::atomic<std::thread::id> thread{};  // the rank actor's own thread

  // A RankCall runs here: the rank's own thread, which may block (never a scheduler thread).
  bool on_rank_thread() const { return std::this_thread::get_id() == thread.load(std::memory_order_relaxed); }

  // A blocking call: the request a trainer actor would send, asked from a scoped actor on the
  // calling thread; the answer's error rethrown as the exception it stands for (the rank's own
  // failure as it was thrown, its type kept).
  template <class... Reply, class... Ts>
  void ask(const char* what, Ts&&... xs) {
    // The public waits block directly on the rank actor's own thread (on_rank_thread): asking
    // itself from there would wait for ever.
    if (on_rank_thread())
      throw std::logic_error(std::string("Runtime::") + what + " asked the rank actor from its own thread (rank " + std::to_string(ctx_.rank) + ")");
    // A scoped actor costs a registration in the actor system: the trainer's thread keeps one; a
    // second thread asking at the same time makes its own.
    std::unique_lock lock(asker_mu_, std::try_to_lock);
    std::optional<caf::scoped_actor> own;
    caf::scoped_actor* self;
    if (lock.owns_lock()) {
      if (!asker_) asker_ = std::make_unique<caf::scoped_actor>(ctx_.actors->system());
      self = asker_.get();
    } else {
      self = &own.emplace(ctx_.actors->system());
    }
    bool answered = false;
    caf::error error;
    (*self)->request(actor, caf::infinite, std::forward<Ts>(xs)...)
        .receive([&](Reply...) { answered = true; }, [&](caf::error& e) { error = std::move(e); });
    if (answered) return;
    ctx_.throw_if_failed();
    rethrow(error);
  }

  // The trainer's scoped actor goes before the actor system does (Runtime's destructor).
  void release() { asker_.reset(); }

 private:
  const RankContext& ctx_;
  std::mutex asker_mu_;
  std::unique_ptr<caf::scoped_actor> asker_;
};

}  // namespace shardflow
