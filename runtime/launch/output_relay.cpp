#include "runtime/launch/output_relay.hpp"

#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace shardflow::launch {

void OutputRelay::feed(const char* data, std::size_t n) {
  pending_.append(data, n);
  std::size_t start = 0;
  for (;;) {
    // A carriage return ends a line too: progress lines redrawn in place stay readable in a log.
    const std::size_t end = pending_.find_first_of("\n\r", start);
    if (end == std::string::npos) break;
    if (end > start) emit(pending_.data() + start, end - start);
    start = end + 1;
  }
  pending_.erase(0, start);
  // A child that never ends its line must not grow this buffer without bound.
  if (pending_.size() > 64 * 1024) flush();
}

void OutputRelay::flush() {
  if (!pending_.empty()) emit(pending_.data(), pending_.size());
  pending_.clear();
}

void OutputRelay::emit(const char* data, std::size_t n) {
  std::string line;
  line.reserve(prefix_.size() + n + 1);
  line.append(prefix_).append(data, n).push_back('\n');
  const char* p = line.data();
  std::size_t left = line.size();
  while (left > 0) {
    const ssize_t w = ::write(out_, p, left);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;  // our own stdout is gone (closed pipe): nothing better to do
    p += w;
    left -= std::size_t(w);
  }
}

}  // namespace shardflow::launch
