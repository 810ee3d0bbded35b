// Which gradients share a flat bucket, and where each one sits inside it.
//
// Note [Bucket assignment]
// Parameters are walked in the order their gradients are expected (reverse registration order at
// first, the observed ready order after a rebuild). Each (dtype, device) pair has its own open
// bucket, since one collective moves one dtype on one device. A bucket closes as soon as its bytes
// reach or pass its cap; the first bucket of each pair gets the smaller first-bucket cap so the
// first reduction starts early in backward. Buckets are numbered by the position of their first
// gradient in the walk: that is the order collectives are issued in on every rank.
//
// Note [A small last bucket]
// The mirror of the small first bucket. The gradients that come last in backward belong to the
// layers forward needs first (the embeddings, the first block; a tied embedding's gradient
// completes last of all). Their bucket's reduction, step and parameter sync are all that stands
// between backward's end and the next forward's first layer, whatever the schedule: with forward
// prefetch forward waits exactly for them, without it wait() does. So, per (dtype, device), the
// parameters at the end of the walk whose bytes first reach the last-bucket cap form a bucket of
// their own (at least one parameter; none when that would be every parameter of the pair). The GPT
// of examples/gpt_train at world 2: the last bucket held 12 parameters, 5.0 MB (the tied
// embedding, wpe and all of block 0); at 1 MiB it holds 5, 2.0 MB (wte, wpe, block 0's first
// LayerNorm and its attention's input projection), and forward's first wait shrinks with it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "shardflow/types.hpp"

namespace shardflow {

struct BucketEntry {
  std::uint32_t param = 0;   // registration index
  std::size_t offset = 0;    // in elements, inside the bucket
  std::size_t numel = 0;
};

struct Bucket {
  std::uint32_t index = 0;
  DType dtype = DType::f32;
  Device device;
  std::size_t numel = 0;
  std::vector<BucketEntry> entries;  // in walk order: front of the bucket fills first
  std::size_t bytes() const { return numel * dtype_size(dtype); }
};

struct ParamLocation {
  std::uint32_t bucket = ~0u;  // ~0u: in no bucket (a frozen parameter)
  std::uint32_t entry = 0;
};

struct BucketPlan {
  std::vector<Bucket> buckets;
  std::vector<ParamLocation> where;  // by registration index
  std::string describe() const;      // one line per bucket, for logs
};

// `order` lists every registration index exactly once, in expected gradient order.
// last_bucket_cap_bytes: Note [A small last bucket] (0: none, the walk's last bucket fills as any other).
BucketPlan make_bucket_plan(const std::vector<ParamSpec>& params, const std::vector<std::uint32_t>& order,
                            std::size_t first_bucket_cap_bytes, std::size_t bucket_cap_bytes, std::size_t last_bucket_cap_bytes = 0);

std::vector<std::uint32_t> reverse_registration_order(std::size_t nparams);
// The parameters that require a gradient (ParamSpec::requires_grad), last registered first: the
// order a plan starts from. Frozen parameters are in no bucket.
std::vector<std::uint32_t> reverse_registration_order(const std::vector<ParamSpec>& params);

}  // namespace shardflow
