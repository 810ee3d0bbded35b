// The shared-memory backend. Rank 0 creates one POSIX shared-memory segment per communicator:
// a header (barrier, abort flag and reason), one slot per rank (pid, the barrier generation it
// reached, the signatures and buffer references of its current and next op) and one staging area
// per rank. The peer algorithms (peer_collective.hpp) then run over every rank's view of the op,
// piece by piece for ops larger than a staging area.
//
// Note [Registered buffers]
// A buffer from ShmComm::allocate() is a shared-memory segment of its own, named after the world's
// segment, the owner's rank and a serial number. An op on such a buffer publishes (serial, offset)
// and peers map the segment on first use and read or write it in place: no staging copy, which is
// what makes shm several times faster than Gloo (the runtime's buckets come from allocate()).
// Any other buffer is staged: copied into the rank's staging area first, out of it afterwards.
// Ranks decide for themselves; one op may mix registered and staged ranks. Segments are unlinked
// when freed; ones left by a killed job are swept by the next job's rank 0 (owner pid is gone).
//
// Note [Shared-memory barrier]
// A central counter and a generation word in the segment. The last rank to arrive resets the
// counter and bumps the generation; the others spin briefly, then sleep on the generation with a
// futex (shared, not FUTEX_PRIVATE: the waiters are different processes) in slices of at most
// 50 ms. Between slices a waiter checks the abort flag, its deadline (Config::timeouts.collective: naming the
// ranks that have not arrived) and — every 100 ms — whether the other ranks' processes still
// exist, so a rank killed with SIGKILL is reported within a fraction of a second, not at timeout.
//
// Note [A rank dead inside the barrier]
// The liveness check asked only after the ranks that had not marked their arrival. A rank killed
// between marking it and adding itself to the count, or the last to arrive killed between the
// count and the generation's bump, looked arrived: the barrier could never complete, and the others
// waited out the whole collective timeout (then a TimeoutError) instead of naming the death within
// 100 ms, which in-place recovery needs to go on at once. While the generation has not moved, any
// rank whose process is gone fails the barrier: one that arrived and died could not do the next op
// either. A barrier that completed (its last rank bumped the generation, then exited at the end of
// the job) is not mistaken for one: the generation is read again before failing.
//
// Note [Leaving the barrier]
// A rank that gives up waiting (a dead peer, its deadline, an abort) used to leave its arrival in
// the count. A rank that had passed the abort check just before then came, counted itself last and
// completed the generation: through a barrier every other rank failed, into the op's data phase
// over buffers their runtimes were already taking back (and a barrier op returned success on it
// alone). (The first test_launch shrink run under TSan of 2026-12-02 saw a rank two ops ahead of a
// dead one; how it got there is not known.) Now a rank that gives up takes its mark back first
// and then reads the count; the last arriver, after counting itself, reads every rank's mark
// before it completes (each side's write before its read, sequentially consistent: at least one
// sees the other's).
//  - The last arriver sees a mark taken back: it fails the barrier (abort, CommError naming the
//    ranks that left) instead of completing it.
//  - The leaver sees the count full (or already reset): the last arriver may have read its mark
//    before it was taken back and is completing. It waits for the generation to move (then it goes
//    on, the barrier passed) or for the abort (then it fails), briefly bounded.
//  - Otherwise the last arriver has not counted itself yet and will see the mark taken back.
// A rank killed after marking keeps its mark: it did arrive, and the next barrier names its death.
// Whatever else put arrivals in the count, a generation completes only when every rank's mark
// names it: a rank dead ops behind has no mark there.
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "runtime/comm/peer_collective.hpp"
#include "runtime/comm/shm_names.hpp"
#include "runtime/comm/shm_segment.hpp"
#include "runtime/comm/stream_worker.hpp"
#include "runtime/process/fault_injection.hpp"
#include "shardflow/errors.hpp"
#include "shardflow/shm.hpp"
#include "shardflow/store.hpp"

