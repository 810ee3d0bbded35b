#include "runtime/plans/plan_timings.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <numeric>

#include "shardflow/errors.hpp"
#include "shardflow/sim.hpp"

namespace shardflow {
namespace {

double non_negative(const nlohmann::json& j, const char* key, const std::string& where) {
  if (!j.contains(key)) return 0.0;
  const auto& v = j.at(key);
  if (!v.is_number() || !(v.get<double>() >= 0) || !std::isfinite(v.get<double>()))
    throw UsageError(where + ": '" + key + "' must be a number >= 0, got " + v.dump());
  return v.get<double>();
}

}  // namespace

PlanTimings read_plan_timings(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw UsageError("--timings '" + path + "' cannot be read");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw UsageError("--timings '" + path + "' is not JSON: " + e.what());
  }
  PlanTimings t;
  const std::string where = "--timings '" + path + "'";
  if (!j.is_object() || !j.contains("link") || !j.at("link").is_object())
    throw UsageError(where + " needs \"link\": {\"gbytes_per_s\": ..., \"latency_us\": ...}");
  t.gbytes_per_s = non_negative(j.at("link"), "gbytes_per_s", where + ", link");
  if (t.gbytes_per_s <= 0) throw UsageError(where + ", link: 'gbytes_per_s' must be > 0");
  t.latency_us = non_negative(j.at("link"), "latency_us", where + ", link");
  t.step_ms_per_mib = non_negative(j, "step_ms_per_mib", where);
  if (!j.contains("params") || !j.at("params").is_object()) throw UsageError(where + " needs \"params\": {name: {\"forward_ms\", \"backward_ms\"}}");
  for (const auto& [name, v] : j.at("params").items()) {
    if (!v.is_object()) throw UsageError(where + ", parameter '" + name + "': expected {\"forward_ms\", \"backward_ms\"}");
    t.params[name] = {non_negative(v, "forward_ms", where + ", parameter '" + name + "'"),
                      non_negative(v, "backward_ms", where + ", parameter '" + name + "'")};
  }
  return t;
}

IterationTimes plan_iteration_times(const RunPlan& plan, const PlanTimings& timings) {
  const auto& params = plan.params;
  for (const auto& [name, _] : timings.params)
    if (std::none_of(params.begin(), params.end(), [&](const ParamSpec& p) { return p.name == name; }))
      throw UsageError("--timings names a parameter '" + name + "' the model (--params) has not");
  auto time_of = [&](std::uint32_t p) {
    const auto it = timings.params.find(params[p].name);
    return it == timings.params.end() ? PlanTimings::Layer{} : it->second;
  };
  const auto& buckets = plan.buckets.buckets;
  SimLink link;  // the simulated link's ring model (Note [Simulated link]) at the measured rate
  link.latency_us = timings.latency_us;
  link.gbytes_per_s = timings.gbytes_per_s;
  const std::size_t B = buckets.size();
  IterationTimes t;
  // Backward from the last registered parameter to the first: when each gradient is in.
  std::vector<double> grad_at(params.size(), 0.0);
  double now = 0;
  for (std::size_t p = params.size(); p-- > 0;) grad_at[p] = now += time_of(std::uint32_t(p)).backward_ms;
  // Forward needs a bucket at its first registered parameter.
  std::vector<std::uint32_t> first(B, ~0u);
  for (std::size_t b = 0; b < B; ++b) {
    double ready = 0;
    for (const auto& e : buckets[b].entries) {
      first[b] = std::min(first[b], e.param);
      ready = std::max(ready, grad_at[e.param]);
    }
    t.gradient_ms.push_back(ready);
    const auto& s = plan.settings;
    const std::size_t comm_bytes = buckets[b].numel * (s.comm_dtype == DType::f32 ? dtype_size(buckets[b].dtype) : dtype_size(s.comm_dtype));
    const bool sharded = s.stage != ZeroStage::ddp;
    const auto ms = [&](CollectiveKind kind, std::size_t bytes) { return double(link.cost(kind, bytes, s.world).count()) / 1e6; };
    t.reduce_ms.push_back(ms(sharded ? CollectiveKind::reduce_scatter : CollectiveKind::allreduce, comm_bytes));
    t.sync_ms.push_back(sharded ? ms(CollectiveKind::allgather, buckets[b].bytes()) : 0.0);
    if (plan.twin_distance) {  // Note [Mirrored shards]: each rank's reduced slice to its twin
      const DType wire = s.comm_dtype == DType::f32 ? buckets[b].dtype : s.comm_dtype;  // as comm_bytes has it
      const double shift = ms(CollectiveKind::shift, plan.shards.front().buckets[b].slice * dtype_size(wire));
      if (plan.syncs_from_twin && s.world == 2) {  // Note [Syncs from the twin]: the shift is the sync
        t.sync_ms.back() = shift;
      } else {  // right after the reduce-scatter, on the link before the step
        t.reduce_ms.back() += shift;
        if (plan.syncs_from_twin) t.sync_ms.back() = 0.0;  // Note [Syncs from the twin, two levels]: gathered inside the hosts, off the link
      }
    }
    const double updated_mib = double(buckets[b].numel) * 4 / (sharded ? double(s.world) : 1.0) / 1048576.0;
    t.step_ms.push_back(updated_mib * timings.step_ms_per_mib);
  }
  for (std::uint32_t b = 0; b < B; ++b) t.forward_order.push_back(b);
  std::sort(t.forward_order.begin(), t.forward_order.end(), [&](auto a, auto b) { return first[a] < first[b]; });
  // Segment i: forward from bucket i's first parameter to the next bucket's (the last: to the end).
  std::vector<double> forward_before(params.size() + 1, 0.0);
  for (std::size_t p = 0; p < params.size(); ++p) forward_before[p + 1] = forward_before[p] + time_of(std::uint32_t(p)).forward_ms;
  for (std::size_t i = 0; i < B; ++i) {
    const std::size_t from = i == 0 ? 0 : first[t.forward_order[i]];  // forward before the first bucket counts with it
    const std::size_t to = i + 1 < B ? first[t.forward_order[i + 1]] : params.size();
    t.forward_ms.push_back(forward_before[to] - forward_before[from]);
  }
  return t;
}

}  // namespace shardflow
