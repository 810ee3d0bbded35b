#include <utility>  // Boost 1.74 Asio with C++20 uses std::exchange without including it

#include "runtime/bootstrap/etcd_http.hpp"

#include <boost/asio.hpp>

#include <algorithm>
#include <array>
#include <cctype>

#include "runtime/bootstrap/net_address.hpp"

namespace shardflow::etcd {

namespace asio = boost::asio;
using asio::ip::tcp;

namespace {

constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return s;
}

}  // namespace

std::string base64(const std::string& bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  std::size_t i = 0;
  for (; i + 2 < bytes.size(); i += 3) {
    const std::uint32_t v = std::uint32_t(std::uint8_t(bytes[i])) << 16 | std::uint32_t(std::uint8_t(bytes[i + 1])) << 8 | std::uint8_t(bytes[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out += kAlphabet[(v >> s) & 63];
  }
  if (const std::size_t rest = bytes.size() - i; rest > 0) {
    std::uint32_t v = std::uint32_t(std::uint8_t(bytes[i])) << 16;
    if (rest == 2) v |= std::uint32_t(std::uint8_t(bytes[i + 1])) << 8;
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += rest == 2 ? kAlphabet[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

std::string unbase64(const std::string& text) {
  std::array<int, 256> value;
  value.fill(-1);
  for (int k = 0; k < 64; ++k) value[std::uint8_t(kAlphabet[k])] = k;
  std::string out;
  std::uint32_t acc = 0;
  int bits = 0;
  for (const char c : text) {
    if (c == '=') break;
    const int v = value[std::uint8_t(c)];
    if (v < 0) throw CommError("etcd: malformed base64 in a reply");
    acc = acc << 6 | std::uint32_t(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += char((acc >> bits) & 0xff);
    }
  }
  return out;
}

struct Connection::Impl {
  asio::io_context io;
  tcp::socket socket{io};
  tcp::endpoint target;
  std::string host_header;
  std::string in;        // bytes read and not yet consumed
  std::string stream;    // a watch's dechunked bytes not yet split into messages
  bool streaming = false;
  std::string where;

  template <class Start>
  void run(const char* what, Clock::time_point deadline, Start start) {
    bool finished = false;
    boost::system::error_code result;
    io.restart();
    start([&](boost::system::error_code ec, std::size_t = 0) {
      finished = true;
      result = ec;
    });
    io.run_until(deadline);
    if (!finished) {
      close();
      io.restart();
      io.run();
      throw NoAnswer("etcd at " + where + ": " + what + " got no answer in time");
    }
    if (result) {
      close();
      throw TransportError("etcd at " + where + ": " + what + ": " + result.message());
    }
  }

  void close() {
    boost::system::error_code ignored;
    socket.close(ignored);
    in.clear();
    stream.clear();
    streaming = false;
  }

  void connect(Clock::time_point deadline) {
    if (socket.is_open()) return;
    // A member that answers accepts within a round trip; one whose host is cut off drops the SYN,
    // and waiting for it would spend the whole request's time where the next member answers at
    // once. A lost SYN costs a failover to the next member, nothing more.
    run("connect", std::min(deadline, Clock::now() + std::chrono::seconds(1)), [&](auto done) { socket.async_connect(target, done); });
    boost::system::error_code ignored;
    socket.set_option(tcp::no_delay(true), ignored);
  }

  void read_more(Clock::time_point deadline) {
    std::array<char, 16384> chunk;
    std::size_t got = 0;
    run("read", deadline, [&](auto done) {
      socket.async_read_some(asio::buffer(chunk), [&, done](boost::system::error_code ec, std::size_t n) {
        got = n;
        done(ec);
      });
    });
    in.append(chunk.data(), got);
  }

  void send(const std::string& path, const std::string& json, const std::string& auth, bool keep_alive, Clock::time_point deadline) {
    connect(deadline);
    std::string req = "POST " + path + " HTTP/1.1\r\nHost: " + host_header + "\r\nContent-Type: application/json\r\n";
    if (!auth.empty()) req += "Authorization: " + auth + "\r\n";
    if (!keep_alive) req += "Connection: close\r\n";
    req += "Content-Length: " + std::to_string(json.size()) + "\r\n\r\n" + json;
    run("send", deadline, [&](auto done) { asio::async_write(socket, asio::buffer(req), done); });
  }

  // The status line and headers: the status, and whether the body is chunked (else its length).
  struct Head {
    int status = 0;
    bool chunked = false;
    std::size_t length = 0;
  };
  Head read_head(Clock::time_point deadline) {
    std::size_t end;
    while ((end = in.find("\r\n\r\n")) == std::string::npos) {
      if (in.size() > (1u << 20)) throw TransportError("etcd at " + where + ": a reply's headers exceed 1 MiB");
      read_more(deadline);
    }
    const std::string head = lower(in.substr(0, end));
    in.erase(0, end + 4);
    Head h;
    if (head.rfind("http/1.", 0) != 0 || head.size() < 12) throw TransportError("etcd at " + where + ": not an HTTP reply");
    h.status = std::atoi(head.c_str() + 9);
    std::size_t pos = 0;
    while ((pos = head.find("\r\n", pos)) != std::string::npos) {
      pos += 2;
      const std::size_t eol = std::min(head.find("\r\n", pos), head.size());
      const std::string line = head.substr(pos, eol - pos);
      if (line.rfind("content-length:", 0) == 0) h.length = std::size_t(std::atoll(line.c_str() + 15));
      if (line.rfind("transfer-encoding:", 0) == 0 && line.find("chunked") != std::string::npos) h.chunked = true;
    }
    return h;
  }

  // The next chunk of a chunked body ("" at its end).
  std::string read_chunk(Clock::time_point deadline) {
    std::size_t eol;
    while ((eol = in.find("\r\n")) == std::string::npos) read_more(deadline);
    const std::size_t size = std::size_t(std::stoull(in.substr(0, eol), nullptr, 16));
    if (size == 0) {  // the last chunk: trailers follow (the gateway sends Grpc-Trailer-*), then an empty line
      in.erase(0, eol + 2);
      for (;;) {
        std::size_t end;
        while ((end = in.find("\r\n")) == std::string::npos) read_more(deadline);
        in.erase(0, end + 2);
        if (end == 0) return {};
      }
    }
    while (in.size() < eol + 2 + size + 2) read_more(deadline);
    std::string data = in.substr(eol + 2, size);
    in.erase(0, eol + 2 + size + 2);
    return data;
  }

  std::string read_body(const Head& h, Clock::time_point deadline) {
    if (!h.chunked) {
      while (in.size() < h.length) read_more(deadline);
      std::string body = in.substr(0, h.length);
      in.erase(0, h.length);
      return body;
    }
    std::string body;
    for (std::string c; !(c = read_chunk(deadline)).empty();) body += c;
    return body;
  }
};

Connection::Connection(std::string endpoint) : impl_(std::make_unique<Impl>()) {
  if (endpoint.rfind("http://", 0) == 0) endpoint.erase(0, 7);
  while (!endpoint.empty() && endpoint.back() == '/') endpoint.pop_back();
  endpoint_ = endpoint;
  impl_->where = endpoint;
  const auto colon = endpoint.rfind(':');
  if (colon == std::string::npos || colon == 0) throw UsageError("etcd endpoint '" + endpoint + "': expected host:port");
  const int port = std::atoi(endpoint.c_str() + colon + 1);
  if (port <= 0 || port > 65535) throw UsageError("etcd endpoint '" + endpoint + "': the port is not in 1..65535");
  boost::system::error_code ec;
  const auto addr = asio::ip::make_address(net::resolve_ipv4(endpoint.substr(0, colon)), ec);
  if (ec) throw UsageError("etcd endpoint '" + endpoint + "': not an IPv4 address or host name");
  impl_->target = tcp::endpoint(addr, std::uint16_t(port));
  impl_->host_header = endpoint;
}

Connection::~Connection() = default;

Reply Connection::post(const std::string& path, const std::string& json, const std::string& auth, Clock::time_point deadline) {
  auto& I = *impl_;
  if (I.streaming) I.close();
  I.send(path, json, auth, true, deadline);
  const auto head = I.read_head(deadline);
  const std::string body = I.read_body(head, deadline);
  Reply r;
  r.status = head.status;
  r.body = nlohmann::json::parse(body, nullptr, false);
  if (r.body.is_discarded()) throw TransportError("etcd at " + I.where + ": a reply to " + path + " is not JSON (HTTP " + std::to_string(head.status) + ")");
  return r;
}

void Connection::open_stream(const std::string& path, const std::string& json, const std::string& auth, Clock::time_point deadline) {
  auto& I = *impl_;
  I.close();
  I.send(path, json, auth, false, deadline);
  const auto head = I.read_head(deadline);
  if (!head.chunked) {
    const auto body = I.read_body(head, deadline);
    I.close();
    throw TransportError("etcd at " + I.where + ": " + path + " answered HTTP " + std::to_string(head.status) + " without a stream: " + body);
  }
  I.streaming = true;
}

std::optional<nlohmann::json> Connection::next(Clock::time_point deadline) {
  auto& I = *impl_;
  for (;;) {
    if (const auto nl = I.stream.find('\n'); nl != std::string::npos) {
      auto msg = nlohmann::json::parse(I.stream.substr(0, nl), nullptr, false);
      I.stream.erase(0, nl + 1);
      if (msg.is_discarded()) throw TransportError("etcd at " + I.where + ": a watch message is not JSON");
      return msg;
    }
    try {
      const std::string c = I.read_chunk(deadline);
      if (c.empty()) throw TransportError("etcd at " + I.where + ": the watch stream ended");
      I.stream += c;
    } catch (const TransportError&) {
      if (Clock::now() >= deadline) return std::nullopt;
      throw;
    }
  }
}

}  // namespace shardflow::etcd
