// Config: parsing its enums, validating its values, and refusing settings that would do nothing.
#include <cmath>

#include "shardflow/config.hpp"
#include "shardflow/errors.hpp"

namespace shardflow {

Overlap parse_overlap(const std::string& s) {
  if (s == "none") return Overlap::none;
  if (s == "after_backward") return Overlap::after_backward;
  if (s == "interleaved") return Overlap::interleaved;
  throw UsageError("unknown overlap mode '" + s + "': expected none, after_backward or interleaved");
}

Partition parse_partition(const std::string& s) {
  if (s == "param") return Partition::param;
  if (s == "bucket") return Partition::bucket;
  if (s == "flat") return Partition::flat;
  throw UsageError("unknown partition '" + s + "': expected param, bucket or flat");
}

const char* overlap_name(Overlap o) {
  return o == Overlap::none ? "none" : o == Overlap::after_backward ? "after_backward" : "interleaved";
}

const char* partition_name(Partition p) {
  return p == Partition::param ? "param" : p == Partition::bucket ? "bucket" : "flat";
}

void Config::validate() const {
  if (zero_stage < 0 || zero_stage > 2)
    throw UsageError("Config::zero_stage must be 0, 1 or 2, got " + std::to_string(zero_stage));
  if (comm_dtype != DType::f32 && comm_dtype != DType::bf16 && comm_dtype != DType::f16)
    throw UsageError("Config::comm_dtype must be fp32, bf16 or fp16");
  if (max_buckets_in_flight < 2)
    throw UsageError("Config::max_buckets_in_flight must be >= 2 (one bucket being written, one being reduced)");
  if (clip_grad_norm < 0.0f) throw UsageError("Config::clip_grad_norm must be >= 0 (0 turns clipping off)");
  if (clip_grad_norm > 0.0f && clip_norm_type != 2.0f && !std::isinf(clip_norm_type))
    throw UsageError("Config::clip_norm_type must be 2 or infinity, got " + std::to_string(clip_norm_type));
  if (first_bucket_cap_bytes == 0)
    throw UsageError("Config::first_bucket_cap_bytes must be > 0 (default 1 MiB)");
  if (bucket_cap_bytes == 0) throw UsageError("Config::bucket_cap_bytes must be > 0 (default 25 MiB)");
  if (prefetch_syncs_in_backward < -1)
    throw UsageError("Config::prefetch_syncs_in_backward must be -1 (auto), 0 or a bucket count, got " +
                     std::to_string(prefetch_syncs_in_backward));
  if (interleave_lag > 64) throw UsageError("Config::interleave_lag must be <= 64, got " + std::to_string(interleave_lag));
  if (timeout.count() <= 0) throw UsageError("Config::timeout must be positive (default 10 min)");
}

std::string Config::name_of(const std::string& field) const {
  const auto it = setting_names.find(field);
  return it != setting_names.end() ? it->second : "Config::" + field;
}

void Config::check_needs_optimizer() const {
  auto refuse = [&](const std::string& field, const std::string& value, const std::string& what) {
    throw UsageError(name_of(field) + " = " + value + " does nothing here: " + what +
                     ", and this Runtime has none (Runtime::configure_optimizer was not called). Call "
                     "configure_optimizer before the first backward, or leave " + name_of(field) + " at its default");
  };
  if (zero_stage != 0) refuse("zero_stage", std::to_string(zero_stage), "it shards the runtime's optimizer");
  if (overlap != Overlap::none) refuse("overlap", overlap_name(overlap), "it overlaps the runtime's optimizer steps");
  if (comm_dtype != DType::f32)
    refuse("comm_dtype", dtype_name(comm_dtype), "16-bit communication needs the fp32 masters the runtime's optimizer keeps");
  if (clip_grad_norm != 0.0f)
    refuse("clip_grad_norm", std::to_string(clip_grad_norm), "the runtime clips inside its optimizer step");
  if (forward_prefetch) refuse("forward_prefetch", "true", "it prefetches the parameters the runtime's optimizer updates");
}

}  // namespace shardflow
