// Note [Two-level collectives]
// Several ranks per host: rank (host h, local index l) = h * L + l talks to the L ranks of its host
// through `local` (shared memory) and to the ranks of index l on the other hosts through `cross`
// (the network). Each collective is a chain of sub-collectives:
//   all-reduce of n:       local reduce-scatter (n/L each), cross all-reduce of that 1/L, local
//                          all-gather: each host puts 2 (H-1)/H of n on the network in all, 1/L per
//                          rank, all L ranks at once, where the flat ring sends 2 (W-1)/W per rank;
//   reduce-scatter to c:   local reduce-scatter of the blocks grouped by local index (rank (h, l)
//                          keeps the local sum of every host's block for index l), then a cross
//                          reduce-scatter of those H blocks: its own block, summed everywhere;
//   all-gather of c:       cross all-gather (the blocks of index l from every host), local
//                          all-gather of those, then reordered into rank order;
//   broadcast from (h, l): local broadcast on host h, then cross broadcast from host h;
//   barrier:               local, cross, local.
// The sums are the same numbers added in another order than the flat ring's: equal to rounding.
//
// Every rank must put its sub-collectives on `local` in one order (a host's ranks would otherwise
// pair different collectives), so one collective runs at a time: the next starts when the last
// sub-collective of the one before completed. The buffers are staged through scratch memory
// (padding to a multiple of L, the reorderings); building the runtime's buckets in this layout so
// that a rank's shard is what the two levels produce in place is the next step.
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <vector>

#include "shardflow/errors.hpp"
#include "shardflow/hierarchical.hpp"
#include "shardflow/types.hpp"

namespace shardflow {
namespace {

class HierarchicalComm final : public Communicator {
 public:
  HierarchicalComm(std::shared_ptr<Communicator> local, std::shared_ptr<Communicator> cross)
      : local_(std::move(local)), cross_(std::move(cross)), L_(local_->world_size()), H_(cross_->world_size()) {}

  // On the owner's thread, never a sub-communicator's: it waits until no callback of theirs is
  // still running in this object (they hold it by a plain pointer), so that the sub-communicators,
  // whose threads run those callbacks, are destroyed here. Collectives not started are failed.
  ~HierarchicalComm() override {
    std::deque<JobPtr> left;
    {
      std::unique_lock lock(mu_);
      idle_.wait(lock, [&] { return active_ == 0; });
      left.swap(queue_);
    }
    for (auto& job : left) job->done(std::make_exception_ptr(CommError("'" + job->op.tag + "': the hierarchical communicator was destroyed")));
  }

  int rank() const override { return cross_->rank() * L_ + local_->rank(); }
  int world_size() const override { return H_ * L_; }
  std::string backend_name() const override {
    return "hierarchical (" + local_->backend_name() + " inside a host, " + cross_->backend_name() + " between hosts)";
  }
  bool supports(Device d) const override { return d.kind == Device::Kind::cpu && local_->supports(d) && cross_->supports(d); }
  std::shared_ptr<std::byte> allocate(std::size_t bytes) override { return local_->allocate(bytes); }
  void abort(const std::string& reason) override {
    local_->abort(reason);
    cross_->abort(reason);
  }

  void submit(CollectiveOp op, CollectiveDone done) override {
    {
      std::lock_guard lock(mu_);
      queue_.push_back(std::make_shared<Job>(Job{std::move(op), std::move(done), {}, {}}));
      if (running_) return;
      running_ = true;
    }
    start_next();
  }

 private:
  struct Job {
    CollectiveOp op;
    CollectiveDone done;
    std::vector<std::byte> a, b;  // scratch
  };
  using JobPtr = std::shared_ptr<Job>;
  // A step runs in the callback of the one before; true when it was the job's last (the next job
  // may start), false when it chained another sub-collective.
  using Step = std::function<bool(JobPtr)>;

  void start_next() {
    for (;;) {
      JobPtr job;
      {
        std::lock_guard lock(mu_);
        if (queue_.empty()) {
          running_ = false;
          return;
        }
        job = queue_.front();
        queue_.pop_front();
      }
      try {
        run(job);
        return;  // its sub-collectives take it from here
      } catch (...) {
        job->done(std::current_exception());  // refused before anything went out: the next one
      }
    }
  }

  // Submits `sub` to `to`; on success runs `then` (the next step), on failure ends the job. The
  // job's owner is told last: it may destroy this communicator as soon as it hears, and the
  // destructor waits for `active_` to fall to zero, which is the callback's last touch of it.
  bool chain(Communicator& to, CollectiveOp sub, const JobPtr& job, Step then) {
    sub.keep_alive = job;
    {
      std::lock_guard lock(mu_);
      ++active_;
    }
    to.submit(std::move(sub), [this, job, then = std::move(then)](std::exception_ptr e) {
      bool last = false;
      if (!e) try {
          last = then(job);
        } catch (...) {
          e = std::current_exception();
        }
      CollectiveDone tell;
      if (e || last) {
        tell = std::move(job->done);
        start_next();
      }
      if (tell) tell(e);
      std::lock_guard lock(mu_);
      if (--active_ == 0) idle_.notify_all();
    });
    return false;  // the job goes on in that callback
  }

  CollectiveOp sub(const JobPtr& job, CollectiveKind kind, const void* send, void* recv, std::size_t count, float scale,
                   const char* level) const {
    CollectiveOp o;
    o.kind = kind;
    o.dtype = job->op.dtype;
    o.send = send;
    o.recv = recv;
    o.count = count;
    o.scale = scale;
    o.tag = job->op.tag + " (" + level + ")";
    return o;
  }

