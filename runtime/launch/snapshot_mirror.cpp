#include "runtime/launch/snapshot_mirror.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "runtime/bootstrap/snapshot_env.hpp"
#include "shardflow/errors.hpp"

namespace shardflow::launch {
namespace {

namespace fs = std::filesystem;
constexpr std::uint32_t kMagic = 0x524d4653;  // "SFMR"
constexpr std::uint64_t kMaxFile = std::uint64_t(1) << 40;
constexpr std::uint64_t kGet = ~std::uint64_t(0);  // in place of a size: "send me this file"
constexpr std::uint32_t kMaxString = 4096;
constexpr int kIoSeconds = 60;  // a send or an acknowledgement that takes longer: the other side is gone

bool send_all(int fd, const void* p, std::size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = ::send(fd, c, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    c += w;
    n -= std::size_t(w);
  }
  return true;
}

// A file's `size` bytes from `in` onto the socket, without copying them through user space.
// In pieces of kPiece, so that a file removed while it is on its way stops within one piece's time
// on the link (32 ms at 1 Gbit/s): `removed` then, and false (Note [Snapshots of a timeline left
// behind], runtime/checkpoint/snapshots.cpp).
constexpr std::uint64_t kPiece = std::uint64_t(4) << 20;
bool send_body(int fd, int in, std::uint64_t size, bool& removed) {
  for (off_t at = 0; std::uint64_t(at) < size;) {
    struct stat st {};
    if (::fstat(in, &st) == 0 && st.st_nlink == 0) {
      removed = true;
      return false;
    }
    const ssize_t n = ::sendfile(fd, in, &at, std::size_t(std::min(kPiece, size - std::uint64_t(at))));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
  }
  return true;
}

bool recv_all(int fd, void* p, std::size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t r = ::recv(fd, c, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    c += r;
    n -= std::size_t(r);
  }
  return true;
}

bool send_string(int fd, const std::string& s) {
  const auto n = std::uint32_t(s.size());
  return send_all(fd, &n, 4) && send_all(fd, s.data(), s.size());
}

bool recv_string(int fd, std::string& s) {
  std::uint32_t n = 0;
  if (!recv_all(fd, &n, 4) || n > kMaxString) return false;
  s.resize(n);
  return recv_all(fd, s.data(), n);
}

bool write_file_all(int fd, const char* p, std::size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= std::size_t(w);
  }
  return true;
}

// "step-<digits>/<a shard file>": nothing else is written, so no name leaves the memory.
bool valid_path(const std::string& rel) {
  const auto slash = rel.find('/');
  if (slash == std::string::npos) return false;
  const std::string_view dir(rel.data(), slash);
  if (dir.size() <= 5 || dir.substr(0, 5) != "step-") return false;
  if (!std::all_of(dir.begin() + 5, dir.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); })) return false;
  const auto name = std::string_view(rel).substr(slash + 1);
  return snapshot_env::is_shard_file(name) || name == "index.json";  // the index only when seeding a node that rejoined
}

std::uint64_t step_of(const std::string& rel) {
  std::uint64_t step = 0;
  std::from_chars(rel.data() + 5, rel.data() + rel.size(), step);
  return step;
}

void set_io_timeouts(int fd) {
  timeval tv{kIoSeconds, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

sockaddr_in ipv4(const std::string& host, std::uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  if (::inet_pton(AF_INET, host.c_str(), &a.sin_addr) != 1) throw Error("snapshot copies: '" + host + "' is no IPv4 address");
  return a;
}

// A connect that gives up after 2 s or when `wake` is signalled: a host that is gone answers no
// SYN, and a blocking connect would hold the launcher's end for minutes.
bool connect_within(int fd, const sockaddr_in& a, int wake) {
  const int flags = ::fcntl(fd, F_GETFL);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  int r = ::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a);
  if (r != 0 && errno == EINPROGRESS) {
    pollfd p[2] = {{fd, POLLOUT, 0}, {wake, POLLIN, 0}};
    if (::poll(p, 2, 2000) > 0 && p[0].revents) {
      int err = 0;
      socklen_t len = sizeof err;
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      r = err ? -1 : 0;
      errno = err;
    } else {
      errno = ETIMEDOUT;
    }
  }
  ::fcntl(fd, F_SETFL, flags);
  return r == 0;
}

}  // namespace

