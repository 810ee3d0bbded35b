// Note [Shard streams] checked without a GPU: the CPU shard ops are wrapped so that every event
// the shard records, waits for or makes the compute stream wait for goes into one trace, beside
// every collective the backend is handed (with the event it is told to wait for). The numbers
// still come from the CPU ops, so the run must also end exactly where the plain CPU run ends.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "support/forwarding_comm.hpp"
#include "support/helpers.hpp"
#include "runtime/zero/shard_ops.hpp"
#include "shardflow/errors.hpp"
#include "shardflow/shardflow.hpp"

using namespace shardflow;
using namespace std::chrono_literals;

namespace {

struct Trace {
  enum Kind { work, record, compute_after, submit, wait_returned };
  struct Entry {
    Kind kind;
    int rank;
    const void* event;  // record / compute_after / submit (the op's wait_event)
    std::string tag;    // submit: the op's tag
  };
  std::mutex mu;
  std::vector<Entry> entries;
  void add(Kind k, int rank, const void* event = nullptr, std::string tag = {}) {
    std::lock_guard lock(mu);
    entries.push_back({k, rank, event, std::move(tag)});
  }
};

thread_local int building_rank = -1;  // the rank whose Runtime makes a shard on this thread

// The CPU shard ops, with a hook before each piece of work the shard enqueues: the fakes below
// override only what they watch or break.
class CpuBackedOps : public ShardOps {
 public:
  enum class Work { copy, zero, cast, cast_to_16, upload, update, norm };
  bool on_gpu() const override { return false; }
  std::shared_ptr<std::byte> alloc(std::size_t bytes) override { return cpu_->alloc(bytes); }
  void copy(void* d, const void* s, std::size_t n) override { on_work(Work::copy), cpu_->copy(d, s, n); }
  void zero(void* d, std::size_t n) override { on_work(Work::zero), cpu_->zero(d, n); }
  void cast(DType dt, void* d, DType st, const void* s, std::size_t n) override {
    on_work(dt != DType::f32 && st == DType::f32 ? Work::cast_to_16 : Work::cast);
    cpu_->cast(dt, d, st, s, n);
  }
  void download(void* h, const void* s, std::size_t n) override { cpu_->download(h, s, n); }
  void upload(void* d, const void* h, std::size_t n) override { on_work(Work::upload), cpu_->upload(d, h, n); }
  void update(const OptimizerConfig& h, const Update& u) override { on_work(Work::update), cpu_->update(h, u); }
  void partial_norm(const std::vector<NormPart>& p, bool inf, float* out) override {
    on_work(Work::norm), cpu_->partial_norm(p, inf, out);
  }
  ClipCoef clip_coef(const float* p, int n, bool inf, float m) override { return on_work(Work::norm), cpu_->clip_coef(p, n, inf, m); }
  float last_norm() override { return cpu_->last_norm(); }

 protected:
  virtual void on_work(Work) {}

 private:
  std::unique_ptr<ShardOps> cpu_ = make_cpu_shard_ops();
};

// CPU work as usual; events are addresses of this object's slots (distinct, never dereferenced).
class TracingOps final : public CpuBackedOps {
 public:
  TracingOps(Trace& t, int rank) : t_(t), rank_(rank) {}
  void make_events(std::size_t n) override { slots_.assign(n, 0); }
  cuda::Event record(std::size_t slot) override {
    t_.add(Trace::record, rank_, event(slot));
    return event(slot);
  }
  cuda::Event event(std::size_t slot) const override { return const_cast<char*>(&slots_.at(slot)); }
  void compute_after(std::size_t slot) override { t_.add(Trace::compute_after, rank_, event(slot)); }

 private:
  void on_work(Work) override { t_.add(Trace::work, rank_); }
  Trace& t_;
  int rank_;
  std::vector<char> slots_;
};

// Hands every op to the real backend, noting its tag and the event it must wait for.
class TracingComm final : public test::ForwardingComm {
 public:
  TracingComm(std::shared_ptr<Communicator> inner, Trace& t) : ForwardingComm(std::move(inner)), t_(t) {}
  void submit(CollectiveOp op, CollectiveDone done) override {
    t_.add(Trace::submit, rank(), op.wait_event, op.tag);
    inner_->submit(std::move(op), std::move(done));
  }

