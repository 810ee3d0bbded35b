// Note [Two-level collectives]
// Several ranks per host: rank (host h, local index l) = h * L + l talks to the L ranks of its host
// through shared memory and to the ranks of index l on the other hosts through `cross` (the
// network). Each collective is a chain of stages, each a sub-collective:
//   all-reduce of n:       local reduce-scatter (n/L each), cross all-reduce of that 1/L, local
//                          all-gather: each host puts 2 (H-1)/H of n on the network in all, 1/L per
//                          rank, all L ranks at once, where the flat ring sends 2 (W-1)/W per rank;
//   reduce-scatter to c:   one local reduce-scatter per host's group of L blocks (rank (h, l)
//                          keeps the local sum of every host's block for index l), then a cross
//                          reduce-scatter of those H blocks: its own block, summed everywhere;
//   all-gather of c:       cross all-gather (the blocks of index l from every host), then one
//                          local all-gather per host's group, straight into rank order;
//   broadcast from (h, l): local broadcast on host h, then cross broadcast from host h;
//   shift by k L:          a cross shift by k on each lane (whole hosts); with in_host, a local
//                          shift inside each host instead, nothing on the network;
//   barrier:               local, cross, local.
// The sums are the same numbers added in another order than the flat ring's: equal to rounding.
//
// Note [Lanes]
// Collectives overlap: bucket k+1's local reduce-scatter runs while bucket k crosses the network
// and bucket k-1 is gathered. What keeps that safe is that every rank puts the stages on each
// sub-communicator in one order, whatever order they complete in. Each sub-communicator is a lane:
// when a collective is submitted (in the runtime's order, the same on every rank) its stages are
// appended to their lanes at once, and a stage goes out only when it is its lane's first and the
// stage before it in its own collective has completed. The stages before the network ("in") and
// after it ("out") get two shared-memory communicators; given one, both lanes are that one and
// the order is all of a collective's local stages before the next collective's, which serializes
// the collectives as a price for the single communicator.
//
// No staging copies: the collectives read and write the caller's buffers, and only what lies
// between the levels (1/L of an all-reduce, H blocks of a reduce-scatter or all-gather) is
// scratch. ZeRO's flat shard of rank h * L + l (block h * L + l of the bucket) is what the two
// levels leave there. The exception is an all-reduce of a count that L does not divide: padded.
#include <array>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <vector>

#include "runtime/comm/scratch_pool.hpp"
#include "shardflow/errors.hpp"
#include "shardflow/hierarchical.hpp"
#include "shardflow/types.hpp"

namespace shardflow {
namespace {

enum CommLane { in_host = 0, between_hosts = 1, out_host = 2 };

class HierarchicalComm final : public Communicator {
 public:
  HierarchicalComm(std::shared_ptr<Communicator> local, std::shared_ptr<Communicator> cross, std::shared_ptr<Communicator> local_after)
      : comms_{local, std::move(cross), local_after ? std::move(local_after) : local},
        L_(local->world_size()),
        H_(comms_[between_hosts]->world_size()),
        lane_of_out_(comms_[out_host] == comms_[in_host] ? in_host : out_host) {}

  // On the owner's thread, never a sub-communicator's: it waits until no callback of theirs is
  // still running in this object (they hold it by a plain pointer), so that the sub-communicators,
  // whose threads run those callbacks, are destroyed here. Collectives not started are failed.
  ~HierarchicalComm() override {
    std::vector<JobPtr> left;
    {
      std::unique_lock lock(mu_);
      idle_.wait(lock, [&] { return active_ == 0; });
      for (auto& lane : lanes_)
        for (auto& [job, stage] : lane)
          if (job->done && (left.empty() || left.back() != job)) left.push_back(job);
    }
    for (auto& job : left)
      if (auto done = std::exchange(job->done, nullptr))
        done(std::make_exception_ptr(CommError("'" + job->op.tag + "': the hierarchical communicator was destroyed")));
  }

