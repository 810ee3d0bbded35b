#include "runtime/observe/timeline.hpp"

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <set>

#include "runtime/observe/logging.hpp"
#include "shardflow/errors.hpp"
#include "shardflow/shardflow.hpp"

namespace shardflow {
namespace {

const char* lane_name(Lane l) {
  switch (l) {
    case Lane::compute: return "compute (trainer)";
    case Lane::comm: return "comm stream";
    case Lane::optimizer: return "optimizer (shard)";
    case Lane::cast_to: return "cast to wire";
    case Lane::cast_from: return "cast from wire";
    case Lane::iteration: return "iteration";
  }
  return "?";
}

}  // namespace

// The file's events from every timeline of this process that writes to it; written once the last
// of them is gone.
class TraceSink {
 public:
  static TraceSink& get() {
    static TraceSink sink;
    return sink;
  }
  void attach(const std::string& path) {
    std::lock_guard lock(mu_);
    ++files_[path].open;
  }
  void detach(Timeline& t) {
    std::lock_guard lock(mu_);
    auto& f = files_[t.path_];
    {
      std::lock_guard tl(t.mu_);
      std::set<Lane> lanes;
      for (auto& e : t.events_) {
        // Numeric tids with thread_name metadata: Perfetto's importer folds string tids of one
        // process into one track.
        nlohmann::json j = {{"name", e.name}, {"cat", e.cat}, {"pid", t.rank_}, {"tid", int(e.lane)}, {"ts", e.begin}};
        lanes.insert(e.lane);
        if (e.end >= 0) {
          j["ph"] = "X";
          j["dur"] = e.end - e.begin;
        } else {
          j["ph"] = "i";
          j["s"] = "t";
        }
        nlohmann::json args = nlohmann::json::object();
        if (e.args.bucket >= 0) args["bucket"] = e.args.bucket;
        if (e.args.bytes >= 0) args["bytes"] = e.args.bytes;
        if (e.args.dtype) args["dtype"] = e.args.dtype;
        if (e.args.iteration >= 0) args["iteration"] = e.args.iteration;
        if (e.args.issued_us >= 0) args["issued_us"] = e.args.issued_us;
        if (!args.empty()) j["args"] = std::move(args);
        f.events.push_back(std::move(j));
      }
      f.events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", t.rank_}, {"args", {{"name", "rank " + std::to_string(t.rank_)}}}});
      f.events.push_back({{"name", "process_sort_index"}, {"ph", "M"}, {"pid", t.rank_}, {"args", {{"sort_index", t.rank_}}}});
      for (auto l : lanes) {
        f.events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", t.rank_}, {"tid", int(l)}, {"args", {{"name", lane_name(l)}}}});
        f.events.push_back(
            {{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", t.rank_}, {"tid", int(l)}, {"args", {{"sort_index", int(l)}}}});
      }
    }
    if (--f.open > 0) return;
    std::ofstream out(t.path_);
    out << nlohmann::json{{"traceEvents", std::move(f.events)}, {"displayTimeUnit", "ms"}}.dump() << "\n";
    if (!out) rank_logger(t.rank_)->error("could not write the trace to '{}'", t.path_);
    files_.erase(t.path_);
  }

 private:
  struct File {
    int open = 0;
    nlohmann::json::array_t events;
  };
  std::mutex mu_;
  std::map<std::string, File> files_;
};

Timeline::Time Timeline::now() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string trace_file_for(const std::string& given, int rank, bool one_process_per_rank) {
  std::string path = given;
  const auto at = path.find("{rank}");
  if (at != std::string::npos) {
    path.replace(at, 6, std::to_string(rank));
  } else if (one_process_per_rank) {
    // Every rank its own file beside the given one (ranks would overwrite one another's otherwise).
    const auto slash = path.rfind('/');
    const auto dot = path.rfind('.');
    const bool has_ext = dot != std::string::npos && (slash == std::string::npos || dot > slash);
    path = (has_ext ? path.substr(0, dot) : path) + ".rank" + std::to_string(rank) + (has_ext ? path.substr(dot) : ".json");
  }
  return path;
}

std::string resolve_trace_path(const std::string& given, int rank, bool one_process_per_rank) {
  const std::string path = trace_file_for(given, rank, one_process_per_rank);
  // Fail now, not after training: open the file for writing (and remove it again if it is new).
  std::FILE* probe = std::fopen(path.c_str(), "r");
  const bool existed = probe != nullptr;
  if (probe) std::fclose(probe);
  std::FILE* f = std::fopen(path.c_str(), "a");
  if (!f)
    throw UsageError("Config::trace.path: cannot write the trace of rank " + std::to_string(rank) + " to '" + path + "': " +
                     std::strerror(errno));
  std::fclose(f);
  if (!existed) std::remove(path.c_str());
  return path;
}

Timeline::Timeline(int rank, std::string path) : rank_(rank), path_(std::move(path)) {
  if (!path_.empty()) TraceSink::get().attach(path_);
}

Timeline::~Timeline() { close(); }

void Timeline::close() {
  {
    std::lock_guard lock(mu_);
    if (closed_) return;
    closed_ = true;
  }
  if (!path_.empty()) TraceSink::get().detach(*this);
}

void Timeline::span(std::string name, const char* cat, Lane lane, Time begin, Time end, SpanArgs args) {
  if (path_.empty()) return;
  std::lock_guard lock(mu_);
  if (!closed_) events_.push_back(Event{std::move(name), cat, lane, begin, end, args});
}

void Timeline::instant(std::string name, const char* cat, Lane lane, SpanArgs args) {
  if (path_.empty()) return;
  const Time t = now();
  std::lock_guard lock(mu_);
  if (!closed_) events_.push_back(Event{std::move(name), cat, lane, t, -1, args});
}

void Timeline::collective(const std::function<std::string()>& name, const char* cat, int kind, std::size_t bytes, std::size_t wire,
                          Time issued, Time completed, SpanArgs args) {
  Time begin;
  {
    std::lock_guard lock(mu_);
    begin = std::max(issued, comm_free_);
    if (begin > completed) begin = completed;
    comm_free_ = completed;
  }
  stats_.link(begin, completed, kind, bytes, wire, std::strcmp(cat, "sync") == 0, args.bucket, issued, args.ready_us);
  if (!tracing()) return;
  args.issued_us = issued;
  args.bytes = std::int64_t(bytes);
  span(name(), cat, Lane::comm, begin, completed, args);
}

}  // namespace shardflow
