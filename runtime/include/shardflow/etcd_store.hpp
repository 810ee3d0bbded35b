// The job's store on etcd (v3 API, through its JSON gateway: etcd 3.4 as Debian packages it), so
// that no node of the job is special: the store outlives any one host (Note [A store no node
// owns]).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "shardflow/store.hpp"

namespace shardflow {

struct EtcdOptions {
  // Each member's client address, "host:port" (or "http://host:port"): a call goes to the first
  // that answers and moves on to the next when that one stops answering.
  std::vector<std::string> endpoints;
  // etcd's own authentication gates the job: the client logs in as `user` with the job's token as
  // its password (`etcdctl user add shardflow` with the token, a role with readwrite on `root`).
  // An empty password, or an etcd without authentication enabled, is refused: the token would then
  // gate nothing.
  std::string user = "shardflow";
  std::string password;
  std::string root = "/shardflow/";  // every key of the store lives under it
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
};

// Note [A store no node owns]
// The TCP store lives in one process (rank 0's or node 0's launcher): the job cannot outlive that
// host. etcd replicates every write on a quorum of its members, so a job whose store is an etcd
// cluster of three hosts loses nothing when one of them goes. What the Store interface asks for
// maps onto etcd v3 so:
// - set/get/check/remove are put, range and deleterange under `root`; get and wait of a key not
//   yet there watch it from the revision the range saw, so a waiting client costs etcd nothing
//   until the key is written (no polling; 1,000 waiting ranks are 1,000 idle watches).
// - add is a compare-and-swap transaction on the counter's mod_revision. A call whose connection
//   breaks after sending cannot know whether etcd applied it, so each add also writes its own key
//   (client id and sequence number, under a lease so they expire) in the same transaction; the
//   retry on the next member looks for that key first. Two transactions that read the same
//   revision cannot both commit, so an add is never lost nor doubled across a fail-over. add(k, 0)
//   only reads (a counter that does not exist reads 0 and is not made).
// - remove across a fail-over may report false for a key its first attempt deleted.
class EtcdStore final : public Store {
 public:
  // Logs in on the first member that answers; TimeoutError / CommError naming the endpoints when
  // none does within the timeout, UsageError when etcd refuses the user or password.
  explicit EtcdStore(EtcdOptions options);
  ~EtcdStore() override;
  EtcdStore(const EtcdStore&) = delete;
  EtcdStore& operator=(const EtcdStore&) = delete;

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

}  // namespace shardflow
