// Relays a child's output line by line with a prefix ("[rank 1] "), so that the lines of N ranks
// interleave whole rather than mid-line. A line is written with one write(2), so lines from
// different pipes never tear each other.
#pragma once

#include <string>

namespace shardflow::launch {

class OutputRelay {
 public:
  OutputRelay(int out_fd, std::string prefix) : out_(out_fd), prefix_(std::move(prefix)) {}
  void feed(const char* data, std::size_t n);  // writes every complete line
  void flush();                                // the unterminated rest, at EOF
  void set_prefix(std::string prefix) { prefix_ = std::move(prefix); }  // the rank renumbered

 private:
  void emit(const char* data, std::size_t n);
  int out_;
  std::string prefix_;
  std::string pending_;
};

}  // namespace shardflow::launch
