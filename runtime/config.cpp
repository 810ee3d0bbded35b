// Config: parsing its enums, validating its values, and refusing settings that would do nothing.
#include <cmath>
#include <initializer_list>
#include <string>

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
  auto bad = [&](const std::string& path, const std::string& why) { throw UsageError(name_of(path) + " " + why); };
  // A setting of a feature that is off would do nothing: each row's path, whether it was set, and
  // what it would do; `off` says which feature is off.
  struct Unused {
    const char* path;
    bool set;
    std::string does;
  };
  auto refuse_unused = [&](std::initializer_list<Unused> rows, const std::string& off) {
    for (const auto& r : rows)
      if (r.set) bad(r.path, r.does + off);
  };
  if (int(zero.stage) > 2) bad("zero.stage", "must be 0, 1 or 2, got " + std::to_string(int(zero.stage)));
  const auto wire = precision.comm_dtype;
  if (wire != DType::f32 && wire != DType::bf16 && wire != DType::f16) bad("precision.comm_dtype", "must be fp32, bf16 or fp16");
  if (join.uneven_inputs && zero.forward_prefetch)
    bad("join.uneven_inputs", "does not work with " + name_of("zero.forward_prefetch") +
                                  " yet: an iteration's count of training ranks is taken while no parameter sync is in flight");
  if (zero.max_buckets_in_flight == 1)
    bad("zero.max_buckets_in_flight", "must be 0 (the memory budget's choice) or >= 2 (one bucket being written, one being reduced)");
  // Only stage 2 gives buffers back between iterations; a limit elsewhere would limit nothing.
  if (zero.max_buckets_in_flight != 0 && zero.stage != ZeroStage::gradients)
    bad("zero.max_buckets_in_flight", "= " + std::to_string(zero.max_buckets_in_flight) +
                                          " limits ZeRO-2's gradient buffers in flight, but " + name_of("zero.stage") + " = " +
                                          std::to_string(int(zero.stage)) + " keeps every bucket's buffer for the whole run: "
                                          "leave it at 0, or use stage 2");
  if (!(zero.clip_grad_norm >= 0.0f) || !std::isfinite(zero.clip_grad_norm))
    bad("zero.clip_grad_norm", "must be a finite number >= 0 (0 turns clipping off)");
  if (int(zero.partition) < 0 || int(zero.partition) > 2) bad("zero.partition", "must be param, bucket or flat");
  if (zero.stage == ZeroStage::ddp && zero.partition != Partition::flat)
    bad("zero.partition", std::string("= ") + partition_name(zero.partition) + " says how ZeRO shards the optimizer state, but " +
                              name_of("zero.stage") + " = 0 keeps all of it on every rank: leave it at flat (the default), or use stage 1 or 2");
  if (!zero.reduce_scatter && zero.stage == ZeroStage::gradients && zero.partition == Partition::flat)
    bad("zero.reduce_scatter", "= false does not work with ZeRO-2's flat partition, which keeps only the rank's shard of the "
                               "reduced gradients; use ZeRO-1 for all-reduced gradients");
  if (int(zero.overlap) < 0 || int(zero.overlap) > 2) bad("zero.overlap", "must be none, after_backward or interleaved");
  if (zero.redundancy != 1 && zero.redundancy != 2) bad("zero.redundancy", "must be 1 or 2 (a twin of each shard), got " + std::to_string(zero.redundancy));
  if (zero.twin_distance < 0) bad("zero.twin_distance", "must be >= 0 (0: the ranks of one node), got " + std::to_string(zero.twin_distance));
  if (zero.twin_distance > 0 && zero.redundancy == 1)
    bad("zero.twin_distance", "= " + std::to_string(zero.twin_distance) + " places twins, but " + name_of("zero.redundancy") + " = 1 keeps none");
  if (zero.redundancy == 2) {
    // A twin takes its source's reduce-scatter slice (Note [Mirrored shards]).
    if (zero.stage == ZeroStage::ddp)
      bad("zero.redundancy", "= 2 keeps twins of ZeRO shards; at stage 0 every rank holds the whole optimizer state already");
    if (zero.partition != Partition::flat || !zero.reduce_scatter)
      bad("zero.redundancy", "= 2 needs each bucket reduce-scattered into equal slices: " + name_of("zero.partition") + " flat and " +
                                 name_of("zero.reduce_scatter") + " on");
    if (snapshot.dir.empty())
      bad("zero.redundancy", "= 2 heals a lost rank from memory, and falls back to the newest snapshot when a rank and its twin's "
                             "holder are lost together: set " + name_of("snapshot.dir") + " (and " + name_of("snapshot.every") + ")");
  }
  // Note [Fused syncs]: only the flat partition's all-gathers fuse, and only stages 1 and 2 sync.
  // A cap set for a run that has nothing to fuse would do nothing (0, turning it off, is honoured).
  if (zero.fuse_syncs_bytes != 0 && zero.fuse_syncs_bytes != ZeroConfig{}.fuse_syncs_bytes &&
      (zero.stage == ZeroStage::ddp || zero.partition != Partition::flat))
    bad("zero.fuse_syncs_bytes", "= " + std::to_string(zero.fuse_syncs_bytes) + " has no syncs to fuse: only ZeRO stages 1 and 2 with " +
                                     name_of("zero.partition") + " flat sync by all-gather (0 turns fusing off)");
  if (precision.dynamic_loss_scale) {
    if (!(precision.init_scale > 0.0f) || !std::isfinite(precision.init_scale)) bad("precision.init_scale", "must be a finite number > 0");
    if (!(precision.growth_factor > 1.0f)) bad("precision.growth_factor", "must be > 1");
    if (!(precision.backoff_factor > 0.0f && precision.backoff_factor < 1.0f)) bad("precision.backoff_factor", "must be in (0, 1)");
    if (precision.growth_interval < 1) bad("precision.growth_interval", "must be >= 1");
  }
  if (zero.clip_grad_norm > 0.0f && zero.clip_norm_type != 2.0f && !std::isinf(zero.clip_norm_type))
    bad("zero.clip_norm_type", "must be 2 or infinity, got " + std::to_string(zero.clip_norm_type));
  if (zero.clip_grad_norm == 0.0f && zero.clip_norm_type != ZeroConfig{}.clip_norm_type)
    bad("zero.clip_norm_type", "= " + std::to_string(zero.clip_norm_type) + " says how to clip, but " + name_of("zero.clip_grad_norm") +
                                   " = 0 turns clipping off: set the max norm too, or leave the type at 2");
  if (!precision.dynamic_loss_scale) {
    const PrecisionConfig d;
    refuse_unused({{"precision.init_scale", precision.init_scale != d.init_scale, "tunes dynamic loss scaling"},
                   {"precision.growth_factor", precision.growth_factor != d.growth_factor, "tunes dynamic loss scaling"},
                   {"precision.backoff_factor", precision.backoff_factor != d.backoff_factor, "tunes dynamic loss scaling"},
                   {"precision.growth_interval", precision.growth_interval != d.growth_interval, "tunes dynamic loss scaling"}},
                  ", which " + name_of("precision.dynamic_loss_scale") + " = false turns off: turn it on, or leave this at its default");
  }
  if (buckets.first_cap_bytes == 0) bad("buckets.first_cap_bytes", "must be > 0 (default 1 MiB)");
  if (zero.prefetch_syncs_in_backward < -1)
    bad("zero.prefetch_syncs_in_backward",
        "must be -1 (auto), 0 or a bucket count, got " + std::to_string(zero.prefetch_syncs_in_backward));
  if (zero.interleave_lag < -1 || zero.interleave_lag > 64)
    bad("zero.interleave_lag", "must be -1 (auto) or 0 to 64, got " + std::to_string(zero.interleave_lag));
  // A schedule setting for a mode that has no such schedule would silently do nothing.
  if (zero.interleave_lag >= 0 && (zero.overlap != Overlap::interleaved || zero.stage == ZeroStage::ddp))
    bad("zero.interleave_lag", "= " + std::to_string(zero.interleave_lag) + " places each parameter sync after a later bucket's reduction, "
                               "which only interleaved overlap at ZeRO stage 1 or 2 does (" + name_of("zero.overlap") + " = " +
                               overlap_name(zero.overlap) + ", " + name_of("zero.stage") + " = " + std::to_string(int(zero.stage)) +
                               "): leave it at -1");
  if (zero.prefetch_syncs_in_backward >= 0 && !zero.forward_prefetch)
    bad("zero.prefetch_syncs_in_backward", "= " + std::to_string(zero.prefetch_syncs_in_backward) + " splits forward prefetch's syncs, but " +
                                           name_of("zero.forward_prefetch") + " is off: leave it at -1");
  if (zero.prefetch_syncs_in_backward > 0 && zero.overlap != Overlap::interleaved)
    bad("zero.prefetch_syncs_in_backward", "= " + std::to_string(zero.prefetch_syncs_in_backward) + " sends syncs during backward, which only " +
                                           name_of("zero.overlap") + " interleaved does (it is " + overlap_name(zero.overlap) +
                                           "): every sync goes after backward; leave it at -1 or 0");
  if (timeouts.collective.count() <= 0) bad("timeouts.collective", "must be positive (default 10 min)");
  if (snapshot.every < 0) bad("snapshot.every", "must be >= 0, got " + std::to_string(snapshot.every));
  if (!snapshot.dir.empty() && snapshot.every == 0)
    bad("snapshot.every", "must be > 0 with " + name_of("snapshot.dir") + " set: snapshots are taken every that many iterations");
  if (snapshot.dir.empty() && snapshot.every > 0)
    bad("snapshot.dir", "is not set, but " + name_of("snapshot.every") + " = " + std::to_string(snapshot.every) + " asks for snapshots");
  if (snapshot.trainer_state && snapshot.dir.empty())
    bad("snapshot.trainer_state", "is set, but " + name_of("snapshot.dir") + " is not: there are no snapshots to carry the trainer's state");
  if (snapshot.keep < 1) bad("snapshot.keep", "must be >= 1, got " + std::to_string(snapshot.keep));
  if (snapshot.disk_every < 0) bad("snapshot.disk_every", "must be >= 0 (0: every 10 x " + name_of("snapshot.every") + "), got " + std::to_string(snapshot.disk_every));
  if (snapshot.disk_every > 0 && snapshot.every > 0 && snapshot.disk_every % snapshot.every != 0)
    bad("snapshot.disk_every", "must be a multiple of " + name_of("snapshot.every") + " (" + std::to_string(snapshot.every) + "), got " +
                                   std::to_string(snapshot.disk_every) + ": only a snapshot's step can go to disk");
  if (snapshot.dir.empty()) {
    const SnapshotConfig d;
    refuse_unused({{"snapshot.keep", snapshot.keep != d.keep, "= " + std::to_string(snapshot.keep) + " is how many snapshots to keep"},
                   {"snapshot.disk_every", snapshot.disk_every != d.disk_every, "= " + std::to_string(snapshot.disk_every) + " sends snapshots to disk"},
                   {"snapshot.memory", snapshot.memory != d.memory, "asks for no snapshots in the launcher's memory"}},
                  ", but " + name_of("snapshot.dir") + " is not set: no snapshots are taken");
  }
}

