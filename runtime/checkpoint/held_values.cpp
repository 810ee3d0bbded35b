// Note [Values the ranks hold already]
// A restore from the twins (Note [Going on from the twins]) gives every rank every parameter's
// value as it stood after the step gone on from. But a survivor already holds most of them: its
// copy of the parameters moved only where the failed step reached it (a bucket stepped in place,
// another's sync unpacked), and not at all when the loss came before the step's first update. So
// before the values move, each holder checksums the blocks it holds (2^20 elements at most) as
// the restore would write them into the trainer's storage (converted to a 16-bit storage, or
// rounded to a 16-bit wire, as the owners' step leaves them), every rank checksums its own
// parameters over the same blocks, and a rank takes only the blocks whose bytes differ: nothing
// when its copy is clean, everything when it is a replacement that kept nothing. The checksums
// are two CRC-64s (ECMA and ISO polynomials) of the exact bytes, so a block is skipped only when
// both agree; -0 and +0, or two NaNs, differ as their bytes do. The verdicts are all-gathered,
// so that every rank knows what every other takes (the packs' lengths: Note [Pieces to their
// new owners]). The fp32 masters of 16-bit parameters are not in the trainer's storage: the new
// owner and its twin still take their pieces of those (the caller adds them).
// Where every trainable parameter is fp32 its bytes are the values as the restore writes them, so
// a rank whose parameters hold a block already can give it instead of the block's holder: the
// one that a shift reaches (Note [Pieces over two levels]), then the one on the takers' host, else
// the least loaded. A replacement then takes its values from a survivor on its own host, not
// across the link from the host that keeps the lost shard's twin.
#include <isa-l/crc64.h>

#include <algorithm>
#include <cstring>
#include <tuple>

#include "kernels/cpu/elementwise.hpp"
#include "runtime/checkpoint/piece_exchange.hpp"
#include "runtime/rank/runtime_impl.hpp"
#include "runtime/zero/shard.hpp"
#include "shardflow/errors.hpp"

