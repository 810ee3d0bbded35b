// This process's resident memory from /proc (Linux), for the benchmarks that report memory.
#pragma once

#include <cstring>
#include <fstream>
#include <string>

namespace shardflow::bench {

// MB (10^6 bytes): VmRSS now, or VmHWM (the peak since reset_peak()).
inline double resident_mb(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field, 0) == 0) return std::stod(line.substr(std::strlen(field))) * 1024 / 1e6;  // kB
  return 0;
}
// Writing 5 to clear_refs starts the peak (VmHWM) over from the current RSS.
inline void reset_peak() { std::ofstream("/proc/self/clear_refs") << "5"; }

}  // namespace shardflow::bench