SnapshotMirror::SnapshotMirror(std::string memory, const std::string& address, std::string token,
                               std::function<void(const std::string&)> say)
    : memory_(std::move(memory)), token_(std::move(token)), say_(std::move(say)), host_(address) {
  listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listen_fd_ < 0) throw Error("snapshot copies: socket: " + std::string(std::strerror(errno)));
  const sockaddr_in a = ipv4(address, 0);
  socklen_t len = sizeof a;
  sockaddr_in bound{};
  if (::bind(listen_fd_, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0 || ::listen(listen_fd_, 8) != 0 ||
      ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
    const int err = errno;
    ::close(listen_fd_);
    throw Error("snapshot copies: cannot listen on " + address + ": " + std::strerror(err));
  }
  port_ = ntohs(bound.sin_port);
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  server_ = std::thread([this] { serve(); });
  sender_ = std::thread([this] { send_loop(); });
}

SnapshotMirror::~SnapshotMirror() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    for (int fd : connections_) ::shutdown(fd, SHUT_RDWR);
    if (peer_fd_ >= 0) ::shutdown(peer_fd_, SHUT_RDWR);
  }
  const std::uint64_t one = 1;
  [[maybe_unused]] auto w = ::write(wake_fd_, &one, sizeof one);
  server_.join();
  sender_.join();
  for (auto& t : receivers_) t.join();  // the server, the only one to add to them, is done
  if (peer_fd_ >= 0) ::close(peer_fd_);
  ::close(listen_fd_);
  ::close(wake_fd_);
}

std::string SnapshotMirror::address() const { return host_ + ":" + std::to_string(port_); }

void SnapshotMirror::send_to(const std::string& peer, const std::string& label, Seed seed) {
  std::lock_guard lock(mu_);
  seed_ = peer.empty() ? Seed::none : seed;
  if (seed_ != Seed::index) skip_through_ = 0;
  if (peer == peer_) return;
  peer_ = peer;
  peer_label_ = label;
  if (peer_fd_ >= 0) ::shutdown(peer_fd_, SHUT_RDWR);  // the sender closes it and connects anew
}

bool SnapshotMirror::wait_seeded(std::chrono::milliseconds limit) {
  std::unique_lock lock(mu_);
  return seeded_.wait_for(lock, limit, [&] { return seed_ == Seed::none || stopping_; });
}

// "step-N" of the newest snapshot here that has its index; empty when none has.
std::string SnapshotMirror::newest_indexed() const {
  std::uint64_t newest = 0;
  std::string dir;
  std::error_code ec;
  for (const auto& step : fs::directory_iterator(memory_, ec)) {
    const auto name = step.path().filename().string();
    std::error_code ec2;
    if (!valid_path(name + "/index.json") || !fs::exists(step.path() / "index.json", ec2)) continue;
    if (const auto n = step_of(name + "/"); n >= newest) newest = n, dir = name;
  }
  return dir;
}

// Every file of the newest snapshot here that has its index ("step-N/..."), the index last.
std::vector<std::string> SnapshotMirror::newest_snapshot() const {
  const std::string dir = newest_indexed();
  std::error_code ec;
  std::vector<std::string> rels;
  if (dir.empty()) return rels;
  for (const auto& f : fs::directory_iterator(memory_ + "/" + dir, ec)) {
    const std::string rel = dir + "/" + f.path().filename().string();
    if (valid_path(rel) && f.path().filename() != "index.json") rels.push_back(rel);
  }
  rels.push_back(dir + "/index.json");
  return rels;
}

