// The simulated link (Note [Simulated link] in shardflow/sim.hpp): the data moves through the
// wrapped backend; a timer thread releases each completion when the modelled link is done with it.
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "runtime/process/thread_priority.hpp"
#include "shardflow/errors.hpp"
#include "shardflow/sim.hpp"

namespace shardflow {

namespace {

using Clock = std::chrono::steady_clock;

// Ranks as threads share when each issued the k-th collective, so that the link's clock starts
// when the last rank issued it (the earliest a real ring could start) rather than when the real
// data movement finished, whose own time would otherwise be charged on top of the model's.
class IssueBoard {
 public:
  explicit IssueBoard(int world) : world_(world) {}
  void issued(std::uint64_t seq, Clock::time_point t) {
    std::lock_guard lock(mu_);
    auto& e = entries_[seq];
    e.last = std::max(e.last, t);
  }
  // Every rank issued `seq` (its data moved): when the last did. Forgets it once all ranks asked.
  Clock::time_point last_issue(std::uint64_t seq) {
    std::lock_guard lock(mu_);
    auto it = entries_.find(seq);
    if (it == entries_.end()) return Clock::time_point{};
    const auto t = it->second.last;
    if (++it->second.asked == world_) entries_.erase(it);
    return t;
  }

 private:
  struct Entry {
    Clock::time_point last{};
    int asked = 0;
  };
  const int world_;
  std::mutex mu_;
  std::unordered_map<std::uint64_t, Entry> entries_;
};

// Completions waiting for the link, in issue order. Shared with the wrapped backend's callbacks,
// which may outlive the communicator (then they deliver at once).
struct LinkQueue {
  struct Held {
    Clock::time_point due;
    CollectiveDone done;
    std::exception_ptr error;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Held> held;
  Clock::time_point link_free{};
  bool stopped = false;

  // Called by the wrapped backend when the real data movement finished (in issue order).
  // `ready`: when every rank had issued the op, if known (ranks as threads), else now.
  void arrived(std::chrono::nanoseconds cost, Clock::time_point ready, CollectiveDone done, std::exception_ptr error) {
    std::unique_lock lock(mu);
    if (stopped) {
      lock.unlock();
      if (done) done(error);
      return;
    }
    const auto now = Clock::now();
    Clock::time_point due = now;
    if (!error) {  // a failure is reported at once; it did not occupy the link
      due = std::max(std::min(ready, now), link_free) + cost;
      link_free = due;
    }
    held.push_back(Held{due, std::move(done), error});
    cv.notify_one();
  }

  void run() {
    runtime_thread_started("sf-sim-link");
    std::unique_lock lock(mu);
    for (;;) {
      cv.wait(lock, [&] { return stopped || !held.empty(); });
      if (held.empty()) return;
      if (!stopped && Clock::now() < held.front().due) {
        cv.wait_until(lock, held.front().due);  // a timer: the waiting costs no CPU
        continue;
      }
      Held h = std::move(held.front());
      held.pop_front();
      lock.unlock();
      if (h.done) h.done(h.error);  // a message send: cheap
      lock.lock();
    }
  }
};

class SimComm final : public Communicator {
 public:
  SimComm(std::shared_ptr<Communicator> inner, SimLink link, std::shared_ptr<IssueBoard> board = nullptr)
      : inner_(std::move(inner)), link_(link), board_(std::move(board)), queue_(std::make_shared<LinkQueue>()),
        timer_([q = queue_] { q->run(); }) {}
  ~SimComm() override {
    {
      std::lock_guard lock(queue_->mu);
      queue_->stopped = true;  // what is still held is delivered now, later arrivals at once
    }
    queue_->cv.notify_all();
    timer_.join();
  }

  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  std::string backend_name() const override { return "sim(" + inner_->backend_name() + ")"; }
  bool supports(Device d) const override { return inner_->supports(d); }
  bool shifts_by(int distance) const override { return inner_->shifts_by(distance); }
  bool shifts_unequal(bool in_host) const override { return inner_->shifts_unequal(in_host); }
  int in_host_ranks() const override { return inner_->in_host_ranks(); }
  std::shared_ptr<std::byte> allocate(std::size_t bytes) override { return inner_->allocate(bytes); }
  void abort(const std::string& reason) override { inner_->abort(reason); }

  void submit(CollectiveOp op, CollectiveDone done) override {
    const int W = inner_->world_size();
    const auto cost = link_.cost(op.kind, collective_bytes(op, W), W);
    // The op's number and its place in the wrapped backend's queue are taken together.
    std::lock_guard lock(submit_mu_);
    const std::uint64_t seq = seq_++;
    if (board_) board_->issued(seq, Clock::now());
    inner_->submit(std::move(op), [q = queue_, b = board_, seq, cost, done = std::move(done)](std::exception_ptr e) mutable {
      q->arrived(cost, b ? b->last_issue(seq) : Clock::now(), std::move(done), e);
    });
  }

 private:
  std::shared_ptr<Communicator> inner_;
  const SimLink link_;
  std::shared_ptr<IssueBoard> board_;
  std::mutex submit_mu_;
  std::uint64_t seq_ = 0;
  std::shared_ptr<LinkQueue> queue_;
  std::thread timer_;
};

// Ranks as threads: the in-process world, each rank's communicator behind its own link.
class SimWorld final : public InProcessWorld {
 public:
  SimWorld(std::shared_ptr<InProcessWorld> inner, SimLink link)
      : inner_(std::move(inner)), link_(link), board_(std::make_shared<IssueBoard>(inner_->world_size())),
        comms_(std::size_t(inner_->world_size())) {}
  int world_size() const override { return inner_->world_size(); }
  std::shared_ptr<Communicator> communicator(int rank) override {
    auto real = inner_->communicator(rank);  // validates the rank
    std::lock_guard lock(mu_);
    auto& c = comms_[std::size_t(rank)];
    if (!c) c = std::make_shared<SimComm>(std::move(real), link_, board_);
    return c;
  }

 private:
  std::shared_ptr<InProcessWorld> inner_;
  SimLink link_;
  std::shared_ptr<IssueBoard> board_;
  std::mutex mu_;
  std::vector<std::shared_ptr<Communicator>> comms_;
};

}  // namespace

std::shared_ptr<Communicator> simulate_link(std::shared_ptr<Communicator> inner, SimLink link) {
  if (!inner) throw UsageError("simulate_link: the wrapped communicator is null");
  link.validate(inner->world_size());
  return std::make_shared<SimComm>(std::move(inner), link);
}

std::shared_ptr<InProcessWorld> make_sim_world(int world_size, SimLink link, std::chrono::milliseconds timeout) {
  link.validate(world_size);
  return std::make_shared<SimWorld>(InProcessWorld::create(world_size, timeout), link);
}

}  // namespace shardflow
