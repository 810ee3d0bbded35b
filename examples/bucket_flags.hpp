// The trainers' bucket flags, one definition for all of them: --first-bucket-mb, --bucket-mb,
// --last-bucket-mb and --min-buckets mean what BucketConfig's fields mean (a cap given is used as given; left out, the
// default cap shrinks for a small model).
#pragma once

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <optional>
#include <string>

#include "shardflow/config.hpp"
#include "shardflow/errors.hpp"

namespace examples {

struct BucketFlags {
  double first_mb = double(shardflow::BucketConfig{}.first_cap_bytes) / 1048576.0;
  double last_mb = double(shardflow::BucketConfig{}.last_cap_bytes) / 1048576.0;
  std::optional<double> cap_mb;
  std::optional<std::size_t> min_buckets;

  void add(CLI::App& app) {
    app.add_option("--first-bucket-mb", first_mb, "first bucket cap, MiB")->capture_default_str();
    app.add_option("--last-bucket-mb", last_mb,
                   "cap of the bucket of the last gradients (the layers forward needs first), MiB; 0: none (PyTorch's layout)")
        ->capture_default_str();
    app.add_option("--bucket-mb", cap_mb, "bucket cap, MiB, used as given (default: 25, shrunk so that a small model gets --min-buckets)");
    app.add_option("--min-buckets", min_buckets,
                   "shrink the bucket cap until the model has this many buckets (default with the default cap: 4, or 16 at "
                   "ZeRO stage 1 or 2 over more than one rank; none with --bucket-mb; 0: never)")
        ->check(CLI::Range(0, 1 << 20));
  }

  void apply(shardflow::BucketConfig& b) const {
    auto bytes = [](double mb, const char* flag) {
      if (!(mb > 0) || !std::isfinite(mb)) throw shardflow::UsageError(std::string(flag) + " must be a positive number of MiB");
      return std::max<std::size_t>(1, std::size_t(mb * 1048576.0));
    };
    b.first_cap_bytes = bytes(first_mb, "--first-bucket-mb");
    b.last_cap_bytes = last_mb == 0.0 ? 0 : bytes(last_mb, "--last-bucket-mb");
    if (cap_mb) b.cap_bytes = bytes(*cap_mb, "--bucket-mb");
    if (min_buckets) b.min_buckets = *min_buckets;
  }
};

}  // namespace examples
