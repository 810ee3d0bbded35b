#include "runtime/plans/bucket_plan.hpp"

#include <algorithm>
#include <map>
#include <numeric>
#include <utility>

#include "shardflow/errors.hpp"

namespace shardflow {

std::vector<std::uint32_t> reverse_registration_order(std::size_t n) {
  std::vector<std::uint32_t> order(n);
  std::iota(order.rbegin(), order.rend(), 0u);
  return order;
}

std::vector<std::uint32_t> reverse_registration_order(const std::vector<ParamSpec>& params) {
  std::vector<std::uint32_t> order;
  for (auto p = std::uint32_t(params.size()); p-- > 0;)
    if (params[p].requires_grad) order.push_back(p);
  return order;
}

BucketPlan make_bucket_plan(const std::vector<ParamSpec>& params, const std::vector<std::uint32_t>& order,
                            std::size_t first_cap, std::size_t cap, std::size_t last_cap) {
  std::size_t trainable = 0;
  for (const auto& p : params) trainable += p.requires_grad;
  if (order.size() != trainable)
    throw UsageError("bucket plan: order lists " + std::to_string(order.size()) + " parameters, " + std::to_string(trainable) +
                     " of the registered ones require a gradient");
  std::vector<char> seen(params.size(), 0);
  for (auto p : order) {
    if (p >= params.size() || seen[p] || !params[p].requires_grad)
      throw UsageError("bucket plan: order is not a permutation of the parameters that require a gradient (index " +
                       std::to_string(p) + ")");
    seen[p] = 1;
  }

  // Note [A small last bucket]: per (dtype, device), the walk position where its last bucket starts.
  using Key = std::tuple<int, int, int>;  // (dtype, device kind, device index)
  auto key_of = [&](std::uint32_t p) { return Key{int(params[p].dtype), int(params[p].device.kind), params[p].device.index}; };
  std::map<Key, std::size_t> tail_start;
  if (last_cap) {
    std::map<Key, std::size_t> tail_bytes;
    for (std::size_t pos = order.size(); pos-- > 0;) {
      const Key k = key_of(order[pos]);
      auto& bytes = tail_bytes[k];
      if (bytes >= last_cap) continue;
      bytes += std::size_t(numel(params[order[pos]].shape)) * dtype_size(params[order[pos]].dtype);
      tail_start[k] = pos;
    }
  }

  struct Open {
    Bucket bucket;
    std::size_t first_pos = 0;  // walk position of its first gradient
    bool any_closed = false;    // the first-bucket cap applies until one bucket of this key closed
  };
  std::map<Key, Open> open;  // std::map keeps iteration deterministic
  std::vector<std::pair<std::size_t, Bucket>> closed;

  auto close = [&](Open& o) {
    closed.emplace_back(o.first_pos, std::move(o.bucket));
    o.bucket = Bucket{};
    o.any_closed = true;
  };

  for (std::size_t pos = 0; pos < order.size(); ++pos) {
    const ParamSpec& p = params[order[pos]];
    const Key key = key_of(order[pos]);
    Open& o = open[key];
    // The tail closes the bucket before it; a tail that is every parameter of the pair finds none open.
    if (const auto t = tail_start.find(key); t != tail_start.end() && t->second == pos && !o.bucket.entries.empty()) close(o);
    if (o.bucket.entries.empty()) {
      o.bucket.dtype = p.dtype;
      o.bucket.device = p.device;
      o.first_pos = pos;
    }
    const auto n = std::size_t(numel(p.shape));
    o.bucket.entries.push_back(BucketEntry{order[pos], o.bucket.numel, n});
    o.bucket.numel += n;
    const std::size_t limit = o.any_closed ? cap : first_cap;
    if (o.bucket.bytes() >= limit) close(o);
  }
  for (auto& [key, o] : open)
    if (!o.bucket.entries.empty()) close(o);

  std::stable_sort(closed.begin(), closed.end(), [](const auto& a, const auto& b) { return a.first < b.first; });

  BucketPlan plan;
  plan.where.resize(params.size());
  for (auto& [pos, b] : closed) {
    b.index = std::uint32_t(plan.buckets.size());
    for (std::uint32_t e = 0; e < b.entries.size(); ++e) plan.where[b.entries[e].param] = ParamLocation{b.index, e};
    plan.buckets.push_back(std::move(b));
  }
  return plan;
}

std::string BucketPlan::describe() const {
  std::string s;
  for (const auto& b : buckets) {
    s += "bucket " + std::to_string(b.index) + ": " + std::to_string(b.entries.size()) + " param(s), " +
         std::to_string(b.bytes()) + " bytes " + dtype_name(b.dtype) + " on " + b.device.str() + "\n";
  }
  return s;
}

}  // namespace shardflow
