// How far behind its reduction a bucket's parameter sync goes in interleaved overlap, chosen from
// one iteration measured at lag 0.
//
// Note [Choosing the interleave lag]
// The comm stream issues collectives in one order on every rank: bucket b's sync after the
// reduction of bucket b + lag. Between a reduction's completion and its sync's issue lie the
// step and the hops between the comm stream, the bucket, the shard and back (the "step chain",
// c). At lag 0 the next reduction queues behind that chain, so it costs nothing only when the
// next bucket's gradients come later anyway (reduce time r + c <= the interval between buckets'
// gradients) and the link has time to spare (r + s <= that interval). Otherwise:
//  - gradients come faster than the chain (a fast backward, or none at all: bench_overhead's
//    100 buckets reported at once paid 4 hops per bucket in series, 5 ms an iteration): the
//    reduction of b + lag + 1 waits for b's step unless r + c <= (lag + 1) x interval;
//  - the link is the bottleneck (r + s > the interval): it idles for the chain after each
//    reduction unless lag reductions and syncs (lag x (r + s)) cover it.
// The least lag that meets both, at most 64. A larger lag costs the syncs that trail the last
// reduction (lag of them instead of one) when backward ends, which is why 0 stays when it is free.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace shardflow {

// `gradient_us`: when each bucket's last gradient came in (-1: unknown); `reduce_ms` and
// `sync_ms`: one bucket's reduction and sync on the link (the mean); `step_chain_ms`: per bucket,
// its reduction's completion to its sync's issue at lag 0 (-1: unknown; the median is used).
std::size_t choose_interleave_lag(const std::vector<std::int64_t>& gradient_us, double reduce_ms, double sync_ms,
                                  const std::vector<double>& step_chain_ms, std::size_t max_lag = 64);

}  // namespace shardflow
