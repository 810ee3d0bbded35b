// The rendezvous store: every operation, concurrent clients, waits that time out naming the missing
// keys, and hostile clients (wrong token, garbage, oversized and stalled frames) that are refused
// without taking the server down.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "helpers.hpp"
#include "shardflow/store.hpp"

using namespace shardflow;
using namespace std::chrono_literals;

namespace {

StoreServerOptions opts() {
  StoreServerOptions o;
  o.token = "job-42";
  o.stall_timeout = 300ms;
  return o;
}

// A raw TCP client for sending what a well-behaved client never would.
struct Raw {
  int fd = -1;
  explicit Raw(std::uint16_t port) {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  }
  ~Raw() { ::close(fd); }
  void send(const std::string& bytes) { REQUIRE(::write(fd, bytes.data(), bytes.size()) == ssize_t(bytes.size())); }
  // Everything the server sends until it closes the connection (or `limit` passes).
  std::string drain(std::chrono::milliseconds limit) {
    std::string out;
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < deadline) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      char buf[256];
      const ssize_t n = ::read(fd, buf, sizeof buf);
      if (n <= 0) return out + "<closed>";
      out.append(buf, std::size_t(n));
    }
    return out;
  }
};

std::string frame(const std::string& payload) {
  std::string f(4, '\0');
  const auto n = std::uint32_t(payload.size());
  std::memcpy(f.data(), &n, 4);
  return f + payload;
}

std::string hello(const std::string& token) {
  std::string p(1, '\x01');
  const auto n = std::uint32_t(token.size());
  p.append(reinterpret_cast<const char*>(&n), 4);
  return frame(p + token);
}

}  // namespace

TEST_CASE("set, get, add, check, delete and key prefixes") {
  TcpStoreServer server(opts());
  TcpStoreClient c("127.0.0.1", server.port(), "job-42", 5s);
  c.set("addr/0", "10.0.0.1:29500");
  CHECK(c.get("addr/0") == "10.0.0.1:29500");
  CHECK(c.add("count", 3) == 3);
  CHECK(c.add("count", -1) == 2);
  CHECK(c.get("count") == "2");
  CHECK(c.check({"addr/0", "count"}));
  CHECK_FALSE(c.check({"addr/0", "addr/1"}));
  CHECK(c.remove("addr/0"));
  CHECK_FALSE(c.remove("addr/0"));
  CHECK_FALSE(c.check({"addr/0"}));
  c.set("text", "not a number");
  CHECK_THROWS_WITH_AS(c.add("text", 1), doctest::Contains("does not hold a counter"), CommError);
  c.set("", std::string(100000, 'x'));  // empty key, big value
  CHECK(c.get("").size() == 100000);

  PrefixStore a(c, "job/a/"), b(c, "job/b/");
  a.set("rank", "0");
  b.set("rank", "1");
  CHECK(a.get("rank") == "0");
  CHECK(b.get("rank") == "1");
  CHECK(c.get("job/b/rank") == "1");
}

TEST_CASE("get waits for a key another client sets later; wait times out naming the missing keys") {
  TcpStoreServer server(opts());
  TcpStoreClient c("127.0.0.1", server.port(), "job-42", 5s);
  std::thread later([&] {
    std::this_thread::sleep_for(100ms);
    TcpStoreClient d("127.0.0.1", server.port(), "job-42", 5s);
    d.set("nccl_id", "abc");
  });
  CHECK(c.get("nccl_id") == "abc");
  later.join();
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(c.wait({"nccl_id", "rank/3"}, 200ms), doctest::Contains("timeout waiting for rank/3"), TimeoutError);
  const auto took = std::chrono::steady_clock::now() - t0;
  CHECK(took >= 190ms);
  CHECK(took < 3s);
  c.set("after", "1");  // the connection is still good after a timed-out wait
  CHECK(c.get("after") == "1");
}

TEST_CASE("concurrent clients: 8 threads x 50 increments of one counter") {
  TcpStoreServer server(opts());
  std::vector<std::thread> ts;
  for (int t = 0; t < 8; ++t)
    ts.emplace_back([&] {
      TcpStoreClient c("127.0.0.1", server.port(), "job-42", 10s);
      for (int i = 0; i < 50; ++i) c.add("barrier", 1);
    });
  for (auto& t : ts) t.join();
  TcpStoreClient c("127.0.0.1", server.port(), "job-42", 5s);
  CHECK(c.get("barrier") == "400");
}

TEST_CASE("a wrong token is refused; a server without a token refuses to start") {
  TcpStoreServer server(opts());
  CHECK_THROWS_WITH_AS(TcpStoreClient("127.0.0.1", server.port(), "guess", 2s), doctest::Contains("wrong token"), CommError);
  StoreServerOptions none;
  CHECK_THROWS_AS(TcpStoreServer{none}, UsageError);
  Raw raw(server.port());
  raw.send(frame(std::string("\x02", 1)));  // a request before HELLO
  CHECK(raw.drain(2s).find("first request must be HELLO") != std::string::npos);
}

TEST_CASE("malformed and oversized frames are refused and the server keeps serving") {
  auto o = opts();
  o.max_frame_bytes = 1024;
  TcpStoreServer server(o);
  {
    Raw big(server.port());
    big.send(hello("job-42"));
    big.send(std::string("\xff\xff\xff\x7f", 4));  // a 2 GiB frame
    const auto got = big.drain(2s);
    CHECK(got.find("refused (limit 1024)") != std::string::npos);
    CHECK(got.find("<closed>") != std::string::npos);
  }
  {
    Raw junk(server.port());
    junk.send(hello("job-42"));
    junk.send(frame(std::string("\x09garbage", 8)));  // unknown op
    CHECK(junk.drain(2s).find("unknown request 9") != std::string::npos);
  }
  {
    Raw cut(server.port());
    cut.send(hello("job-42"));
    cut.send(frame(std::string("\x02\x05\x00\x00\x00ab", 7)));  // a key shorter than its length says
    CHECK(cut.drain(2s).find("malformed request") != std::string::npos);
  }
  TcpStoreClient c("127.0.0.1", server.port(), "job-42", 5s);
  c.set("still", "serving");
  CHECK(c.get("still") == "serving");
}

TEST_CASE("a client that stalls inside a frame is disconnected; the others are not held up") {
  TcpStoreServer server(opts());  // stall timeout 300 ms
  Raw staller(server.port());
  staller.send(hello("job-42"));
  staller.send(std::string("\x40\x00\x00\x00", 4) + "partial");  // promises 64 bytes, sends 7
  TcpStoreClient c("127.0.0.1", server.port(), "job-42", 5s);
  c.set("k", "v");  // served while the staller hangs
  CHECK(c.get("k") == "v");
  const auto got = staller.drain(3s);
  CHECK(got.find("<closed>") != std::string::npos);
}

TEST_CASE("connecting where nothing listens times out with the address in the message") {
  std::uint16_t port;
  {
    TcpStoreServer gone(opts());
    port = gone.port();
  }
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(TcpStoreClient("127.0.0.1", port, "job-42", 300ms),
                       doctest::Contains(("127.0.0.1:" + std::to_string(port)).c_str()), TimeoutError);
  CHECK(std::chrono::steady_clock::now() - t0 < 3s);
}
