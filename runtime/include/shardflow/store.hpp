// The key-value store a job meets at: ranks exchange addresses, NCCL unique ids and Gloo's
// rendezvous keys through it, and launchers keep the job's membership in it. Two kinds behind one
// interface (Store): shardflow's own TCP store, served by rank 0 or a launcher (the default, for one
// host and small jobs), and etcd (EtcdStore, shardflow/etcd_store.hpp), a replicated store whose
// loss of one host the job survives. Every call is synchronous and has a timeout.
//
// The TCP store's protocol (all little-endian): a frame is a u32 length and that many bytes; a
// request frame is a u8 op followed by length-prefixed strings (u32 + bytes) and, for ADD, an i64;
// a reply frame is a u8 status (0 ok, 1 error) and the payload. The first request of a connection
// must be HELLO with the job's token.
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

// What every store offers. Keys and values are byte strings; counters are decimal strings.
class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Waits (up to the client's timeout) until the key exists, then returns its value.
  virtual std::string get(const std::string& key) = 0;
  // Adds to a counter (absent: 0) and returns the new value; applied exactly once, also when a
  // store's server fails over mid-call.
  virtual std::int64_t add(const std::string& key, std::int64_t delta) = 0;
  virtual bool check(const std::vector<std::string>& keys) = 0;  // all present now?
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;  // TimeoutError naming the missing
  virtual bool remove(const std::string& key) = 0;  // true if it existed
  // The deadline of each later call (the constructor's timeout until then).
  virtual void set_timeout(std::chrono::milliseconds timeout) = 0;
  // Where it is, for messages ("store at 10.0.0.1:29500", "etcd at h1:2379,h2:2379").
  virtual std::string where() const = 0;
};

class TcpStoreClient final : public Store {
 public:
  // Connects and authenticates; TimeoutError / CommError naming host:port when that fails.
  TcpStoreClient(const std::string& host, std::uint16_t port, const std::string& token,
                 std::chrono::milliseconds timeout = std::chrono::minutes(10));
  ~TcpStoreClient();
  TcpStoreClient(const TcpStoreClient&) = delete;
  TcpStoreClient& operator=(const TcpStoreClient&) = delete;

  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key) override;
  std::int64_t add(const std::string& key, std::int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  bool remove(const std::string& key) override;
  void set_timeout(std::chrono::milliseconds timeout) override;
  std::string where() const override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// How a backend's rank finds its peers: its place in the world and the store the world meets at.
// Backend options (GlooOptions, ShmOptions) extend it.
struct StoreRendezvous {
  int rank = 0;
  int world_size = 1;
  // The TCP store at store_host:store_port, unless etcd_endpoints names an etcd cluster.
  std::string store_host = "127.0.0.1";
  std::uint16_t store_port = 0;
  std::vector<std::string> etcd_endpoints;  // "host:port" of each etcd member (its client URL)
  std::string etcd_user = "shardflow";      // EtcdOptions::user and ::root
  std::string etcd_root = "/shardflow/";
  std::string token;  // the TCP store's HELLO; etcd: the password of its user (EtcdOptions)
  std::string key_prefix;  // several communicators can share one store
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
};

// A client of the store `where` names: etcd's when it lists endpoints, else the TCP store's.
std::unique_ptr<Store> connect_store(const StoreRendezvous& where);

// Every key gets `prefix` in front: several jobs or phases share one server without clashing.
class PrefixStore {
 public:
  PrefixStore(Store& store, std::string prefix) : store_(store), prefix_(std::move(prefix)) {}
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
  Store& store_;
  std::string prefix_;
};

}  // namespace shardflow
