// Note [Timeline]
// What each rank did when, as a Chrome trace (chrome://tracing, ui.perfetto.dev): one process row
// per rank, lanes "backward" (each grad_ready), "comm" (each collective from issue to the
// completion the runtime heard of) and "trainer" (wait()). Timestamps are wall-clock
// microseconds, so ranks that are threads of one process and ranks that are processes on one host
// line up. Config::trace_path turns it on; ranks of one process write one file together, when the
// last of them is destroyed ("{rank}" in the path gives each rank its own file, which processes of
// a multi-process job need).
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace shardflow {

class Timeline {
 public:
  using Time = std::int64_t;  // microseconds since the Unix epoch
  static Time now();

  Timeline(int rank, std::string path);
  ~Timeline();  // close()
  // Hands the events to the file's sink (written when the last timeline of the file closed).
  // Later events are dropped: completions may still arrive from the backend's threads.
  void close();
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  void span(std::string name, const char* lane, Time begin, Time end);
  void instant(std::string name, const char* lane);

 private:
  struct Event {
    std::string name;
    const char* lane;
    Time begin, end;  // end < 0: an instant
  };
  friend class TraceSink;
  const int rank_;
  std::string path_;
  std::mutex mu_;
  std::vector<Event> events_;
  bool closed_ = false;
};

}  // namespace shardflow
