// How shardflow's actors talk. Per rank:
//
//   trainer thread --grad_ready(param)--> bucket actor b
//   bucket actor b --bucket_ready(b)----> comm stream actor      (all of b's gradients are in)
//   comm stream    --submit in bucket order--> Communicator      (same order on every rank)
//   Communicator completion --reduced(b, failure)--> bucket actor b   (buffer released)
//   bucket actor b --bucket_done(b, failure)--> iteration actor  (iteration completes when all are)
//
// Reserved for the ZeRO shard actors: step_done(b) after a shard's optimizer step, and
// broadcast_done(b) after its parameter sync.
#pragma once

#include <caf/atom.hpp>
#include <caf/meta/type_name.hpp>

#include <cstdint>
#include <string>

namespace shardflow::msg {

using grad_ready_atom = caf::atom_constant<caf::atom("grad_ready")>;
using bucket_ready_atom = caf::atom_constant<caf::atom("bkt_ready")>;
using reduced_atom = caf::atom_constant<caf::atom("reduced")>;
using bucket_done_atom = caf::atom_constant<caf::atom("bkt_done")>;
using step_done_atom = caf::atom_constant<caf::atom("step_done")>;
using broadcast_done_atom = caf::atom_constant<caf::atom("bcast_done")>;

// Why a bucket's work failed; kind none means success. Travels in reduced / bucket_done.
struct Failure {
  enum Kind : std::uint8_t { none = 0, timeout = 1, mismatch = 2, comm = 3, usage = 4 };
  std::uint8_t kind = none;
  std::string what;
  explicit operator bool() const { return kind != none; }
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, Failure& x) {
  return f(caf::meta::type_name("failure"), x.kind, x.what);
}

}  // namespace shardflow::msg