  int rank() const override { return comms_[between_hosts]->rank() * L_ + comms_[in_host]->rank(); }
  int world_size() const override { return H_ * L_; }
  std::string backend_name() const override {
    return "hierarchical (" + comms_[in_host]->backend_name() + " inside a host, " + comms_[between_hosts]->backend_name() +
           " between hosts)";
  }
  bool shifts_by(int distance) const override { return distance % L_ == 0; }  // Note [Shift]: by whole hosts
  int in_host_ranks() const override { return L_; }
  // A shift by whole hosts is one shift on each lane and takes what the lanes' backend takes (Gloo:
  // unequal counts, so nothing padded crosses the link); one inside the hosts, the in-host one's.
  bool shifts_unequal(bool inside) const override {
    return comms_[inside ? in_host : between_hosts]->shifts_unequal(false);
  }
  bool supports(Device d) const override {
    return d.kind == Device::Kind::cpu && comms_[in_host]->supports(d) && comms_[between_hosts]->supports(d);
  }
  std::shared_ptr<std::byte> allocate(std::size_t bytes) override { return comms_[in_host]->allocate(bytes); }
  void abort(const std::string& reason) override {
    for (int lane : {in_host, between_hosts, out_host})
      if (lane != out_host || lane_of_out_ == out_host) comms_[std::size_t(lane)]->abort(reason);
  }

  void submit(CollectiveOp op, CollectiveDone done) override {
    auto job = std::make_shared<Job>();
    job->op = std::move(op);
    job->done = std::move(done);
    try {
      plan(*job);
    } catch (...) {
      return std::exchange(job->done, nullptr)(std::current_exception());  // refused before anything went out
    }
    {
      std::lock_guard lock(mu_);
      for (std::size_t s = 0; s < job->stages.size(); ++s) lanes_[lane(job->stages[s].lane)].push_back({job, s});
    }
    pump();
  }

 private:
  struct Job;
  struct Stage {
    CommLane lane;
    CollectiveOp op;
    std::function<void(Job&)> after;  // on its success (a padded all-reduce: the copy back)
  };
  struct Job {
    CollectiveOp op;
    CollectiveDone done;
    std::shared_ptr<std::byte> a, b;  // scratch from scratch_ (Note [Scratch kept between collectives])
    std::vector<Stage> stages;
    std::size_t next = 0;  // the stage that may go out: the ones before it completed
    bool failed = false;
  };
  using JobPtr = std::shared_ptr<Job>;

  std::size_t lane(CommLane l) const { return std::size_t(l == out_host ? lane_of_out_ : l); }

  // Sends out every stage that is first in its lane and whose collective is ready for it, in lane
  // order. One thread sends at a time (a sub-communicator may complete inline, and its callback
  // pumps again): the others leave a mark and that thread looks again.
  void pump() {
    std::unique_lock lock(mu_);
    if (pumping_) {
      again_ = true;
      return;
    }
    pumping_ = true;
    for (;;) {
      again_ = false;
      std::vector<std::pair<JobPtr, std::size_t>> ready;
      for (auto& q : lanes_)
        while (!q.empty() && (q.front().first->failed || q.front().first->next == q.front().second)) {
          if (!q.front().first->failed) ready.push_back(q.front());
          q.pop_front();
        }
      if (ready.empty() && !again_) break;
      active_ += int(ready.size());
      lock.unlock();
      for (auto& [job, s] : ready) send(job, s);
      lock.lock();
    }
    pumping_ = false;
  }

  // The job's owner is told last: it may destroy this communicator as soon as it hears, and the
  // destructor waits for `active_` to fall to zero, which is the callback's last touch of it.
  void send(const JobPtr& job, std::size_t s) {
    Stage& stage = job->stages[s];
    CollectiveOp op = stage.op;
    op.keep_alive = job;
    comms_[lane(stage.lane)]->submit(std::move(op), [this, job, s](std::exception_ptr e) {
      if (e) e = in_our_ranks(e, job->stages[s].lane);
      bool last = false;
      if (!e) try {
          if (job->stages[s].after) job->stages[s].after(*job);
          last = s + 1 == job->stages.size();
        } catch (...) {
          e = std::current_exception();
        }
      CollectiveDone tell;
      {
        std::lock_guard lock(mu_);
        if (e) job->failed = true;
        else job->next = s + 1;
        if (e || last) tell = std::move(job->done);
      }
      pump();
      if (tell) tell(e);
      std::lock_guard lock(mu_);
      if (--active_ == 0) idle_.notify_all();
    });
  }

