// HTTP/1.1 to one etcd member's JSON gateway: a unary POST, and the streaming POST a watch is.
// Every read and write runs under a deadline (io_context::run_for), as the TCP store's client does.
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "shardflow/errors.hpp"

namespace shardflow::etcd {

using Clock = std::chrono::steady_clock;

// The member could not be reached or broke the connection: the caller tries the next one.
struct TransportError : CommError {
  using CommError::CommError;
};
// A member that did not answer within a request's time at all (SIGSTOPped, its host cut off), as
// opposed to one that answered with an error or refused the connection.
struct NoAnswer : TransportError {
  using TransportError::TransportError;
};

std::string base64(const std::string& bytes);
std::string unbase64(const std::string& text);  // CommError on malformed input

struct Reply {
  int status = 0;        // HTTP status
  nlohmann::json body;   // the gateway's JSON (an error: {"error", "code", "message"})
};

class Connection {
 public:
  explicit Connection(std::string endpoint);  // "host:port" or "http://host:port"
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  const std::string& endpoint() const { return endpoint_; }
  // One request on a kept-alive connection (opened on first use). TransportError when the member
  // does not answer by `deadline` or drops the connection.
  Reply post(const std::string& path, const std::string& json, const std::string& auth, Clock::time_point deadline);
  // A watch: the request goes out, then next() gives each message of the stream as it comes.
  void open_stream(const std::string& path, const std::string& json, const std::string& auth, Clock::time_point deadline);
  std::optional<nlohmann::json> next(Clock::time_point deadline);  // nullopt: the deadline passed

 private:
  struct Impl;
  std::string endpoint_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardflow::etcd