void SnapshotMirror::serve() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0 && errno != EINTR) return;
    if (stopping_ || fds[1].revents) return;
    if (!fds[0].revents) continue;
    const int c = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) continue;
    std::lock_guard lock(mu_);
    if (stopping_) {
      ::close(c);
      return;
    }
    connections_.push_back(c);
    receivers_.emplace_back([this, c] { receive(c); });
  }
}

void SnapshotMirror::receive(int fd) {
  std::uint32_t magic = 0;
  std::string token;
  bool ok = recv_all(fd, &magic, 4) && magic == kMagic && recv_string(fd, token) && token == token_;
  while (ok) {
    std::string rel;
    std::uint64_t size = 0;
    if (!recv_string(fd, rel) || !recv_all(fd, &size, 8)) break;
    if (!valid_path(rel) || (size > kMaxFile && size != kGet)) {
      say_("snapshot copies: refused '" + rel + "' from another node (not a file of a snapshot)");
      break;
    }
    if (size == kGet) {  // another node assembles a snapshot (assemble): this host's file, or its absence
      ok = serve_file(fd, rel);
      continue;
    }
    const bool good = keep_file(fd, rel, size, ok);
    const char ack = good ? 'k' : 'e';
    if (ok && !send_all(fd, &ack, 1)) break;
  }
  std::lock_guard lock(mu_);
  connections_.erase(std::find(connections_.begin(), connections_.end(), fd));
  ::close(fd);
}