 private:
  Trace& t_;
};

struct Run {
  std::vector<float> params;  // rank 0's
};

Run train(Config cfg, Trace* trace) {
  const int n = 2, P = 6, iters = 3;
  std::vector<int> sizes;
  for (int i = 0; i < P; ++i) sizes.push_back(37 + 91 * i);
  int total = 0;
  for (int s : sizes) total += s;
  std::vector<std::vector<float>> data(n, std::vector<float>(std::size_t(total)));
  auto world = InProcessWorld::create(n, 30s);
  cfg.buckets.first_cap_bytes = 800;
  cfg.buckets.cap_bytes = 2400;
  test::require_all_ok(test::run_ranks(n, [&](int r) {
    building_rank = r;
    for (int i = 0; i < total; ++i) data[std::size_t(r)][std::size_t(i)] = 0.01f * float(i % 13);
    std::shared_ptr<Communicator> comm = world->communicator(r);
    if (trace) comm = std::make_shared<TracingComm>(comm, *trace);
    Runtime rt(comm, cfg);
    std::vector<Param> h;
    int off = 0;
    for (int i = 0; i < P; ++i) {
      h.push_back(rt.register_param({"p" + std::to_string(i), {sizes[std::size_t(i)]}, DType::f32, Device::cpu(),
                                     data[std::size_t(r)].data() + off}));
      off += sizes[std::size_t(i)];
    }
    OptimizerConfig oc;
    oc.kind = OptimizerConfig::Kind::adamw;
    oc.lr = 0.01f;
    rt.configure_optimizer(oc);
    for (int it = 0; it < iters; ++it) {
      rt.zero_grad();
      for (int i = P - 1; i >= 0; --i) {
        if (cfg.zero.forward_prefetch) rt.wait_param(h[std::size_t(i)]);
        float* g = rt.grad_f32(h[std::size_t(i)]);
        for (int e = 0; e < sizes[std::size_t(i)]; ++e) g[e] = 0.02f * float((i * 5 + e * 3 + r * 7 + it) % 19) - 0.15f;
        rt.grad_ready(h[std::size_t(i)]);
      }
      rt.wait();
      if (trace && !cfg.zero.forward_prefetch) trace->add(Trace::wait_returned, r);
    }
    rt.wait_all_params();
  }));
  return Run{data[0]};
}

// The checks every configuration must pass; returns how many ops waited for a shard event.
std::size_t check_protocol(Trace& t) {
  std::map<const void*, std::size_t> last_record;  // event -> index of its latest record
  std::map<int, std::size_t> last_work;            // rank -> index of its latest work
  std::map<int, std::size_t> last_join;            // rank -> index of its latest compute_after
  std::map<int, std::size_t> join_event_record;    // rank -> record index of that compute_after's event
  std::size_t waited = 0;
  for (std::size_t i = 0; i < t.entries.size(); ++i) {
    const auto& e = t.entries[i];
    switch (e.kind) {
      case Trace::work:
        last_work[e.rank] = i;
        break;
      case Trace::record:
        last_record[e.event] = i;
        break;
      case Trace::compute_after:
        REQUIRE(last_record.count(e.event));  // the compute stream waits for something recorded
        last_join[e.rank] = i;
        join_event_record[e.rank] = last_record[e.event];
        break;
      case Trace::submit: {
        const bool shard_op = e.tag.rfind("sync bucket", 0) == 0 || e.tag == "grad norm";
        INFO("rank " << e.rank << ": " << e.tag);
        if (shard_op) CHECK(e.event != nullptr);  // data the shard wrote: the device must wait for it
        if (e.event) {
          // Recorded by the shard before the op was handed over, after the shard's latest work.
          REQUIRE(last_record.count(e.event));
          CHECK(last_record[e.event] < i);
          ++waited;
        }
        break;
      }
      case Trace::wait_returned:
        // Everything the shard enqueued before wait() returned is behind a compute-stream wait.
        INFO("rank " << e.rank << ", wait() at trace entry " << i);
        REQUIRE(last_join.count(e.rank));
        CHECK(join_event_record[e.rank] > last_work[e.rank]);
        CHECK(last_join[e.rank] < i);
        break;
    }
  }
  return waited;
}

struct ScopedFactory {
  explicit ScopedFactory(Trace& t) {
    set_shard_ops_factory_for_tests([&t](std::shared_ptr<const MemoryOps>) -> std::unique_ptr<ShardOps> {
      return std::make_unique<TracingOps>(t, building_rank);
    });
  }
  ~ScopedFactory() { set_shard_ops_factory_for_tests({}); }
};

void scenario(const Config& cfg) {
  const auto plain = train(cfg, nullptr);
  Trace t;
  Run traced;
  {
    ScopedFactory f(t);
    traced = train(cfg, &t);
  }
  CHECK(traced.params == plain.params);  // the tracing changed nothing
  CHECK(check_protocol(t) > 0);
}

}  // namespace

TEST_CASE("shard streams: every parameter sync and the norm exchange wait for the shard's event, recorded before they are issued") {
  for (int stage : {1, 2})
    for (auto partition : {Partition::flat, Partition::param})
      for (auto overlap : {Overlap::none, Overlap::interleaved}) {
        Config cfg;
        cfg.zero.stage = ZeroStage(stage);
        cfg.zero.partition = partition;
        cfg.zero.overlap = overlap;
        cfg.zero.clip_grad_norm = 0.3f;
        CAPTURE(stage);
        CAPTURE(std::string(partition == Partition::flat ? "flat" : "param"));
        CAPTURE(std::string(overlap == Overlap::none ? "none" : "interleaved"));
        scenario(cfg);
      }
}