std::string Config::name_of(const std::string& path) const {
  const auto it = setting_names.find(path);
  return it != setting_names.end() ? it->second : "Config::" + path;
}

void Config::check_needs_optimizer() const {
  auto refuse = [&](const std::string& path, const std::string& value, const std::string& what) {
    throw UsageError(name_of(path) + " = " + value + " does nothing here: " + what +
                     ", and this Runtime has none (Runtime::configure_optimizer was not called). Call "
                     "configure_optimizer before the first backward, or leave " + name_of(path) + " at its default");
  };
  if (zero.stage != ZeroStage::ddp) refuse("zero.stage", std::to_string(int(zero.stage)), "it shards the runtime's optimizer");
  if (zero.overlap != Overlap::none) refuse("zero.overlap", overlap_name(zero.overlap), "it overlaps the runtime's optimizer steps");
  if (precision.dynamic_loss_scale)
    refuse("precision.dynamic_loss_scale", "true", "the runtime unscales and skips steps inside its optimizer step");
  if (zero.clip_grad_norm != 0.0f)
    refuse("zero.clip_grad_norm", std::to_string(zero.clip_grad_norm), "the runtime clips inside its optimizer step");
  if (zero.forward_prefetch)
    refuse("zero.forward_prefetch", "true", "it prefetches the parameters the runtime's optimizer updates");
}

}  // namespace shardflow
