// Note [Runtime threads first]
// The runtime's own threads (CAF scheduler workers, comm streams, the simulated link's timer, the
// device completion watcher) only route messages and start collectives: microseconds of work each
// time they wake. When the trainer threads keep every core busy (CPU training, ranks as threads),
// the kernel lets a woken runtime thread wait until a trainer's time slice ends or it blocks —
// measured: a bucket whose last gradient was reported 400 us into backward was issued only when
// the trainer reached wait(), so nothing overlapped. Each runtime thread therefore asks for a
// short time slice (Linux >= 6.12 EEVDF: sched_attr.sched_runtime, no privilege needed), which
// lets it preempt a busy trainer on wake-up, and for a better nice value where it may (root or
// CAP_SYS_NICE). Both are hints: where the kernel refuses, nothing else changes.
#pragma once

namespace shardflow {

// Call at the start of a runtime thread; `name` (up to 15 characters) shows in top, perf, gdb.
void runtime_thread_started(const char* name);

}  // namespace shardflow
