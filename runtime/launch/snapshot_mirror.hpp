// The copies of a job's snapshots on another host.
//
// Note [Snapshots on the other host]
// A rank's snapshot in its own host's memory (Note [Snapshots in memory]) survives the rank, not
// the host. So across nodes each launcher copies the shard files its ranks write into its memory
// to the next node of the ring (the generation's nodes in order, the last to the first), whose
// launcher keeps them in its own memory: after any one host's loss every rank's file is still on
// some host, and the job resumes from memory, at the same world after a rank's loss or at a
// smaller one after a node's (Note [Shrinking the world]).
// - Each launcher listens on its socket address and posts where in the store (launch/mirror/<node>);
//   a connection starts with the job's token, and only names of a snapshot's files are kept, so
//   nothing else writes into the memory or outside it.
// - The sender polls the memory every 20 ms for finished shard files (a file is renamed to its
//   name once written) without a "<file>.mirrored" marker, sends each with sendfile, and on the
//   other side's acknowledgement (the file renamed into place there) creates the marker. A copy
//   received is marked before it takes its name, so it is never sent on.
// - A rank counts its file written only once that marker exists (SHARDFLOW_SNAPSHOT_MIRROR names
//   the next node to it): the snapshot is complete, and its index written on every host, only
//   when each file is on two hosts. A copy that does not arrive within the runtime's collective
//   timeout is given up with a warning: that snapshot then lacks a second copy of that file.
// - With two nodes each host then holds every file. With more, a host holds its own and its
//   predecessor's: before a restart's ranks start, each launcher fetches what its host lacks of
//   its newest snapshot from the others (assemble), so that the ranks load it from memory.
// - A node that rejoins (Note [Rejoining]) first gets its predecessor's newest snapshot whole.
// - Nothing older than the newest complete snapshot here is sent (Note [No copies behind the newest
//   complete snapshot]), and a file removed while on its way stops there (Note [Snapshots of a
//   timeline left behind], runtime/checkpoint/snapshots.cpp).
// The link is shared with training: the copy costs what its bytes cost on the wire
// (bench/RESULTS.md).
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
  // What a new peer gets first. whole (a node that rejoined, Note [Rejoining]): the newest snapshot
  // here, every file and its index. index (a node taken in live whose ranks get their state from
  // the running ranks' memory, Note [A join from memory]): that snapshot's index only, and none of
  // the files here then is sent to it (a later round fetches them where it needs them: assemble).
  enum class Seed { none, whole, index };
  // Where this host's shard files go ("ip:port" of the next node's mirror; empty: nowhere, the
  // generation has one node). `label` names that node in messages.
  void send_to(const std::string& peer, const std::string& label, Seed seed);
  // Waits until that newest snapshot reached the new peer (true), or `limit` passed.
  bool wait_seeded(std::chrono::milliseconds limit);
  // Before a restart's ranks start: fetches from `peers` (their mirrors' addresses) every file of
  // the newest snapshot here that this host lacks, so that it holds it whole (with more than two
  // nodes it holds only its own and its predecessor's). False (said) when some file is on no peer.
  bool assemble(const std::vector<std::string>& peers);

 private:
  void serve();
  void receive(int fd);
  bool keep_file(int fd, const std::string& rel, std::uint64_t size, bool& ok);
  bool serve_file(int fd, const std::string& rel);
  void send_loop();
  bool send_round();
  // `removed`: a file was removed while on its way (Note [Snapshots of a timeline left behind]).
  bool send_files(int fd, const std::vector<std::string>& rels, const std::string& label, std::string& why, bool& removed);
  int connect_to(const std::string& peer, std::string& why);
  void drop_connection();
  std::vector<std::string> newest_snapshot() const;
  std::string newest_indexed() const;

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
  Seed seed_ = Seed::none;              // what the new peer still needs of the newest snapshot
  std::uint64_t skip_through_ = 0;      // files of snapshots up to this step are not sent to this peer (Seed::index)
  std::condition_variable seeded_;
  std::vector<int> connections_;        // open receiving sockets (shut down by the destructor)
  std::vector<std::thread> receivers_;
  std::thread server_, sender_;
};

}  // namespace shardflow::launch