namespace shardflow {
namespace {

using shm::futex_wait;
using shm::futex_wake_all;
using shm::host_identity;
using shm::process_dead;
using shm::Segment;
using shm::sweep_stale_segments;

constexpr std::uint32_t kMagic = 0x31464d53;  // "SMF1"
constexpr int kMaxRanks = 512;

struct alignas(64) RankSlot {
  std::atomic<std::int32_t> pid;
  std::atomic<std::uint32_t> arrived;  // the barrier generation this rank last reached
  std::atomic<std::uint32_t> left;     // that generation + 1, once this rank gave up on it
  // Indexed by op number parity: a rank that finished op k may write op k+1's signature while a
  // slower peer still compares op k's (a barrier op has no exit barrier).
  peer::OpSig sig[2];
  struct BufRef {
    std::int64_t serial = -1;  // -1: staged (Note [Registered buffers])
    std::uint64_t offset = 0;
  } send[2], recv[2];
};

struct alignas(64) Header {
  std::uint32_t magic;
  std::int32_t world;
  std::uint64_t staging_bytes;
  std::uint64_t staging_offset;
  alignas(64) std::atomic<std::uint32_t> abort_claim;
  std::atomic<std::uint32_t> aborted;
  char reason[2048];
  alignas(64) std::atomic<std::uint32_t> count;
  alignas(64) std::atomic<std::uint32_t> generation;  // the futex word
};
static_assert(std::atomic<std::uint32_t>::is_always_lock_free && std::atomic<std::int32_t>::is_always_lock_free,
              "atomics in shared memory must be lock-free (address-free)");

std::size_t round_up(std::size_t v, std::size_t a) { return (v + a - 1) / a * a; }

// This rank's registered buffers, shared with their deleters (which may outlive the communicator).
class Registry {
 public:
  struct Entry {
    std::int64_t serial;
    std::size_t bytes;
  };
  void add(const std::byte* base, Entry e) {
    std::lock_guard lock(mu_);
    entries_[base] = e;
  }
  void remove(const std::byte* base) {
    std::lock_guard lock(mu_);
    entries_.erase(base);
  }
  // The registered buffer holding [p, p + bytes), as (serial, offset); serial -1 if none.
  RankSlot::BufRef find(const void* p, std::size_t bytes) const {
    const auto* b = static_cast<const std::byte*>(p);
    std::lock_guard lock(mu_);
    auto it = entries_.upper_bound(b);
    if (it == entries_.begin()) return {};
    --it;
    if (b + bytes > it->first + it->second.bytes) return {};
    return {it->second.serial, std::uint64_t(b - it->first)};
  }

 private:
  mutable std::mutex mu_;
  std::map<const std::byte*, Entry> entries_;
};

class ShmComm final : public Communicator {
 public:
  explicit ShmComm(const ShmOptions& o)
      : rank_(o.rank), n_(o.world_size), timeout_(o.timeout), stream_([this](const CollectiveOp& op) { execute(op); }) {
    if (n_ < 1 || rank_ < 0 || rank_ >= n_)
      throw UsageError("shm: rank " + std::to_string(rank_) + " is outside world size " + std::to_string(n_));
    if (n_ > kMaxRanks) throw UsageError("shm: world size " + std::to_string(n_) + " exceeds " + std::to_string(kMaxRanks));
    if (o.staging_bytes < 4096) throw UsageError("shm: ShmOptions::staging_bytes must be at least 4096");
    segment_ = rendezvous(o);
    registry_ = std::make_shared<Registry>();
    header_ = reinterpret_cast<Header*>(segment_->base());
    slots_ = reinterpret_cast<RankSlot*>(segment_->base() + sizeof(Header));
    staging_bytes_ = header_->staging_bytes;
    for (int r = 0; r < n_; ++r)
      staging_.push_back(segment_->base() + header_->staging_offset + std::size_t(r) * staging_bytes_);
  }

  ~ShmComm() override {
    // Peers would otherwise wait for our share of their collective until they notice we are gone.
    if (stream_.busy()) abort("rank " + std::to_string(rank_) + "'s communicator was destroyed with collectives pending");
  }

  int rank() const override { return rank_; }
  int world_size() const override { return n_; }
  std::string backend_name() const override { return "shm"; }
  bool supports(Device d) const override { return d.kind == Device::Kind::cpu; }
  void submit(CollectiveOp op, CollectiveDone done) override { stream_.push(std::move(op), std::move(done)); }
  void abort(const std::string& reason) override { abort_world("rank " + std::to_string(rank_) + " aborted: " + reason); }