// Reads `size` bytes of `rel` off `fd` into the memory: written as "<file>.part", marked when a
// shard file (the original is elsewhere: never sent on), then renamed into place. `ok` turns false
// when the connection failed; returns whether the file was kept.
bool SnapshotMirror::keep_file(int fd, const std::string& rel, std::uint64_t size, bool& ok) {
  const fs::path to = fs::path(memory_) / rel;
  std::error_code ec;
  fs::create_directories(to.parent_path(), ec);
  const std::string part = to.string() + ".part";
  const int out = ::open(part.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  bool good = out >= 0;
  std::vector<char> buf(std::size_t(1) << 20);
  for (std::uint64_t left = size; left > 0 && ok;) {
    const std::size_t n = std::size_t(std::min<std::uint64_t>(left, buf.size()));
    ok = recv_all(fd, buf.data(), n);
    if (ok && good) good = write_file_all(out, buf.data(), n);
    left -= n;
  }
  if (out >= 0) ::close(out);
  if (!ok) {
    ::unlink(part.c_str());
    return false;
  }
  // Marked before it has its name: the sender here must never see it unmarked and send it on.
  const std::string marker = to.string() + std::string(snapshot_env::kMirroredSuffix);
  if (good && snapshot_env::is_shard_file(to.filename().string())) {
    const int m = ::open(marker.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    good = m >= 0;
    if (good) ::close(m);
  }
  if (good && ::rename(part.c_str(), to.c_str()) != 0) {
    good = false;
    ::unlink(marker.c_str());
  }
  if (!good) {
    ::unlink(part.c_str());
    say_("snapshot copies: cannot keep '" + to.string() + "' from another node: " + std::strerror(errno));
  }
  return good;
}

// Answers a request for `rel`: its size and bytes, or kGet when this host does not hold it.
bool SnapshotMirror::serve_file(int fd, const std::string& rel) {
  const std::string path = (fs::path(memory_) / rel).string();
  const int in = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (in < 0) return send_all(fd, &kGet, 8);
  struct stat st {};
  ::fstat(in, &st);
  const auto size = std::uint64_t(st.st_size);
  bool removed = false;
  const bool sent = send_all(fd, &size, 8) && send_body(fd, in, size, removed);
  ::close(in);
  return sent;
}

bool SnapshotMirror::assemble(const std::vector<std::string>& peers) {
  // The newest snapshot here with its index: the one the ranks will ask for.
  const std::string dir = newest_indexed();
  std::error_code ec;
  if (dir.empty()) return true;
  std::vector<std::string> missing;
  try {
    std::ifstream in(memory_ + "/" + dir + "/index.json");
    const auto index = nlohmann::json::parse(in);  // named: a range-for over parse(in).at(...) would dangle
    for (const auto& f : index.at("files"))
      if (const auto name = f.get<std::string>(); !name.empty() && !fs::exists(memory_ + "/" + dir + "/" + name, ec))
        missing.push_back(dir + "/" + name);
  } catch (const std::exception& e) {
    say_("snapshot copies: '" + memory_ + "/" + dir + "/index.json' cannot be read (" + e.what() + ")");
    return false;
  }
  for (const auto& rel : missing) {
    bool got = false;
    for (const auto& peer : peers) {
      if (stopping_) return false;
      std::string why;
      const int fd = connect_to(peer, why);
      if (fd < 0) continue;
      std::uint64_t size = kGet;
      bool ok = send_string(fd, rel) && send_all(fd, &kGet, 8) && recv_all(fd, &size, 8);
      if (ok && size != kGet && size <= kMaxFile) got = keep_file(fd, rel, size, ok);
      ::close(fd);
      if (got) break;
    }
    if (!got) {
      say_("snapshot copies: no node holds '" + rel + "': this host's ranks resume from an older snapshot or the disk's");
      return false;
    }
  }
  return true;
}

void SnapshotMirror::send_loop() {
  while (!stopping_) {
    if (send_round()) continue;
    pollfd p{wake_fd_, POLLIN, 0};
    ::poll(&p, 1, 20);
  }
}

// Sends every finished shard file here without its marker: neither sent yet nor a copy received.
// False when there was nothing to do (or it failed: the next round retries).
bool SnapshotMirror::send_round() {
  std::string peer, label;
  bool seeding;
  {
    std::lock_guard lock(mu_);
    peer = peer_;
    label = peer_label_;
    seeding = seed_ != Seed::none;
  }
  std::vector<std::string> todo;
  std::error_code ec;
  if (seeding) {
    todo = newest_snapshot();
    std::lock_guard lock(mu_);
    if (seed_ == Seed::index && !todo.empty()) {  // the index last: only it
      skip_through_ = step_of(todo.back());
      todo.erase(todo.begin(), todo.end() - 1);
    }
  }
  if (seeding && todo.empty()) {  // nothing to give the new peer
    std::lock_guard lock(mu_);
    seed_ = Seed::none;
    seeded_.notify_all();
  }
  // Note [No copies behind the newest complete snapshot]: a file of an older snapshot without its
  // marker is one a prune is removing (its marker went first: remove_all's order) or one of a
  // snapshot that never completed; its copy would be of no use, and the other host, pruning too,
  // failed to keep it ("cannot keep ... No such file or directory", then "failed; retrying", in
  // a job where nothing had failed). The older complete snapshots that a prune keeps have every
  // file copied already (a snapshot completes only then).
  if (!peer.empty() && !seeding) {
    std::uint64_t complete = 0;  // the newest snapshot here with its index, seen in the same pass
    for (const auto& step : fs::directory_iterator(memory_, ec)) {
      const auto dir = step.path().filename().string();
      if (dir.rfind("step-", 0) != 0) continue;
      const std::uint64_t n = step_of(dir + "/");
      std::error_code ec2;
      if (fs::exists(step.path() / "index.json", ec2)) complete = std::max(complete, n);
      if (std::lock_guard lock(mu_); skip_through_ && n <= skip_through_) continue;
      for (const auto& f : fs::directory_iterator(step.path(), ec2)) {
        const std::string rel = dir + "/" + f.path().filename().string();
        if (valid_path(rel) && snapshot_env::is_shard_file(f.path().filename().string()) &&
            !fs::exists(f.path().string() + std::string(snapshot_env::kMirroredSuffix), ec2))
          todo.push_back(rel);
      }
    }
    std::erase_if(todo, [&](const std::string& rel) { return step_of(rel) < complete; });
  }
  if (todo.empty()) return false;
  if (!seeding)
    std::stable_sort(todo.begin(), todo.end(), [](const std::string& a, const std::string& b) { return step_of(a) < step_of(b); });

  int fd;
  {
    std::lock_guard lock(mu_);
    if (peer_ != peer) return true;  // changed meanwhile: look again
    if (peer_fd_ >= 0 && connected_to_ != peer) drop_connection();
    fd = peer_fd_;
  }
  std::string why;
  if (fd < 0) {
    fd = connect_to(peer, why);
    std::lock_guard lock(mu_);
    if (fd >= 0 && stopping_) {
      ::close(fd);
      return false;
    }
    peer_fd_ = fd;  // from here the destructor can shut it down
    connected_to_ = peer;
  }
  bool removed = false;
  if (fd >= 0 && send_files(fd, todo, label, why, removed)) {
    std::lock_guard lock(mu_);
    if (seeding && peer_ == peer) {
      seed_ = Seed::none;
      seeded_.notify_all();
    }
    if (failing_) say_("snapshot copies to " + label + " go through again");
    failing_ = false;
    return true;
  }
  {
    std::lock_guard lock(mu_);
    drop_connection();
    if (removed) return true;  // nothing failed: a file of a timeline left behind; the rest at once
    if (!failing_ && !stopping_) say_("snapshot copies to " + label + " failed (" + why + "); retrying");
    failing_ = true;
  }
  pollfd p{wake_fd_, POLLIN, 0};
  ::poll(&p, 1, 200);  // a peer that is not there yet (or gone): not every 20 ms
  return false;
}

// "ip:port" connected and greeted with the job's token, or -1 with `why`. The wait for the
// connection ends early when the mirror is being destroyed.
int SnapshotMirror::connect_to(const std::string& peer, std::string& why) {
  const auto colon = peer.rfind(':');
  const sockaddr_in a = ipv4(peer.substr(0, colon), std::uint16_t(std::stoi(peer.substr(colon + 1))));
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  set_io_timeouts(fd);
  if (!connect_within(fd, a, wake_fd_)) {
    why = "connecting to " + peer + ": " + std::strerror(errno);
  } else if (!send_all(fd, &kMagic, 4) || !send_string(fd, token_)) {
    why = "greeting " + peer;
  } else {
    return fd;
  }
  ::close(fd);
  return -1;
}

// Under mu_: the sender's connection goes (the next round connects anew).
void SnapshotMirror::drop_connection() {
  if (peer_fd_ >= 0) ::close(peer_fd_);
  peer_fd_ = -1;
}

// Sends each file, waits for its acknowledgement and marks a shard file as copied. False, with
// `why`, when one did not get through.
bool SnapshotMirror::send_files(int fd, const std::vector<std::string>& rels, const std::string& label, std::string& why, bool& removed) {
  auto fail = [&](const std::string& what) {
    why = what;
    return false;
  };
  for (const auto& rel : rels) {
    const std::string path = (fs::path(memory_) / rel).string();
    const int in = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (in < 0) continue;  // removed meanwhile (an older snapshot pruned)
    struct stat st {};
    ::fstat(in, &st);
    const auto size = std::uint64_t(st.st_size);
    const bool sent = send_string(fd, rel) && send_all(fd, &size, 8) && send_body(fd, in, size, removed);
    ::close(in);
    // Removed on its way: the receiver cannot tell, so the connection goes (it drops the part it
    // has), and the next round goes on with what is left, quietly.
    if (removed) return fail(rel + " removed while on its way");
    char ack = 0;
    if (!sent || !recv_all(fd, &ack, 1)) return fail("sending " + rel);
    if (ack != 'k') return fail(label + " could not keep " + rel);
    if (snapshot_env::is_shard_file(fs::path(rel).filename().string())) {
      const int marker = ::open((path + std::string(snapshot_env::kMirroredSuffix)).c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
      if (marker >= 0) ::close(marker);
    }
  }
  return true;
}

}  // namespace shardflow::launch
