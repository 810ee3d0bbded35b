// What crosses the network between hosts in one step, per bucket, for the flat ring and for the
// two levels (Note [Bytes on the network]). `shardflow plan --hosts H` prints it.
//
// Note [Bytes on the network]
// W = H hosts x L ranks, hosts holding consecutive ranks (as `shardflow run` numbers them); B the
// bytes of a collective's full buffer. Counted: the bytes that leave a host, summed over the hosts
// (each crosses one link once; a host's link carries its share each way).
//   flat ring (Gloo): the ring's W edges include H that leave a host, and each edge carries what
//     one rank sends: 2 (W-1)/W B for an all-reduce, (W-1)/W B for a reduce-scatter or an
//     all-gather. In all H of that: 2 H (W-1)/W B and H (W-1)/W B.
//   two levels (shardflow/hierarchical.hpp): only the cross-host stage leaves a host, each of the W
//     ranks sending its ring's share of 1/L of the buffer: 2 (H-1) B for an all-reduce, (H-1) B for
//     a reduce-scatter or an all-gather.
//   broadcast (the param and bucket partitions' syncs): every other host must receive the buffer
//     once, (H-1) B, which the two levels do; the flat count assumes the same.
// At 2 x 2 that is 2/3 of the flat ring's bytes for every reduction and sync, and no exact scheme
// does better: each host must send the half of every gradient the other host reduces and receive
// the other half's sum (B each way for an all-reduce, where the flat ring sends 1.5 B each way).
// Collectives outside the buckets (the loss, the gradient norm's few words) are not counted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "runtime/plans/bucket_plan.hpp"
#include "runtime/plans/shard_plan.hpp"
#include "shardflow/communicator.hpp"

namespace shardflow {

// Bytes that leave a host for one collective of B bytes (B: collective_bytes).
std::size_t network_bytes(CollectiveKind kind, std::size_t bytes, int hosts, int per_host, bool two_levels);

struct NetworkCollective {
  CollectiveKind kind = CollectiveKind::allreduce;
  std::size_t bytes = 0;            // the full buffer on the wire (its wire dtype)
  std::size_t network = 0;          // leaving the hosts, with the chosen backend
  std::size_t flat_ring = 0;        // leaving the hosts, with the flat ring
};

struct NetworkPlan {
  int hosts = 1, per_host = 1;
  bool two_levels = false;  // the hierarchical backend (auto's choice for several hosts of several ranks)
  std::vector<std::vector<NetworkCollective>> buckets;  // each bucket's reduction, then its sync
  std::size_t per_step = 0, flat_ring_per_step = 0;
  // Two levels, per rank: what lies between the levels while one collective is in flight (1/L of
  // its buffer; the largest bucket's), and the second shared-memory segment the gathers run on.
  std::size_t scratch_largest = 0, second_segment = 0;
};

// `reduce_scatter`: Config::zero.reduce_scatter; `sharded`: the optimizer's state is split (stage
// 1 or 2 with an optimizer, world > 1); `twin_distance` (0: none): each bucket's reduced slices
// shift that many ranks on (Note [Mirrored shards]), with `twin_syncs` in place of the all-gather
// (Note [Syncs from the twin]; over two levels, of its stage between the hosts: Note [Syncs from
// the twin, two levels]). UsageError when hosts does not divide the world.
NetworkPlan make_network_plan(const BucketPlan& plan, const ShardPlan& shard, int world, int hosts, bool two_levels, DType comm_dtype,
                              bool sharded, bool stage2, bool reduce_scatter, int twin_distance = 0, bool twin_syncs = false);

}  // namespace shardflow