  // Note [Registered buffers]
  std::shared_ptr<std::byte> allocate(std::size_t bytes) override {
    const std::int64_t serial = next_serial_++;
    // Prefaulted: the owner writes its whole bucket every step (Note [Shared pages reserved and prefaulted]).
    auto seg = std::make_shared<Segment>(buffer_name(rank_, serial), true, round_up(bytes, 64), /*prefault=*/true);
    auto* base = reinterpret_cast<std::byte*>(seg->base());
    registry_->add(base, {serial, seg->bytes()});
    return std::shared_ptr<std::byte>(base, [seg, registry = registry_](std::byte* p) mutable {
      registry->remove(p);
      seg->unlink();  // peers that mapped it keep their mapping
    });
  }

 private:
  std::unique_ptr<Segment> rendezvous(const ShmOptions& o) {
    const auto client = connect_store(o);
    PrefixStore store(*client, o.key_prefix);
    const std::string me = host_identity();
    const std::size_t staging = round_up(o.staging_bytes, 4096);
    const std::size_t staging_offset = round_up(sizeof(Header) + sizeof(RankSlot) * std::size_t(n_), 4096);
    std::unique_ptr<Segment> seg;
    if (rank_ == 0) {
      sweep_stale_segments();
      std::random_device rd;
      const std::string name = "/" + shm::segment_prefix(::getpid()) + std::to_string(rd());
      world_name_ = name;
      seg = std::make_unique<Segment>(name, true, staging_offset + staging * std::size_t(n_));
      auto* h = new (seg->base()) Header{};  // the pages are zero: every atomic starts at 0
      h->world = n_;
      h->staging_bytes = staging;
      h->staging_offset = staging_offset;
      h->magic = kMagic;
      store.set("host/0", me);
      store.set("segment", name);
    } else {
      const std::string host0 = store.get("host/0");
      if (host0 != me)
        throw CommError("shm: rank " + std::to_string(rank_) + " runs on " + me + ", rank 0 on " + host0 +
                        ": the shm backend needs every rank on one host (use gloo across hosts)");
      const std::string name = store.get("segment");
      world_name_ = name;
      seg = std::make_unique<Segment>(name, false, 0);
      const auto* h = reinterpret_cast<const Header*>(seg->base());
      if (seg->bytes() < sizeof(Header) || h->magic != kMagic)
        throw CommError("shm: segment '" + name + "' is not a shardflow segment");
      if (h->world != n_)
        throw MismatchError("shm: rank " + std::to_string(rank_) + " was started with world size " + std::to_string(n_) +
                            ", rank 0 with " + std::to_string(h->world));
    }
    auto* slots = reinterpret_cast<RankSlot*>(seg->base() + sizeof(Header));
    slots[rank_].pid.store(::getpid(), std::memory_order_release);
    // Once every rank has mapped the segment its name is no longer needed: unlinking it now means
    // no crash can leave it behind in /dev/shm.
    if (store.add("attached", 1) == n_) store.set("ready", "1");
    store.wait({"ready"}, o.timeout);
    if (rank_ == 0) seg->unlink();
    return seg;
  }

  template <class What>
  [[noreturn]] void fail_aborted(const What& what) {
    throw CommError(what() + ": aborted: " + std::string(header_->reason));
  }

  void abort_world(const std::string& reason) {
    std::uint32_t expected = 0;
    if (header_->abort_claim.compare_exchange_strong(expected, 1)) {
      std::strncpy(header_->reason, reason.c_str(), sizeof(header_->reason) - 1);
      header_->aborted.store(1, std::memory_order_release);
    }
    futex_wake_all(&header_->generation);
  }

  // Rank r's process is gone: every rank hears it at once (abort), and this one raises it.
  template <class What>
  [[noreturn]] void fail_dead(const What& what, int r, std::int32_t pid) {
    const std::string msg = what() + ": rank " + std::to_string(r) + " (pid " + std::to_string(pid) +
                            ") died before it reached this collective";
    abort_world(msg);
    throw CommError(msg);
  }

