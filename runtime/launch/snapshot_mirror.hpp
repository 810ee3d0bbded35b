// The copy of a two-node job's snapshots on the other host.
//
// Note [Snapshots on the other host]
// A rank's snapshot in its own host's memory (Note [Snapshots in memory]) survives the rank, not
// the host. So across two nodes each launcher copies the shard files its ranks write into its
// memory to the other node's launcher, which keeps them in its own memory: after either host's
// loss the other holds every rank's files of the snapshot, and the job resumes from memory, at
// the same world after a rank's loss or at half of it after a node's (Note [Shrinking the world]).
// - Each launcher listens on its socket address and posts where in the store (launch/mirror/<node>);
//   a connection starts with the job's token, so nothing else writes into the memory.
// - The sender polls the memory every 20 ms for finished shard files (a file is renamed to its
//   name once written) without a "<file>.mirrored" marker, sends each with sendfile, and on the
//   other side's acknowledgement (the file renamed into place there) creates the marker. A copy
//   received is marked before it takes its name, so it is never sent back.
// - A rank counts its file written only once that marker exists (SHARDFLOW_SNAPSHOT_MIRROR is set
//   for it): the snapshot is complete, and its index written on both hosts, only when both hosts
//   hold every rank's files. A copy that does not arrive within the runtime's collective timeout
//   is given up with a warning: that snapshot is then whole on one host only, and the restart
//   takes an older one or the disk's.
// - Only with two nodes: a ring of more would leave each host with its own and its predecessor's
//   files, never a whole snapshot, so there the launchers offer no memory (snapshots on disk).
// The link is shared with training: the copy costs what it costs on the wire (bench/RESULTS.md).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace shardflow::launch {

class SnapshotMirror {
 public:
  // Serves `memory` (this launcher's SnapshotMemory directory) on `address`, port chosen by the
  // kernel; `say` reports trouble (a copy that failed, once per failure streak).
  SnapshotMirror(std::string memory, const std::string& address, std::string token, std::function<void(const std::string&)> say);
  ~SnapshotMirror();
  SnapshotMirror(const SnapshotMirror&) = delete;
  SnapshotMirror& operator=(const SnapshotMirror&) = delete;

  // "ip:port": what the other node connects to.
  std::string address() const;
  // Where this host's shard files go ("ip:port" of the other node's mirror; empty: nowhere, the
  // generation has one node). `label` names that node in messages. A new peer (a node that
  // rejoined, Note [Rejoining]) first gets the newest snapshot here whole: every file and its index.
  void send_to(const std::string& peer, const std::string& label);
  // Waits until that newest snapshot reached the new peer (true), or `limit` passed.
  bool wait_seeded(std::chrono::milliseconds limit);

 private:
  void serve();
  void receive(int fd);
  void send_loop();
  bool send_round();
  bool send_files(int fd, const std::vector<std::string>& rels, const std::string& label);
  std::vector<std::string> newest_snapshot() const;

  const std::string memory_, token_;
  const std::function<void(const std::string&)> say_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: the destructor wakes the threads
  std::uint16_t port_ = 0;
  std::string host_;
  std::atomic<bool> stopping_{false};

  std::mutex mu_;
  std::string peer_, peer_label_;
  int peer_fd_ = -1;                    // owned by the sender; others only shut it down
  std::string connected_to_;            // where peer_fd_ leads
  bool failing_ = false;                // a failure was reported; the next success says so
  bool seed_ = false;                   // the new peer still needs the newest snapshot whole
  std::condition_variable seeded_;
  std::vector<int> connections_;        // open receiving sockets (shut down by the destructor)
  std::vector<std::thread> receivers_;
  std::thread server_, sender_;
};

}  // namespace shardflow::launch