  // A sub-communicator's error names its own ranks; the same error, with which of ours they are.
  std::exception_ptr in_our_ranks(std::exception_ptr e, CommLane l) const {
    const bool cross = l == between_hosts;
    const int host = comms_[between_hosts]->rank(), local = comms_[in_host]->rank();
    std::string ranks;
    for (int k = 0; k < (cross ? H_ : L_); ++k) ranks += (k ? ", " : "") + std::to_string(cross ? k * L_ + local : host * L_ + k);
    const std::string where = "rank " + std::to_string(rank()) + " (host " + std::to_string(host) + ", local rank " +
                              std::to_string(local) + "), " + (cross ? "between hosts" : "inside its host") + " (ranks " +
                              ranks + " there numbered 0 to " + std::to_string((cross ? H_ : L_) - 1) + "): ";
    try {
      std::rethrow_exception(e);
    } catch (const TimeoutError& x) {
      return std::make_exception_ptr(TimeoutError(where + x.what()));
    } catch (const MismatchError& x) {
      return std::make_exception_ptr(MismatchError(where + x.what()));
    } catch (const UsageError& x) {
      return std::make_exception_ptr(UsageError(where + x.what()));
    } catch (const CommError& x) {
      return std::make_exception_ptr(CommError(where + x.what()));
    } catch (...) {
      return e;  // not shardflow's: as it came
    }
  }

  CollectiveOp sub(const Job& job, CollectiveKind kind, const void* send, void* recv, std::size_t count, float scale,
                   const char* level) const {
    CollectiveOp o;
    o.kind = kind;
    o.dtype = job.op.dtype;
    o.send = send;
    o.recv = recv;
    o.count = count;
    o.scale = scale;
    o.tag = job.op.tag + " (" + level + ")";
    return o;
  }

  // The stages of one collective and its scratch; a padded all-reduce copies the caller's buffer
  // in here (ready when it submits, untouched until told) and back after its last stage.
  void plan(Job& job) const {
    const auto& op = job.op;
    const std::size_t es = dtype_size(op.dtype), H = std::size_t(H_), L = std::size_t(L_);
    auto& st = job.stages;
    check_shift(op, "hierarchical rank " + std::to_string(rank()), /*unequal=*/shifts_unequal(op.in_host), /*in_host=*/true);
    switch (op.kind) {
      case CollectiveKind::allreduce: {
        const std::size_t n = op.count, c = (n + L - 1) / L;
        job.b = scratch_.take(c * es);  // the local reduce-scatter writes all of it
        const void* from = op.send;
        void* into = op.recv;
        if (n % L != 0) {  // padded to L blocks of c
          job.a = scratch_.take(c * L * es);
          if (n) std::memcpy(job.a.get(), op.send, n * es);
          // Only the n come back; the padding sums on its own, as zeros rather than a reused block's bits.
          std::memset(job.a.get() + n * es, 0, (c * L - n) * es);
          from = into = job.a.get();
        }
        st.push_back({in_host, sub(job, CollectiveKind::reduce_scatter, from, job.b.get(), c, 1.0f, "inside the host"), {}});
        st.push_back({between_hosts, sub(job, CollectiveKind::allreduce, job.b.get(), job.b.get(), c, op.scale, "between hosts"), {}});
        st.push_back({out_host, sub(job, CollectiveKind::allgather, job.b.get(), into, c, 1.0f, "inside the host"), {}});
        if (n % L != 0)
          st.back().after = [](Job& j) {
            if (j.op.count) std::memcpy(j.op.recv, j.a.get(), j.op.count * dtype_size(j.op.dtype));
          };
        return;
      }
      case CollectiveKind::reduce_scatter: {
        // Host g's L blocks are one local reduce-scatter: rank (h, l) gets block g * L + l summed
        // inside its host, into b[g]; H of them fill b, and the cross reduce-scatter of b leaves
        // rank (h, l) block h * L + l summed everywhere. No block moves but by the collectives.
        const std::size_t c = op.count * es;
        job.b = scratch_.take(H * c);  // the local reduce-scatters write all of it
        const auto* in = static_cast<const std::byte*>(op.send);
        for (std::size_t g = 0; g < H; ++g)
          st.push_back({in_host, sub(job, CollectiveKind::reduce_scatter, in + g * L * c, job.b.get() + g * c, op.count, 1.0f, "inside the host"), {}});
        st.push_back({between_hosts, sub(job, CollectiveKind::reduce_scatter, job.b.get(), op.recv, op.count, op.scale, "between hosts"), {}});
        return;
      }
      case CollectiveKind::allgather: {
        // The reverse: the cross all-gather puts host g's block of index l in b[g], and a local
        // all-gather of each b[g] writes host g's L blocks where rank order has them.
        const std::size_t c = op.count * es;
        auto* out = static_cast<std::byte*>(op.recv);
        if (op.in_host) {  // each host's block of this local index is in place already: in place inside the hosts
          const std::size_t l = std::size_t(comms_[in_host]->rank());
          for (std::size_t g = 0; g < H; ++g)
            st.push_back({out_host, sub(job, CollectiveKind::allgather, out + (g * L + l) * c, out + g * L * c, op.count, 1.0f, "inside the host"), {}});
          return;
        }
        job.b = scratch_.take(H * c);  // the cross all-gather writes all of it
        st.push_back({between_hosts, sub(job, CollectiveKind::allgather, op.send, job.b.get(), op.count, 1.0f, "between hosts"), {}});
        for (std::size_t g = 0; g < H; ++g)
          st.push_back({out_host, sub(job, CollectiveKind::allgather, job.b.get() + g * c, out + g * L * c, op.count, 1.0f, "inside the host"), {}});
        return;
      }
      case CollectiveKind::broadcast: {
        if (op.root < 0 || op.root >= world_size())
          throw UsageError("broadcast '" + op.tag + "': root " + std::to_string(op.root) + " is not a rank of the world of " +
                           std::to_string(world_size()));
        const int root_host = op.root / L_;
        if (comms_[between_hosts]->rank() == root_host) {
          st.push_back({in_host, sub(job, CollectiveKind::broadcast, rank() == op.root ? op.send : op.recv, op.recv, op.count, 1.0f, "inside the host"), {}});
          st.back().op.root = op.root % L_;
        }
        st.push_back({between_hosts, sub(job, CollectiveKind::broadcast, op.recv, op.recv, op.count, 1.0f, "between hosts"), {}});
        st.back().op.root = root_host;
        return;
      }
      case CollectiveKind::shift: {
        if (op.in_host) {  // rank (h, l)'s block to (h, l + distance mod L): one shift inside host h
          st.push_back({in_host, sub(job, CollectiveKind::shift, op.send, op.recv, op.count, 1.0f, "inside the host"), {}});
          st.back().op.distance = op.distance;
          st.back().op.recv_count = op.recv_count;
          return;
        }
        // Rank (h, l)'s block to (h + distance / L, l): one shift of the hosts on lane l. A
        // distance L does not divide would carry some ranks' blocks one host further than
        // others', which no uniform stage of either level moves.
        if (op.distance % L_ != 0)
          throw UsageError("shift '" + op.tag + "' by " + std::to_string(op.distance) + " rank(s): over two levels (" +
                           std::to_string(L_) + " ranks a host) a shift moves by whole hosts, a multiple of " + std::to_string(L_));
        st.push_back({between_hosts, sub(job, CollectiveKind::shift, op.send, op.recv, op.count, 1.0f, "between hosts"), {}});
        st.back().op.distance = op.distance / L_;
        st.back().op.recv_count = op.recv_count;
        return;
      }
      case CollectiveKind::barrier:
        for (CommLane l : {in_host, between_hosts, out_host})
          st.push_back({l, sub(job, CollectiveKind::barrier, nullptr, nullptr, 0, 1.0f, l == between_hosts ? "between hosts" : "inside the host"), {}});
        return;
    }
    throw UsageError("hierarchical communicator: unknown collective kind in '" + op.tag + "'");
  }