  // Note [Shared-memory barrier]
  template <class What>
  void sync(const What& what) {
    Header& h = *header_;
    if (h.aborted.load(std::memory_order_acquire)) fail_aborted(what);
    const std::uint32_t gen = h.generation.load(std::memory_order_acquire);
    slots_[rank_].arrived.store(gen + 1, std::memory_order_seq_cst);
    if (test_fault::armed()) test_fault::reached("barrier");  // test_launch's kill between the two
    shm::barrier_hook(rank_, shm::BarrierPoint::counting);
    if (h.count.fetch_add(1, std::memory_order_seq_cst) + 1 == std::uint32_t(n_)) {
      // Note [Leaving the barrier]: complete it only if nobody took their mark back.
      const std::string left = missing(gen);
      if (!left.empty()) {
        const std::string msg = what() + ": rank(s) " + left + " gave up on this barrier before it completed";
        abort_world(msg);
        throw CommError(msg);
      }
      h.count.store(0, std::memory_order_relaxed);
      h.generation.store(gen + 1, std::memory_order_release);
      futex_wake_all(&h.generation);
      return;
    }
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    while (h.generation.load(std::memory_order_acquire) == gen && clock::now() - start < std::chrono::microseconds(50))
      std::this_thread::yield();
    auto next_liveness = start + std::chrono::milliseconds(100);
    const auto deadline = start + timeout_;
    while (h.generation.load(std::memory_order_acquire) == gen) {
      if (h.aborted.load(std::memory_order_acquire)) {
        if (leave(gen)) return;
        fail_aborted(what);
      }
      const auto now = clock::now();
      if (now >= deadline) {
        const std::string msg = what() + ": " + late(gen);
        if (leave(gen)) return;
        abort_world("rank " + std::to_string(rank_) + " timed out: " + msg);
        throw TimeoutError(msg);
      }
      if (now >= next_liveness) {
        next_liveness = now + std::chrono::milliseconds(100);
        for (int r = 0; r < n_; ++r) {  // Note [A rank dead inside the barrier]
          const auto pid = slots_[r].pid.load(std::memory_order_acquire);
          if (r != rank_ && process_dead(pid) && h.generation.load(std::memory_order_acquire) == gen) {
            if (leave(gen)) return;
            fail_dead(what, r, pid);
          }
        }
      }
      futex_wait(&h.generation, gen, std::min<clock::duration>(std::chrono::milliseconds(50), deadline - now));
    }
  }

  // Note [Leaving the barrier]: this rank gives up on generation `gen`. True: the barrier completed
  // after all (go on); false: it did not and never will with this rank's arrival (fail).
  bool leave(std::uint32_t gen) {
    Header& h = *header_;
    slots_[rank_].left.store(gen + 1, std::memory_order_seq_cst);  // before the mark: see late()
    slots_[rank_].arrived.store(gen, std::memory_order_seq_cst);
    shm::barrier_hook(rank_, shm::BarrierPoint::leaving);
    const std::uint32_t count = h.count.load(std::memory_order_seq_cst);
    if (h.generation.load(std::memory_order_seq_cst) != gen) return true;
    if (count != 0 && count < std::uint32_t(n_)) return false;
    // The last arriver counted itself and is deciding: it bumps the generation or aborts within
    // microseconds (a bound in case it died in between).
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    while (std::chrono::steady_clock::now() < until) {
      if (h.generation.load(std::memory_order_acquire) != gen) return true;
      if (h.aborted.load(std::memory_order_acquire)) return false;
      std::this_thread::yield();
    }
    return h.generation.load(std::memory_order_acquire) != gen;
  }

  std::string missing(std::uint32_t gen) const {
    std::string out;
    for (int r = 0; r < n_; ++r)
      if (slots_[r].arrived.load(std::memory_order_seq_cst) != gen + 1) out += (out.empty() ? "" : ", ") + std::to_string(r);
    return out;
  }

