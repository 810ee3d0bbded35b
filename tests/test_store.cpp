// The rendezvous store: every operation, concurrent clients, waits that time out naming the missing
// keys, and hostile clients (wrong token, garbage, oversized and stalled frames) that are refused
// without taking the server down.
#include <doctest/doctest.h>

#include <cerrno>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#include "bench/proc_memory.hpp"
#include "runtime/bootstrap/store_protocol.hpp"
#include "support/helpers.hpp"
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

TEST_CASE("get waits for a key another client sets later — wait times out naming the missing keys") {
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

TEST_CASE("a wrong token is refused — a server without a token refuses to start") {
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
    // (The literal is split: "\x00ab" would be one hex escape swallowing the key.)
    cut.send(frame(std::string("\x02\x05\x00\x00\x00" "ab", 7)));  // a key shorter than its length says
    CHECK(cut.drain(2s).find("malformed request") != std::string::npos);
  }
  TcpStoreClient c("127.0.0.1", server.port(), "job-42", 5s);
  c.set("still", "serving");
  CHECK(c.get("still") == "serving");
}

TEST_CASE("a client that stalls inside a frame is disconnected — the others are not held up") {
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

TEST_CASE("the store's limits: keys, bytes and pre-token frames refused to that client only, with the limit named") {
  auto o = opts();
  o.max_keys = 3;
  o.max_bytes = 100;
  TcpStoreServer server(o);
  TcpStoreClient c("127.0.0.1", server.port(), "job-42", 5s);
  c.set("a", "1");
  c.set("b", "2");
  c.add("n", 1);
  CHECK_THROWS_WITH(c.set("d", "4"), doctest::Contains("holds 3 keys (limit 3)"));
  CHECK_THROWS_WITH(c.set("a", std::string(200, 'x')), doctest::Contains("limit 100"));
  c.set("a", "overwritten");  // replacing a key within the limits is fine, and the client still served
  CHECK(c.get("a") == "overwritten");
  CHECK(c.remove("b"));
  c.set("d", "4");  // a removed key frees its place
  CHECK_THROWS_WITH(c.add("n", std::numeric_limits<std::int64_t>::max()), doctest::Contains("overflows"));
  CHECK(c.add("n", 0) == 1);
  // A stranger's first frame must be a small HELLO: 64 KiB before the token is refused.
  Raw stranger(server.port());
  stranger.send(std::string("\x00\x00\x01\x00", 4));
  CHECK(stranger.drain(2s).find("before the token") != std::string::npos);
}

// Random and mutated frames from several connections at once (a bounded, seeded fuzz driver):
// the server must not crash or stop serving a well-behaved client, a stranger must not get past
// HELLO, and what the store holds stays within its limits. Run under `make sanitize` it is also
// a memory-safety check of the frame parser.
TEST_CASE("fuzz: 8 connections x 2,500 random and mutated frames — a well-behaved client is served throughout") {
  auto o = opts();
  o.max_keys = 500;
  o.max_bytes = 64 * 1024;
  o.max_frame_bytes = 4096;
  TcpStoreServer server(o);
  const double rss_before = bench::resident_mb("VmRSS:");
  bench::reset_peak();

  std::atomic<bool> stop{false};
  std::atomic<int> served{0};
  std::string good_error;
  // Its keys exist before the fuzz fills the store, and its values keep their size, so the limits
  // never apply to it.
  auto value = [](int i) {
    char v[16];
    std::snprintf(v, sizeof v, "%010d", i);
    return std::string(v);
  };
  TcpStoreClient first("127.0.0.1", server.port(), "job-42", 5s);
  for (int k = 0; k < 10; ++k) first.set("good/" + std::to_string(k), value(0));
  std::thread good([&] {
    try {
      TcpStoreClient c("127.0.0.1", server.port(), "job-42", 5s);
      for (int i = 0; !stop; ++i) {
        c.set("good/" + std::to_string(i % 10), value(i));
        if (c.get("good/" + std::to_string(i % 10)) != value(i)) throw std::runtime_error("wrong value read back");
        ++served;
      }
    } catch (const std::exception& e) {
      good_error = e.what();
    }
  });

  // Valid requests of every kind, as templates to mutate (the protocol's own encoder; a frame's
  // payload is what follows its 4-byte length).
  using store::Writer;
  auto payload_of = [](const Writer& w) { return w.frame().substr(4); };
  const std::vector<std::string> templates = {
      payload_of(Writer().u8(store::set).str("k").str("v")),
      payload_of(Writer().u8(store::get).str("k")),
      payload_of(Writer().u8(store::add).str("c").i64(1)),
      payload_of(Writer().u8(store::remove).str("k")),
      payload_of(Writer().u8(store::check).u32(2).str("a").str("b")),
      payload_of(Writer().u8(store::wait).u32(1).str("z").i64(10)),  // 10 ms
  };
  std::atomic<int> refused_strangers{0}, frames{0};
  std::vector<std::thread> fuzzers;
  for (int t = 0; t < 8; ++t)
    fuzzers.emplace_back([&, t] {
      std::mt19937 rng(1000 + unsigned(t));
      auto pick = [&](int n) { return int(rng() % unsigned(n)); };
      int fd = -1;
      bool authed = false;
      auto connect_now = [&] {
        if (fd >= 0) ::close(fd);
        fd = ::socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_port = htons(server.port());
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
        authed = false;
        // Half the connections show the token first; strangers fuzz the HELLO gate itself.
        if (pick(2) == 0) {
          const auto h = hello("job-42");
          ::send(fd, h.data(), h.size(), MSG_NOSIGNAL);
          authed = true;
        }
      };
      connect_now();
      for (int i = 0; i < 2500; ++i) {
        std::string payload;
        switch (pick(4)) {
          case 0:  // random bytes
            payload.resize(std::size_t(pick(48)));
            for (auto& ch : payload) ch = char(rng());
            break;
          case 1: {  // a template with bytes flipped
            payload = templates[std::size_t(pick(int(templates.size())))];
            for (int k = 0, n = 1 + pick(3); k < n; ++k) payload[std::size_t(pick(int(payload.size())))] ^= char(1 << pick(8));
            break;
          }
          case 2:  // a template cut short or run long
            payload = templates[std::size_t(pick(int(templates.size())))];
            payload = pick(2) ? payload.substr(0, std::size_t(pick(int(payload.size())))) : payload + std::string(std::size_t(1 + pick(8)), char(rng()));
            break;
          default:  // a valid request with a random key (fills the store toward its limits)
            payload = payload_of(Writer().u8(store::set).str("fuzz/" + std::to_string(t) + "/" + std::to_string(pick(2000)))
                                     .str(std::string(std::size_t(pick(300)), 'v')));
        }
        std::string bytes = frame(payload);
        if (pick(20) == 0) bytes = bytes.substr(0, std::size_t(pick(4)));  // a broken length prefix
        ++frames;
        if (::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) < 0) {
          if (!authed) ++refused_strangers;
          connect_now();
          continue;
        }
        // Drain replies without waiting; a closed connection is replaced.
        char buf[512];
        const ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        if (n == 0) {
          if (!authed) ++refused_strangers;
          connect_now();
        }
      }
      ::close(fd);
    });
  for (auto& f : fuzzers) f.join();
  stop = true;
  good.join();
  INFO("the well-behaved client: " << good_error);
  CHECK(good_error.empty());
  CHECK(served > 0);
  CHECK(frames == 8 * 2500);
  // Strangers are turned away at the gate. The fuzzers count the closes they happen to see before
  // their next send, which a loaded machine may deliver too late for any of them (a clean clone's
  // make test, 2026-11-29): so one stranger more asks once and waits for the close.
  MESSAGE("closes the fuzzing strangers saw: " << refused_strangers.load());
  {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(server.port());
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    timeval tv{5, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    const auto request = frame(templates[1]);  // a get, without the token first
    ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
    char buf[512];
    ssize_t n = 0;
    while ((n = ::recv(fd, buf, sizeof buf, 0)) > 0) {
    }
    const bool closed = n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK);
    CHECK(closed);  // not left waiting: the gate closed the stranger's connection
    ::close(fd);
  }
  // The store kept its limits: a value that would pass 64 KiB in all is refused, and a client
  // still gets served.
  TcpStoreClient after("127.0.0.1", server.port(), "job-42", 5s);
  std::string refusal;
  for (int k = 0; k < 30 && refusal.empty(); ++k) {  // 3 KB values until the 64 KiB in all is reached
    try {
      after.set("big/" + std::to_string(k), std::string(3000, 'x'));
    } catch (const Error& e) {
      refusal = e.what();
    }
  }
  CHECK(refusal.find("(limit 65536)") != std::string::npos);
  // At the limit what is left is whatever the fuzz's random fill left below it (8 bytes in one
  // clean clone's run of 2026-12-04, and "still" + "serving" takes 12): a removed key (16 bytes,
  // one of the 500 keys) makes the room, as it would for any client of a full store.
  CHECK(after.remove("good/0"));
  after.set("still", "serving");
  CHECK(after.get("still") == "serving");
  MESSAGE("fuzz: " << frames.load() << " frames, well-behaved client served " << served.load()
                   << " set+get pairs meanwhile; this process (server and all clients) resident " << rss_before << " MB before, peak "
                   << bench::resident_mb("VmHWM:") << " MB");
}
