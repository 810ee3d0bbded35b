#include "runtime/comm/peer_collective.hpp"

#include <algorithm>
#include <cstring>

#include "kernels/cpu/elementwise.hpp"

namespace shardflow::peer {
namespace {
const char* bytes(const void* p) { return static_cast<const char*>(p); }
char* bytes(void* p) { return static_cast<char*>(p); }
}  // namespace

OpSig OpSig::of(const CollectiveOp& op, std::uint64_t seq) {
  OpSig s;
  s.kind = op.kind;
  s.dtype = op.dtype;
  s.count = op.count;
  s.root = op.kind == CollectiveKind::shift ? op.distance : op.root;
  s.seq = seq;
  std::strncpy(s.tag, op.tag.c_str(), sizeof(s.tag) - 1);
  return s;
}

std::string OpSig::describe() const {
  return std::string(collective_name(kind)) + " of " + std::to_string(count) + " " + dtype_name(dtype) +
         (kind == CollectiveKind::broadcast ? " from root " + std::to_string(root) : "") +
         (kind == CollectiveKind::shift ? " by " + std::to_string(root) + " rank(s)" : "") + " ('" + tag + "')";
}

std::optional<std::string> mismatch(const OpSig* sigs, int n) {
  const OpSig& ref = sigs[0];
  for (int r = 1; r < n; ++r) {
    const OpSig& s = sigs[r];
    if (s.seq != ref.seq || s.kind != ref.kind || s.count != ref.count || s.dtype != ref.dtype || s.root != ref.root)
      return "collective mismatch: rank 0 issued " + ref.describe() + " as op #" + std::to_string(ref.seq) +
             ", rank " + std::to_string(r) + " issued " + s.describe() + " as op #" + std::to_string(s.seq) +
             ". Every rank must issue the same collectives in the same order.";
  }
  if (ref.kind == CollectiveKind::broadcast && (ref.root < 0 || ref.root >= n))
    return "op #" + std::to_string(ref.seq) + " ('" + ref.tag + "'): broadcast root " + std::to_string(ref.root) +
           " is not a rank of world " + std::to_string(n);
  return std::nullopt;
}

int dead_behind(const OpSig* sigs, int n, std::uint64_t seq, const std::function<bool(int)>& dead) {
  for (int r = 0; r < n; ++r)
    if (sigs[r].seq != seq && dead(r)) return r;
  return -1;
}

std::pair<std::size_t, std::size_t> chunk(std::size_t count, int n, int r) {
  auto edge = [&](int k) -> std::size_t {
    if (k >= n) return count;
    return std::min(count, (count * std::size_t(k) / std::size_t(n)) & ~std::size_t{15});
  };
  return {edge(r), edge(r + 1)};
}

void copy(void* dst, const void* src, std::size_t n) {
  if (n && dst != src) std::memcpy(dst, src, n);
}

void allreduce(DType t, std::size_t count, float scale, int rank, int n, const std::vector<const void*>& send,
               const std::vector<void*>& recv, void* out, const Sync& sync) {
  const std::size_t es = dtype_size(t);
  auto [lo, hi] = chunk(count, n, rank);
  std::vector<const void*> srcs(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) srcs[std::size_t(i)] = bytes(send[std::size_t(i)]) + lo * es;
  kernels::reduce_sum(t, bytes(recv[std::size_t(rank)]) + lo * es, srcs.data(), n, hi - lo, scale);
  sync();
  for (int j = 0; j < n; ++j) {
    auto [jlo, jhi] = chunk(count, n, j);
    copy(bytes(out) + jlo * es, bytes(recv[std::size_t(j)]) + jlo * es, (jhi - jlo) * es);
  }
}

void reduce_scatter(DType t, std::size_t count, float scale, int n, const std::vector<const void*>& blocks, void* out) {
  kernels::reduce_sum(t, out, blocks.data(), n, count, scale);
}

void allgather(DType t, std::size_t count, std::size_t out_stride, int n, const std::vector<const void*>& send,
               void* out) {
  const std::size_t es = dtype_size(t);
  for (int j = 0; j < n; ++j) copy(bytes(out) + std::size_t(j) * out_stride * es, send[std::size_t(j)], count * es);
}

}  // namespace shardflow::peer