  // Note [Naming the late ranks]: the deadline's message. A rank whose own deadline came a moment
  // earlier (ranks' deadlines differ by their arrival) has taken its mark back by now; missing()
  // alone named it beside the rank that never came, blaming a rank that had waited too (a clean
  // clone's `make test` saw "rank(s) 0, 2" where only 2 was absent). A rank that left says so in
  // its slot before it takes the mark back, so a mark found missing is read with its reason.
  std::string late(std::uint32_t gen) const {
    std::string absent, gave_up;
    for (int r = 0; r < n_; ++r) {
      if (slots_[r].arrived.load(std::memory_order_seq_cst) == gen + 1) continue;
      std::string& list = slots_[r].left.load(std::memory_order_seq_cst) == gen + 1 ? gave_up : absent;
      list += (list.empty() ? "" : ", ") + std::to_string(r);
    }
    const std::string within = std::to_string(timeout_.count()) + " ms (Config::timeouts.collective)";
    if (absent.empty()) return "rank(s) " + gave_up + " arrived but gave up before the barrier completed within " + within;
    return "rank(s) " + absent + " did not arrive within " + within +
           (gave_up.empty() ? "" : "; rank(s) " + gave_up + " arrived and gave up already");
  }

  std::string buffer_name(int rank, std::int64_t serial) const {
    return world_name_ + "-r" + std::to_string(rank) + "-" + std::to_string(serial);
  }

  // Rank r's registered buffer `ref`, mapped into this process on first use (stream thread only).
  char* peer_buffer(int r, const RankSlot::BufRef& ref) {
    auto& seg = peer_segments_[{r, ref.serial}];
    if (!seg) {
      if (r == rank_) throw CommError("shm: own buffer " + std::to_string(ref.serial) + " is not mapped");
      seg = std::make_unique<Segment>(buffer_name(r, ref.serial), false, 0);
    }
    return seg->base() + ref.offset;
  }

  void execute(const CollectiveOp& op) {
    const std::uint64_t seq = seq_++;
    const auto parity = std::size_t(seq & 1);
    const std::size_t es = dtype_size(op.dtype);
    const bool two_buffers = op.kind == CollectiveKind::allreduce || op.kind == CollectiveKind::broadcast;
    const std::size_t send_elems = op.kind == CollectiveKind::reduce_scatter ? op.count * std::size_t(n_) : op.count;
    const std::size_t recv_elems = op.kind == CollectiveKind::allgather ? op.count * std::size_t(n_) : op.count;
    RankSlot& me = slots_[rank_];
    me.sig[parity] = peer::OpSig::of(op, seq);
    me.send[parity] = op.send && op.count ? registry_->find(op.send, send_elems * es) : RankSlot::BufRef{};
    me.recv[parity] = two_buffers && op.recv && op.count ? registry_->find(op.recv, recv_elems * es) : RankSlot::BufRef{};
    auto what = [&] {
      return "rank " + std::to_string(rank_) + ": shm " + collective_name(op.kind) + " #" + std::to_string(seq) + " ('" +
             op.tag + "')";
    };
    const peer::Sync sync = [&] { this->sync(what); };
    try {
      check_shift(op, what());
    } catch (const UsageError& e) {
      abort_world(e.what());  // the peers fail now rather than at their timeout
      throw;
    }
    // Elements of one piece: an all-reduce or all-gather piece fills a staging area; a
    // reduce-scatter piece holds one block per rank.
    const std::size_t cap = op.kind == CollectiveKind::reduce_scatter ? staging_bytes_ / es / std::size_t(n_) : staging_bytes_ / es;
    const std::size_t pieces = op.kind == CollectiveKind::barrier || op.count == 0 ? 0 : (op.count + cap - 1) / cap;
    char* const mine = static_cast<char*>(staging_[std::size_t(rank_)]);
    const bool stage_send = me.send[parity].serial < 0;
    std::vector<const void*> send(static_cast<std::size_t>(n_));
    std::vector<void*> recv(static_cast<std::size_t>(n_));
    for (std::size_t p = 0; p == 0 || p < pieces; ++p) {
      const std::size_t off = p * cap, len = pieces ? std::min(cap, op.count - off) : 0;
      // Our own staging area is free since the last op's exit barrier.
      if (pieces && stage_send) stage_in(op, off, len, mine);
      sync();  // inputs are staged; for the first piece also the entry barrier of the op
      if (p == 0) check_matching(parity, seq, what);
      if (!pieces) return;
      // Every rank's view of this piece: its registered buffer in place, or its staging area.
      for (int r = 0; r < n_; ++r) {
        const auto R = std::size_t(r);
        const auto& sref = slots_[r].send[parity];
        const auto& rref = slots_[r].recv[parity];
        char* staged = static_cast<char*>(staging_[R]);
        // Our own registered buffers are the op's pointers; a peer's are mapped here.
        const char* sbase = r == rank_ ? static_cast<const char*>(op.send) : sref.serial < 0 ? nullptr : peer_buffer(r, sref);
        char* rbase = r == rank_ ? static_cast<char*>(op.recv) : rref.serial < 0 ? nullptr : peer_buffer(r, rref);
        if (op.kind == CollectiveKind::reduce_scatter)  // block `rank_` of rank r's input
          send[R] = sref.serial < 0 ? staged + std::size_t(rank_) * len * es : sbase + (std::size_t(rank_) * op.count + off) * es;
        else
          send[R] = sref.serial < 0 ? staged : sbase + off * es;
        recv[R] = rref.serial < 0 ? staged : rbase + off * es;
      }
      auto* out = static_cast<char*>(op.recv);
      switch (op.kind) {
        case CollectiveKind::allreduce:
          peer::allreduce(op.dtype, len, op.scale, rank_, n_, send, recv, out + off * es, sync);
          break;
        case CollectiveKind::reduce_scatter:
          peer::reduce_scatter(op.dtype, len, op.scale, n_, send, out + off * es);
          break;
        case CollectiveKind::allgather:
          peer::allgather(op.dtype, len, op.count, n_, send, out + off * es);
          break;
        case CollectiveKind::broadcast:
          peer::copy(out + off * es, send[std::size_t(op.root)], len * es);
          break;
        case CollectiveKind::shift:
          peer::copy(out + off * es, send[std::size_t(shift_source(rank_, n_, op.distance))], len * es);
          break;
        case CollectiveKind::barrier:
          break;
      }
      sync();  // nobody reads a staging area or a peer's buffer any more
    }
  }