TEST_CASE("shard streams: with a 16-bit wire each reduction waits for the shard's cast of its bucket") {
  Config cfg;
  cfg.zero.stage = ZeroStage::gradients;
  cfg.precision.comm_dtype = DType::bf16;
  Trace t;
  {
    ScopedFactory f(t);
    train(cfg, &t);
  }
  check_protocol(t);
  std::size_t reductions = 0;
  for (const auto& e : t.entries)
    if (e.kind == Trace::submit && e.tag.rfind("bucket ", 0) == 0) {
      INFO(e.tag);
      CHECK(e.event != nullptr);
      ++reductions;
    }
  CHECK(reductions > 0);
}

TEST_CASE("shard streams: forward prefetch and stage 0 keep the same ordering") {
  Config prefetch;
  prefetch.zero.stage = ZeroStage::optimizer_state;
  prefetch.zero.forward_prefetch = true;
  scenario(prefetch);
  Config stage0;  // every rank steps everything: no syncs, the norm stays local
  stage0.zero.stage = ZeroStage::ddp;
  stage0.zero.clip_grad_norm = 0.3f;
  const auto plain = train(stage0, nullptr);
  Trace t;
  Run traced;
  {
    ScopedFactory f(t);
    traced = train(stage0, &t);
  }
  CHECK(traced.params == plain.params);
  check_protocol(t);  // wait() still makes the compute stream wait for the steps
}

namespace {

// The CPU ops, except that one rank's device "faults" at its n-th update or wire cast.
class FaultyOps final : public CpuBackedOps {
 public:
  FaultyOps(bool faulty, std::atomic<int>& countdown) : faulty_(faulty), countdown_(countdown) {}

 private:
  void on_work(Work w) override {
    if (!faulty_ || (w != Work::update && w != Work::cast_to_16)) return;
    if (countdown_.fetch_sub(1) == 1)
      throw CommError(std::string("simulated device fault in the ") + (w == Work::update ? "adamw kernel" : "bf16 cast") +
                      " (cudaErrorIllegalAddress)");
  }
  bool faulty_;
  std::atomic<int>& countdown_;
};

// Runs world 2 with rank 1's shard faulting; returns each rank's error message.
std::vector<std::string> run_with_fault(Config cfg, int fault_after) {
  std::atomic<int> countdown{fault_after};
  set_shard_ops_factory_for_tests([&](std::shared_ptr<const MemoryOps>) -> std::unique_ptr<ShardOps> {
    return std::make_unique<FaultyOps>(building_rank == 1, countdown);
  });
  cfg.timeouts.collective = 20s;
  auto world = InProcessWorld::create(2, cfg.timeouts.collective);
  const auto t0 = std::chrono::steady_clock::now();
  const auto result = test::run_ranks(2, [&](int r) {
    building_rank = r;
    std::vector<float> a(1500, 0.5f), b(1500, 0.25f);
    Config c = cfg;
    c.buckets.cap_bytes = 4000;
    c.buckets.first_cap_bytes = 4000;
    Runtime rt(world->communicator(r), c);
    auto pa = rt.register_param({"a", {1500}, DType::f32, Device::cpu(), a.data()});
    auto pb = rt.register_param({"b", {1500}, DType::f32, Device::cpu(), b.data()});
    OptimizerConfig oc;
    oc.kind = OptimizerConfig::Kind::adamw;
    rt.configure_optimizer(oc);
    for (int it = 0; it < 4; ++it) {
      rt.zero_grad();
      for (auto p : {pb, pa}) {
        float* g = rt.grad_f32(p);
        for (int i = 0; i < 1500; ++i) g[i] = 0.01f * float(i % 7);
        rt.grad_ready(p);
      }
      rt.wait();
    }
  });
  set_shard_ops_factory_for_tests({});
  CHECK(std::chrono::steady_clock::now() - t0 < cfg.timeouts.collective);  // failed promptly, nobody waited it out
  return {test::message_of(result[0]), test::message_of(result[1])};
}

}  // namespace

TEST_CASE("shard streams: a device fault in one rank's optimizer step fails that rank naming the bucket, and its peer promptly") {
  Config cfg;
  cfg.zero.stage = ZeroStage::optimizer_state;
  const auto msgs = run_with_fault(cfg, 3);
  INFO("rank 0: " << msgs[0]);
  INFO("rank 1: " << msgs[1]);
  CHECK(msgs[1].find("rank 1: optimizer shard, bucket") != std::string::npos);
  CHECK(msgs[1].find("simulated device fault in the adamw kernel") != std::string::npos);
  CHECK(!msgs[0].empty());
}

TEST_CASE("shard streams: a device fault casting a bucket to its 16-bit wire fails the reduction instead of hanging it") {
  Config cfg;
  cfg.zero.stage = ZeroStage::gradients;
  cfg.precision.comm_dtype = DType::bf16;
  const auto msgs = run_with_fault(cfg, 2);
  INFO("rank 0: " << msgs[0]);
  INFO("rank 1: " << msgs[1]);
  CHECK(msgs[1].find("rank 1: preparing bucket") != std::string::npos);
  CHECK(msgs[1].find("simulated device fault in the bf16 cast") != std::string::npos);
  CHECK(!msgs[0].empty());
}