namespace shardflow {

namespace {

constexpr std::size_t kBlock = std::size_t{1} << 20;  // elements one checksum covers (a divisor of kStateWindow)

std::vector<Span> blocks_of(const Spans& spans) {
  std::vector<Span> out;
  for (const auto& s : spans)
    for (std::size_t lo = s.lo; lo < s.hi;) {
      const std::size_t hi = std::min(s.hi, (lo / kBlock + 1) * kBlock);
      out.push_back({lo, hi});
      lo = hi;
    }
  return out;
}

struct Crc {
  std::uint64_t ecma = 0, iso = 0;
  void add(const void* p, std::size_t bytes) {
    const auto* b = static_cast<const std::uint8_t*>(p);
    ecma = ::crc64_ecma_refl(ecma, b, bytes);
    iso = ::crc64_iso_refl(iso, b, bytes);
  }
  bool operator==(const Crc&) const = default;
};

}  // namespace

template <class Fn>
void Runtime::Impl::for_trainable(std::size_t lo, std::size_t hi, Fn fn) const {
  const auto& params = registry.params();
  const auto& base = shard->param_base();
  // The first parameter that ends past lo.
  auto p = std::uint32_t(std::upper_bound(base.begin(), base.end(), lo) - base.begin());
  p = p == 0 ? 0 : p - 1;
  for (; p < params.size() && base[p] < hi; ++p) {
    const std::size_t at = base[p], len = std::size_t(numel(params[p].shape));
    const std::size_t a = std::max(at, lo), b = std::min(at + len, hi);
    if (a < b && params[p].requires_grad && plan.where[p].bucket != ~0u) fn(p, a - at, a - lo, b - a);
  }
}

void Runtime::Impl::write_values(std::uint32_t p, const float* v, std::size_t n, std::byte* dst) const {
  const auto& param = registry.params()[p];
  if (param.dtype != DType::f32)
    kernels::convert_from_f32(param.dtype, dst, v, n);
  else
    kernels::round_to(shard->sync_dtype(plan.where[p].bucket), reinterpret_cast<float*>(dst), v, n);
}

void Runtime::Impl::write_values(std::size_t begin, const std::vector<float>& window, const Spans& where) {
  const auto& params = registry.params();
  for (const auto& s : clip(where, begin, begin + window.size()))
    for_trainable(s.lo, s.hi, [&](std::uint32_t p, std::size_t offset, std::size_t from, std::size_t n) {
      auto* dst = static_cast<std::byte*>(params[p].data) + offset * dtype_size(params[p].dtype);
      write_values(p, window.data() + (s.lo - begin) + from, n, dst);
    });
}

Runtime::Impl::HeldValues Runtime::Impl::values_to_take(const PieceExchange& x, const std::function<void(std::size_t, std::vector<float>&)>& provide,
                                                       bool from_params_ok) {
  const std::size_t total = shard->total_elements();
  const auto& params = registry.params();
  std::vector<Spans> blocks;  // [rank] the blocks it holds, the same list on every rank
  std::size_t all = 0, most = 0;
  for (int r = 0; r < world; ++r) {
    blocks.push_back(blocks_of(x.holds[std::size_t(r)]));
    all += blocks.back().size();
    most = std::max(most, blocks.back().size());
  }
  // This rank's checksums of what it holds, as the restore would write it: 4 words a block.
  std::vector<std::uint32_t> mine(4 * most, 0u);
  std::vector<float> window;
  std::vector<std::byte> bytes;
  const auto& own = blocks[std::size_t(rank)];
  for (std::size_t i = 0, begin = 0; begin < total && i < own.size(); begin += kStateWindow) {
    const std::size_t n = std::min(kStateWindow, total - begin);
    if (own[i].lo >= begin + n) continue;
    window.assign(n, 0.0f);
    provide(begin, window);
    for (; i < own.size() && own[i].lo < begin + n; ++i) {
      Crc crc;
      for_trainable(own[i].lo, own[i].hi, [&](std::uint32_t p, std::size_t, std::size_t from, std::size_t len) {
        bytes.resize(len * dtype_size(params[p].dtype));
        write_values(p, window.data() + (own[i].lo - begin) + from, len, bytes.data());
        crc.add(bytes.data(), bytes.size());
      });
      const std::uint64_t words[2] = {crc.ecma, crc.iso};
      std::memcpy(mine.data() + 4 * i, words, sizeof(words));
    }
  }
  std::vector<std::uint32_t> sums(4 * most * std::size_t(world));
  if (most) {
    CollectiveOp op;
    op.kind = CollectiveKind::allgather;
    op.send = mine.data();
    op.recv = sums.data();
    op.count = 4 * most;
    op.tag = "restore from memory: the checksums of the values each rank holds";
    run_now(op);
  }
  // This rank's verdict on every block, from its own parameters' bytes there (1: it takes it).
  std::vector<float> verdict(all, 0.0f), verdicts(all * std::size_t(world));
  for (int r = 0, k = 0; r < world; ++r)
    for (std::size_t i = 0; i < blocks[std::size_t(r)].size(); ++i, ++k) {
      const auto& b = blocks[std::size_t(r)][i];
      Crc held;
      for_trainable(b.lo, b.hi, [&](std::uint32_t p, std::size_t offset, std::size_t, std::size_t len) {
        const std::size_t es = dtype_size(params[p].dtype);
        held.add(static_cast<const std::byte*>(params[p].data) + offset * es, len * es);
      });
      Crc theirs;
      std::memcpy(&theirs.ecma, sums.data() + 4 * (most * std::size_t(r) + i), 8);
      std::memcpy(&theirs.iso, sums.data() + 4 * (most * std::size_t(r) + i) + 2, 8);
      verdict[std::size_t(k)] = held == theirs ? 0.0f : 1.0f;
    }
  if (all) {
    CollectiveOp op;
    op.kind = CollectiveKind::allgather;
    op.send = verdict.data();
    op.recv = verdicts.data();
    op.count = all;
    op.tag = "restore from memory: the values each rank takes";
    run_now(op);
  }
  const auto stale = [&](int t, std::size_t k) { return verdicts[all * std::size_t(t) + k] != 0.0f; };
  HeldValues out;
  out.needs.resize(std::size_t(world));
  out.holds.resize(std::size_t(world));
  // Who gives each block: its holder, or, where the parameters are all fp32 (their bytes are the
  // values then, as the restore writes them), a rank whose parameters hold it already and that is
  // nearer the ranks taking it (on their host), else less loaded: a replacement takes its values
  // from a survivor beside it rather than across the link from the twin's host.
  const int L = x.host_ranks > 0 ? x.host_ranks : ranks_per_host(world);  // 0: not known, the ranks taken as one host
  const auto host = [&](int r) { return L > 0 ? r / L : 0; };
  std::vector<std::size_t> load(static_cast<std::size_t>(world), 0);
  for (int r = 0, k = 0; r < world; ++r)
    for (const auto& b : blocks[std::size_t(r)]) {
      int giver = r;
      // (takers no shift reaches from it, takers on other hosts, elements given so far): over
      // two levels a block that every shift reaches is not summed (Note [Pieces over two levels]).
      const auto score = [&](int c) {
        int far = 0, unreached = 0;
        for (int t = 0; t < world; ++t) {
          far += stale(t, std::size_t(k)) && host(t) != host(c);
          unreached += stale(t, std::size_t(k)) && !reaches(x, c, t);
        }
        return std::tuple{unreached, far, load[std::size_t(c)]};
      };
      bool taken = false;
      for (int t = 0; t < world; ++t) taken = taken || stale(t, std::size_t(k));
      if (taken && from_params_ok)
        for (int c = 0; c < world; ++c)
          if (!stale(c, std::size_t(k)) && score(c) < score(giver)) giver = c;
      if (taken) load[std::size_t(giver)] += b.hi - b.lo;
      out.holds[std::size_t(giver)].push_back(b);
      if (giver != r && giver == rank) out.from_params.push_back(b);
      for (int t = 0; t < world; ++t)
        if (stale(t, std::size_t(k))) out.needs[std::size_t(t)].push_back(b);
      ++k;
    }
  for (int t = 0; t < world; ++t) {
    out.needs[std::size_t(t)] = unite(out.needs[std::size_t(t)], {});
    out.holds[std::size_t(t)] = unite(out.holds[std::size_t(t)], {});
  }
  out.from_params = unite(out.from_params, {});
  return out;
}

void Runtime::Impl::values_from_params(std::size_t begin, std::vector<float>& window, const Spans& where) const {
  const auto& params = registry.params();
  for (const auto& s : clip(where, begin, begin + window.size()))
    for_trainable(s.lo, s.hi, [&](std::uint32_t p, std::size_t offset, std::size_t from, std::size_t n) {
      if (params[p].dtype != DType::f32)  // the caller gives from parameters only when all are fp32
        throw Error("twins: parameter '" + params[p].name + "' is " + dtype_name(params[p].dtype) +
                    ": its bytes are not the values a restore moves (Note [Values the ranks hold already])");
      std::memcpy(window.data() + (s.lo - begin) + from, static_cast<const float*>(params[p].data) + offset, n * sizeof(float));
    });
}

}  // namespace shardflow