  void stage_in(const CollectiveOp& op, std::size_t off, std::size_t len, char* mine) const {
    const std::size_t es = dtype_size(op.dtype);
    const auto* in = static_cast<const char*>(op.send);
    switch (op.kind) {
      case CollectiveKind::reduce_scatter:
        for (int j = 0; j < n_; ++j)
          peer::copy(mine + std::size_t(j) * len * es, in + (std::size_t(j) * op.count + off) * es, len * es);
        break;
      case CollectiveKind::broadcast:
        if (rank_ == op.root) peer::copy(mine, in + off * es, len * es);
        break;
      default:
        peer::copy(mine, in + off * es, len * es);
    }
  }

  template <class What>
  void check_matching(std::size_t parity, std::uint64_t seq, const What& what) {
    std::vector<peer::OpSig> sigs(static_cast<std::size_t>(n_));
    for (int r = 0; r < n_; ++r) sigs[std::size_t(r)] = slots_[r].sig[parity];
    if (auto msg = peer::mismatch(sigs.data(), n_)) {
      // Note [A dead rank's signature is not a mismatch]
      const int gone = peer::dead_behind(sigs.data(), n_, seq, [&](int r) {
        return r != rank_ && process_dead(slots_[r].pid.load(std::memory_order_acquire));
      });
      if (gone >= 0) fail_dead(what, gone, slots_[gone].pid.load(std::memory_order_acquire));
      abort_world(*msg);  // every rank reaches the same verdict; later ops fail at once
      throw MismatchError(*msg);
    }
  }

  const int rank_, n_;
  const std::chrono::milliseconds timeout_;
  std::unique_ptr<Segment> segment_;
  Header* header_ = nullptr;
  RankSlot* slots_ = nullptr;
  std::vector<void*> staging_;
  std::size_t staging_bytes_ = 0;
  std::string world_name_;
  std::shared_ptr<Registry> registry_;
  std::atomic<std::int64_t> next_serial_{0};
  std::map<std::pair<int, std::int64_t>, std::unique_ptr<Segment>> peer_segments_;  // stream thread only
  std::uint64_t seq_ = 0;  // stream thread only
  StreamWorker stream_;    // last: its thread uses the members above
};

}  // namespace

std::shared_ptr<Communicator> make_shm_communicator(const ShmOptions& options) {
  return std::make_shared<ShmComm>(options);
}

}  // namespace shardflow
