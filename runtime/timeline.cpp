#include "runtime/timeline.hpp"

#include <nlohmann/json.hpp>

#include <fstream>
#include <map>

#include "runtime/logging.hpp"

namespace shardflow {

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
      for (auto& e : t.events_) {
        nlohmann::json j = {{"name", e.name}, {"pid", t.rank_}, {"tid", e.lane}, {"ts", e.begin}};
        if (e.end >= 0) {
          j["ph"] = "X";
          j["dur"] = e.end - e.begin;
        } else {
          j["ph"] = "i";
          j["s"] = "t";
        }
        f.events.push_back(std::move(j));
      }
      f.events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", t.rank_}, {"args", {{"name", "rank " + std::to_string(t.rank_)}}}});
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

Timeline::Timeline(int rank, std::string path) : rank_(rank), path_(std::move(path)) {
  const auto at = path_.find("{rank}");
  if (at != std::string::npos) path_.replace(at, 6, std::to_string(rank_));
  TraceSink::get().attach(path_);
}

Timeline::~Timeline() { close(); }

void Timeline::close() {
  {
    std::lock_guard lock(mu_);
    if (closed_) return;
    closed_ = true;
  }
  TraceSink::get().detach(*this);
}

void Timeline::span(std::string name, const char* lane, Time begin, Time end) {
  std::lock_guard lock(mu_);
  if (!closed_) events_.push_back(Event{std::move(name), lane, begin, end});
}

void Timeline::instant(std::string name, const char* lane) {
  const Time t = now();
  std::lock_guard lock(mu_);
  if (!closed_) events_.push_back(Event{std::move(name), lane, t, -1});
}

}  // namespace shardflow
