// Note [Timeline]
// What each rank did when. Every span carries a category from a fixed list (forward, backward,
// reduce, cast, step, sync, wait, rebuild, iteration) and goes on one of a rank's lanes:
//   compute    the trainer thread: forward / backward / its own step (Runtime::span), each
//              grad_ready (instants), wait(), wait_param() and backpressure waits, the rebuild
//   comm       each collective while it held the rank's comm stream: from max(issue, the end of the
//              one before) to its completion. Collectives complete in issue order on one stream,
//              so these spans never overlap (Perfetto and chrome://tracing draw partially
//              overlapping slices of one lane wrongly); the issue time is an argument.
//   optimizer  the shard's steps (and packing for the sync), unpacking after a sync
//   cast to / from wire   16-bit communication's casts (two threads: two lanes)
//   iteration  one span per synchronised iteration
// Timestamps are wall-clock microseconds: one clock for every rank of a process, and processes on
// one host line up. Always on (the figures of Runtime::stats() come from the same spans); the
// events are kept for a file only when Config::trace.path is set. Ranks of one process share the
// file (written when the last of them closes); under a launcher each rank writes
// <stem>.rank<r>.json unless the path has "{rank}".
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/observe/overlap_stats.hpp"

namespace shardflow {

enum class Lane : std::uint8_t { compute = 1, comm = 2, optimizer = 3, cast_to = 4, cast_from = 5, iteration = 6 };

// Arguments shown with a span; unset fields are left out.
struct SpanArgs {
  std::int64_t bucket = -1;
  std::int64_t bytes = -1;
  const char* dtype = nullptr;
  std::int64_t iteration = -1;
  std::int64_t issued_us = -1;  // collectives: when the runtime issued it
  std::int64_t ready_us = -1;   // collectives: when it could have gone out, its turn aside (a sync: its step done)
};

class Timeline {
 public:
  using Time = std::int64_t;  // microseconds since the Unix epoch
  static Time now();

  // `path` empty: no file, only the figures. The path is checked (and "{rank}" replaced) by
  // resolve_trace_path() before the timeline is made.
  Timeline(int rank, std::string path);
  ~Timeline();  // close()
  // Hands the events to the file's sink (written when the last timeline of the file closed).
  // Later events are dropped: completions may still arrive from the backend's threads.
  void close();
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  bool tracing() const { return !path_.empty(); }
  void span(std::string name, const char* cat, Lane lane, Time begin, Time end, SpanArgs args = {});
  void instant(std::string name, const char* cat, Lane lane, SpanArgs args = {});
  // A collective completed: its span on the comm lane starts where the previous one ended (or at
  // its issue, if later). Feeds the link figures too.
  // `name` is called only when a trace file is written (it runs once per collective).
  // `bytes`: the collective's buffer (collective_bytes); `wire`: what this rank put on the link (wire_bytes).
  void collective(const std::function<std::string()>& name, const char* cat, int kind, std::size_t bytes, std::size_t wire,
                  Time issued, Time completed, SpanArgs args);

  OverlapStats& stats() { return stats_; }

 private:
  struct Event {
    std::string name;
    const char* cat;
    Lane lane;
    Time begin, end;  // end < 0: an instant
    SpanArgs args;
  };
  friend class TraceSink;
  const int rank_;
  std::string path_;
  std::mutex mu_;
  std::vector<Event> events_;
  Time comm_free_ = 0;  // when the previous collective left the stream
  bool closed_ = false;
  OverlapStats stats_;
};

// Where rank `rank`'s trace goes (trace_file_for, shardflow.hpp), checked: UsageError if the file
// cannot be written, so that a bad path fails before training rather than after it.
std::string resolve_trace_path(const std::string& path, int rank, bool one_process_per_rank);

}  // namespace shardflow
