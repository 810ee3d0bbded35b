// A TCP key-value store for rendezvous: ranks exchange addresses, NCCL unique ids and Gloo's
// rendezvous keys through it. The server runs inside rank 0 or the launcher; clients are
// synchronous and every call has a timeout.
//
// Protocol (all little-endian): a frame is a u32 length and that many bytes; a request frame is a
// u8 op followed by length-prefixed strings (u32 + bytes) and, for ADD, an i64; a reply frame is a
// u8 status (0 ok, 1 error) and the payload. The first request of a connection must be HELLO with
// the job's token.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace shardflow {

struct StoreServerOptions {
  std::string host = "127.0.0.1";  // loopback unless told otherwise
  std::uint16_t port = 0;          // 0: any free port (see TcpStoreServer::port())
  std::string token;               // clients must present it; empty is refused
  std::size_t max_frame_bytes = std::size_t{64} << 20;
  // Before a connection has shown the token it may send only a HELLO this small: a stranger cannot
  // make the server allocate a large frame.
  std::size_t max_hello_bytes = 4096;
  // What the whole store may hold (a rendezvous needs a few keys per rank): a SET or ADD past
  // either limit is refused to that client with an error naming the limit; the others go on.
  std::size_t max_keys = std::size_t{1} << 20;
  std::size_t max_bytes = std::size_t{256} << 20;  // keys and values together
  // A client that sends part of a frame and then stalls is disconnected after this long.
  std::chrono::milliseconds stall_timeout = std::chrono::seconds(30);
};

class TcpStoreServer {
 public:
  explicit TcpStoreServer(StoreServerOptions options);
  ~TcpStoreServer();  // stops serving, closes every connection
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;
  std::uint16_t port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

class TcpStoreClient {
 public:
  // Connects and authenticates; TimeoutError / CommError naming host:port when that fails.
  TcpStoreClient(const std::string& host, std::uint16_t port, const std::string& token,
                 std::chrono::milliseconds timeout = std::chrono::minutes(10));
  ~TcpStoreClient();
  TcpStoreClient(const TcpStoreClient&) = delete;
  TcpStoreClient& operator=(const TcpStoreClient&) = delete;

  void set(const std::string& key, const std::string& value);
  // Waits (up to the client's timeout) until the key exists, then returns its value.
  std::string get(const std::string& key);
  std::int64_t add(const std::string& key, std::int64_t delta);  // counters are decimal strings
  bool check(const std::vector<std::string>& keys);                // all present now?
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);  // TimeoutError naming the missing
  bool remove(const std::string& key);                             // true if it existed
  // The deadline of each later call (the constructor's timeout until then).
  void set_timeout(std::chrono::milliseconds timeout);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// How a backend's rank finds its peers: its place in the world and the store the world meets at.
// Backend options (GlooOptions, ShmOptions) extend it.
struct StoreRendezvous {
  int rank = 0;
  int world_size = 1;
  std::string store_host = "127.0.0.1";
  std::uint16_t store_port = 0;
  std::string token;
  std::string key_prefix;  // several communicators can share one store
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
};

// Every key gets `prefix` in front: several jobs or phases share one server without clashing.
class PrefixStore {
 public:
  PrefixStore(TcpStoreClient& store, std::string prefix) : store_(store), prefix_(std::move(prefix)) {}
  void set(const std::string& k, const std::string& v) { store_.set(prefix_ + k, v); }
  std::string get(const std::string& k) { return store_.get(prefix_ + k); }
  std::int64_t add(const std::string& k, std::int64_t d) { return store_.add(prefix_ + k, d); }
  bool check(std::vector<std::string> keys) { return store_.check(prefixed(std::move(keys))); }
  void wait(std::vector<std::string> keys, std::chrono::milliseconds t) { store_.wait(prefixed(std::move(keys)), t); }
  bool remove(const std::string& k) { return store_.remove(prefix_ + k); }

 private:
  std::vector<std::string> prefixed(std::vector<std::string> keys) const {
    for (auto& k : keys) k = prefix_ + k;
    return keys;
  }
  TcpStoreClient& store_;
  std::string prefix_;
};

}  // namespace shardflow