  const std::array<std::shared_ptr<Communicator>, 3> comms_;  // by CommLane; out_host may be in_host's
  const int L_, H_;
  const CommLane lane_of_out_;
  std::mutex mu_;
  std::condition_variable idle_;
  int active_ = 0;  // stages sent whose callback has not finished
  std::array<std::deque<std::pair<JobPtr, std::size_t>>, 3> lanes_;  // (collective, stage) in the order they go out
  bool pumping_ = false, again_ = false;
  mutable ScratchPool scratch_;  // plan() takes the jobs' scratch from it; it has its own lock
};

}  // namespace

std::shared_ptr<Communicator> make_hierarchical(std::shared_ptr<Communicator> local, std::shared_ptr<Communicator> cross,
                                                std::shared_ptr<Communicator> local_after) {
  if (!local || !cross) throw UsageError("make_hierarchical: the " + std::string(!local ? "local" : "cross") + " communicator is null");
  if (local_after && (local_after->world_size() != local->world_size() || local_after->rank() != local->rank()))
    throw UsageError("make_hierarchical: local_after (rank " + std::to_string(local_after->rank()) + " of " +
                     std::to_string(local_after->world_size()) + ") is not the same group as local (rank " +
                     std::to_string(local->rank()) + " of " + std::to_string(local->world_size()) + ")");
  return std::make_shared<HierarchicalComm>(std::move(local), std::move(cross), std::move(local_after));
}

}  // namespace shardflow
