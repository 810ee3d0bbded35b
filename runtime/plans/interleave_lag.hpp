// How far behind its reduction a bucket's parameter sync goes in interleaved overlap, chosen from
// one iteration measured at lag 0.
//
// Note [Choosing the interleave lag]
// The comm stream issues collectives in one order on every rank: bucket b's sync after the
// reduction of bucket b + lag. Between a reduction's completion and its sync's issue lie the
// step and the hops between the comm stream, the bucket, the shard and back (the "step chain",
// c). The next reduction after b's sync queues behind that sync on the link, and the sync behind
// the chain. With gradients I apart, reduction r and sync s on the link:
//  - backward is the bottleneck (r + s <= I): the reduction of b + lag + 1 is delayed unless
//    r + c + s <= (lag + 1) x I. So lag 0 when the chain fits between two buckets' gradients, and
//    when gradients come faster (a fast backward, or none at all: bench_overhead's 100 buckets
//    reported at once paid 4 hops per bucket in series, 5 ms an iteration) the lag that covers it;
//  - the link is the bottleneck (r + s > I): it idles for the chain after each reduction unless
//    lag reductions and syncs (lag x (r + s)) cover it: at least 1. And as long as the lag syncs
//    left after the last reduction fit in the link's backlog then (B (r + s) - (B - 1) I - r),
//    they end no later than the link would anyway: the largest such lag, since the link times
//    measured at lag 0 include a hand-over to the comm stream per collective that a deeper queue
//    does not pay (bench_overhead: lag 1 chosen from those times, 3.7 ms; lag 25 or more, 1.0).
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
