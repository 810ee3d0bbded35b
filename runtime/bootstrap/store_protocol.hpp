// Frames of the TCP store (see shardflow/store.hpp): encoding shared by server and client.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

namespace shardflow::store {

enum Op : std::uint8_t { hello = 1, set = 2, get = 3, add = 4, check = 5, wait = 6, remove = 7 };

class Writer {
 public:
  Writer& u8(std::uint8_t v) {
    buf_.push_back(char(v));
    return *this;
  }
  Writer& u32(std::uint32_t v) { return raw(&v, 4); }
  Writer& i64(std::int64_t v) { return raw(&v, 8); }
  Writer& str(const std::string& s) {
    u32(std::uint32_t(s.size()));
    buf_ += s;
    return *this;
  }
  // The payload with its u32 length in front.
  std::string frame() const {
    std::string out(4, '\0');
    const auto n = std::uint32_t(buf_.size());
    std::memcpy(out.data(), &n, 4);
    return out + buf_;
  }

 private:
  Writer& raw(const void* p, std::size_t n) {  // the hosts are little-endian x86-64 / aarch64
    buf_.append(static_cast<const char*>(p), n);
    return *this;
  }
  std::string buf_;
};

// Reads fields off a payload; every getter returns false instead of reading past the end.
class Reader {
 public:
  explicit Reader(const std::string& s) : s_(s) {}
  bool u8(std::uint8_t& v) { return raw(&v, 1); }
  bool u32(std::uint32_t& v) { return raw(&v, 4); }
  bool i64(std::int64_t& v) { return raw(&v, 8); }
  bool str(std::string& v) {
    std::uint32_t n;
    if (!u32(n) || n > s_.size() - at_) return false;
    v.assign(s_, at_, n);
    at_ += n;
    return true;
  }
  bool done() const { return at_ == s_.size(); }

 private:
  bool raw(void* p, std::size_t n) {
    if (s_.size() - at_ < n) return false;
    std::memcpy(p, s_.data() + at_, n);
    at_ += n;
    return true;
  }
  const std::string& s_;
  std::size_t at_ = 0;
};

}  // namespace shardflow::store
