// Why a bucket's work failed; kind none means success. Travels in the actors' messages (reduced,
// bucket_done, norm_done, broadcast_done) and reaches the trainer through IterationSignal, which
// turns it back into the error type it came from.
#pragma once

#include <caf/meta/type_name.hpp>

#include <cstdint>
#include <string>

namespace shardflow {

struct BucketFailure {
  enum Kind : std::uint8_t { none = 0, timeout = 1, mismatch = 2, comm = 3, usage = 4 };
  std::uint8_t kind = none;
  std::string what;
  explicit operator bool() const { return kind != none; }
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, BucketFailure& x) {
  return f(caf::meta::type_name("failure"), x.kind, x.what);
}

}  // namespace shardflow
