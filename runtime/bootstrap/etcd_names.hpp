// How the store on etcd is named on the command line and in the environment: a comma-separated
// list of member endpoints, and the key root a job's run id gives (Note [A store no node owns]).
#pragma once

#include <algorithm>
#include <string>
#include <vector>

namespace shardflow::etcd {

// "h1:2379,h2:2379" -> {"h1:2379", "h2:2379"}; empty items are dropped.
inline std::vector<std::string> split_endpoints(const std::string& list) {
  std::vector<std::string> out;
  for (std::size_t start = 0; start <= list.size();) {
    const std::size_t comma = std::min(list.find(',', start), list.size());
    if (comma > start) out.push_back(list.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

inline std::string join_endpoints(const std::vector<std::string>& endpoints) {
  std::string out;
  for (const auto& e : endpoints) out += (out.empty() ? "" : ",") + e;
  return out;
}

// Where a job's keys live: every node and rank derives it from the same run id.
inline std::string root_for(const std::string& run_id) { return "/shardflow/" + run_id + "/"; }

}  // namespace shardflow::etcd