  void run(const JobPtr& job) {
    const auto& op = job->op;
    const std::size_t es = dtype_size(op.dtype);
    auto done = [](const JobPtr&) { return true; };  // the job's last step ran
    switch (op.kind) {
      case CollectiveKind::allreduce: {
        const std::size_t n = op.count, c = (n + std::size_t(L_) - 1) / std::size_t(L_);
        job->a.assign(c * std::size_t(L_) * es, std::byte{0});
        job->b.assign(c * es, std::byte{0});
        if (n) std::memcpy(job->a.data(), op.send, n * es);
        chain(*local_, sub(job, CollectiveKind::reduce_scatter, job->a.data(), job->b.data(), c, 1.0f, "inside the host"), job,
              [this, c, done](JobPtr j) {
                return chain(*cross_, sub(j, CollectiveKind::allreduce, j->b.data(), j->b.data(), c, j->op.scale, "between hosts"), j,
                      [this, c, done](JobPtr j2) {
                        return chain(*local_, sub(j2, CollectiveKind::allgather, j2->b.data(), j2->a.data(), c, 1.0f, "inside the host"), j2,
                              [done](JobPtr j3) {
                                const std::size_t bytes = j3->op.count * dtype_size(j3->op.dtype);
                                if (bytes) std::memmove(j3->op.recv, j3->a.data(), bytes);
                                return done(j3);
                              });
                      });
              });
        return;
      }
      case CollectiveKind::reduce_scatter: {
        const std::size_t c = op.count * es, H = std::size_t(H_), L = std::size_t(L_);
        job->a.resize(H * L * c);
        job->b.resize(H * c);
        // Grouped by local index: a[l][h] = send[h * L + l].
        const auto* in = static_cast<const std::byte*>(op.send);
        for (std::size_t h = 0; h < H; ++h)
          for (std::size_t l = 0; l < L; ++l) std::memcpy(job->a.data() + (l * H + h) * c, in + (h * L + l) * c, c);
        chain(*local_, sub(job, CollectiveKind::reduce_scatter, job->a.data(), job->b.data(), op.count * H, 1.0f, "inside the host"), job,
              [this, done](JobPtr j) {
                return chain(*cross_, sub(j, CollectiveKind::reduce_scatter, j->b.data(), j->op.recv, j->op.count, j->op.scale, "between hosts"), j,
                      done);
              });
        return;
      }
      case CollectiveKind::allgather: {
        const std::size_t c = op.count * es, H = std::size_t(H_), L = std::size_t(L_);
        job->a.resize(H * L * c);
        job->b.resize(H * c);
        chain(*cross_, sub(job, CollectiveKind::allgather, op.send, job->b.data(), op.count, 1.0f, "between hosts"), job,
              [this, c, H, L, done](JobPtr j) {
                return chain(*local_, sub(j, CollectiveKind::allgather, j->b.data(), j->a.data(), j->op.count * H, 1.0f, "inside the host"), j,
                      [c, H, L, done](JobPtr j2) {
                        // a[l][h] is rank h * L + l's block.
                        auto* out = static_cast<std::byte*>(j2->op.recv);
                        for (std::size_t h = 0; h < H; ++h)
                          for (std::size_t l = 0; l < L; ++l) std::memcpy(out + (h * L + l) * c, j2->a.data() + (l * H + h) * c, c);
                        return done(j2);
                      });
              });
        return;
      }
      case CollectiveKind::broadcast: {
        if (op.root < 0 || op.root >= world_size())
          throw UsageError("broadcast '" + op.tag + "': root " + std::to_string(op.root) + " is not a rank of the world of " +
                           std::to_string(world_size()));
        const int root_host = op.root / L_, root_local = op.root % L_;
        auto across = [this, root_host, done](JobPtr j) {
          auto o = sub(j, CollectiveKind::broadcast, j->op.recv, j->op.recv, j->op.count, 1.0f, "between hosts");
          o.root = root_host;
          return chain(*cross_, std::move(o), j, done);
        };
        if (cross_->rank() != root_host) {
          across(job);
          return;
        }
        auto o = sub(job, CollectiveKind::broadcast, rank() == op.root ? op.send : op.recv, op.recv, op.count, 1.0f, "inside the host");
        o.root = root_local;
        chain(*local_, std::move(o), job, across);
        return;
      }
      case CollectiveKind::barrier: {
        chain(*local_, sub(job, CollectiveKind::barrier, nullptr, nullptr, 0, 1.0f, "inside the host"), job, [this, done](JobPtr j) {
          return chain(*cross_, sub(j, CollectiveKind::barrier, nullptr, nullptr, 0, 1.0f, "between hosts"), j, [this, done](JobPtr j2) {
            return chain(*local_, sub(j2, CollectiveKind::barrier, nullptr, nullptr, 0, 1.0f, "inside the host"), j2, done);
          });
        });
        return;
      }
    }
    throw UsageError("hierarchical communicator: unknown collective kind in '" + op.tag + "'");
  }

  std::shared_ptr<Communicator> local_, cross_;
  const int L_, H_;
  std::mutex mu_;
  std::condition_variable idle_;
  int active_ = 0;  // sub-collectives submitted whose callback has not finished
  std::deque<JobPtr> queue_;
  bool running_ = false;
};

}  // namespace

std::shared_ptr<Communicator> make_hierarchical(std::shared_ptr<Communicator> local, std::shared_ptr<Communicator> cross) {
  if (!local || !cross) throw UsageError("make_hierarchical: the " + std::string(!local ? "local" : "cross") + " communicator is null");
  return std::make_shared<HierarchicalComm>(std::move(local), std::move(cross));
}

}  // namespace shardflow
