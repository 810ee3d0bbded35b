// The job's store on a real etcd (Debian's etcd-server 3.4, started by each scenario on loopback
// ports with authentication on): what the TCP store does, through etcd; waiting clients that etcd
// answers by watch; counters that neither lose nor double an add, also while a member dies; the
// token gating every client; and ranks that rendezvous on etcd with no rank serving a store.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <thread>

#include "support/etcd_cluster.hpp"
#include "support/helpers.hpp"
#include "shardflow/etcd_store.hpp"
#include "shardflow/gloo.hpp"
#include "shardflow/launch.hpp"
#include "shardflow/shm.hpp"

using namespace shardflow;
using namespace std::chrono_literals;

namespace {

const std::string kToken = "job-token-7f3a";

EtcdOptions options(const test::EtcdCluster& etcd, std::chrono::milliseconds timeout = 10s) {
  EtcdOptions o;
  o.endpoints = etcd.endpoints();
  o.password = kToken;
  o.root = "/shardflow/test-job/";
  o.timeout = timeout;
  return o;
}

// What `fn` threw, if it threw an E; "" if it returned (another exception fails the scenario).
template <class E, class Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

// A member whose host is cut off drops the packets: a connect to it never completes. A listener
// whose accept queue is full does the same here (Linux drops the SYNs it has no room for).
struct SilentMember {
  int listener = -1;
  std::vector<int> queued;  // never accepted: they fill the queue
  std::string endpoint;
  SilentMember() {
    listener = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    REQUIRE(::bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(::listen(listener, 0) == 0);
    REQUIRE(::getsockname(listener, reinterpret_cast<sockaddr*>(&a), &len) == 0);
    for (int k = 0; k < 3; ++k) {
      queued.push_back(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0));
      ::connect(queued.back(), reinterpret_cast<sockaddr*>(&a), sizeof a);
    }
    std::this_thread::sleep_for(100ms);
    endpoint = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  }
  ~SilentMember() {
    for (int fd : queued) ::close(fd);
    ::close(listener);
  }
};

// Seconds `fn` took.
template <class Fn>
double timed(Fn fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

#define SKIP_WITHOUT_ETCD()                                                        \
  if (!test::etcd_installed()) {                                                   \
    MESSAGE("etcd-server / etcd-client are not installed (make deps): skipped");   \
    return;                                                                        \
  }

}  // namespace

TEST_CASE("etcd store: set, get, add, check, delete under the job's root, and key prefixes") {
  SKIP_WITHOUT_ETCD();
  test::EtcdCluster etcd(1, kToken);
  EtcdStore a(options(etcd)), b(options(etcd));
  a.set("addr/0", std::string("10.0.0.1:4000\0binary", 20));
  CHECK(b.get("addr/0") == std::string("10.0.0.1:4000\0binary", 20));
  CHECK(a.add("count", 3) == 3);
  CHECK(b.add("count", -1) == 2);
  CHECK(b.check({"addr/0", "count"}));
  CHECK_FALSE(b.check({"addr/0", "nobody"}));
  CHECK(a.remove("addr/0"));
  CHECK_FALSE(a.remove("addr/0"));
  CHECK_FALSE(b.check({"addr/0"}));
  PrefixStore p(a, "g1/pg0/");
  p.set("k", "v");
  CHECK(b.get("g1/pg0/k") == "v");
  CHECK(a.where() == "etcd at " + etcd.endpoints()[0]);
  // Another job's root does not see this one's keys.
  auto other = options(etcd);
  other.root = "/shardflow/other-job/";
  EtcdStore c(other);
  CHECK_FALSE(c.check({"count"}));
}

TEST_CASE("etcd store: get waits for a key another client sets later — wait times out naming every missing key") {
  SKIP_WITHOUT_ETCD();
  test::EtcdCluster etcd(1, kToken);
  EtcdStore a(options(etcd)), b(options(etcd));
  std::thread later([&] {
    std::this_thread::sleep_for(300ms);
    a.set("late", "here");
  });
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(b.get("late") == "here");
  CHECK(std::chrono::steady_clock::now() - t0 >= 250ms);
  later.join();
  a.set("present", "1");
  const auto t1 = std::chrono::steady_clock::now();
  const auto missing = error_of<TimeoutError>([&] { b.wait({"present", "gone/1", "gone/2"}, 400ms); });
  CHECK(std::chrono::steady_clock::now() - t1 < 3s);
  CAPTURE(missing);
  CHECK(missing.find("'gone/1', 'gone/2'") != std::string::npos);
  CHECK(missing.find("'present'") == std::string::npos);
  b.set_timeout(300ms);
  CHECK_THROWS_AS(b.get("never"), TimeoutError);
}

TEST_CASE("etcd store: 8 clients x 40 adds of one counter end at 320, none lost or doubled") {
  SKIP_WITHOUT_ETCD();
  test::EtcdCluster etcd(1, kToken);
  std::vector<std::vector<std::int64_t>> seen(8);
  test::require_all_ok(test::run_ranks(8, [&](int c) {
    EtcdStore s(options(etcd));
    for (int i = 0; i < 40; ++i) seen[std::size_t(c)].push_back(s.add("counter", 1));
  }));
  EtcdStore s(options(etcd));
  CHECK(s.add("counter", 0) == 320);
  // Every value 1..320 was returned to exactly one add.
  std::vector<int> hits(321, 0);
  for (const auto& v : seen)
    for (const auto x : v) ++hits[std::size_t(x)];
  for (int x = 1; x <= 320; ++x) CHECK_MESSAGE(hits[std::size_t(x)] == 1, "value " << x);
}

TEST_CASE("etcd store: the token gates every client — an etcd without authentication, or none answering, is refused by name") {
  SKIP_WITHOUT_ETCD();
  {
    test::EtcdCluster etcd(1, kToken);
    auto wrong = options(etcd);
    wrong.password = "not-the-token";
    const auto e = error_of<UsageError>([&] { EtcdStore s(wrong); });
    CHECK(e.find("refused user 'shardflow'") != std::string::npos);
    auto elsewhere = options(etcd);
    elsewhere.root = "/not-shardflow/";
    EtcdStore s(elsewhere);  // logs in; the role does not cover that root
    const auto denied = error_of<UsageError>([&] { s.set("k", "v"); });
    CHECK(denied.find("may not write under '/not-shardflow/'") != std::string::npos);
    auto empty = options(etcd);
    empty.password.clear();
    CHECK_THROWS_AS(EtcdStore{empty}, UsageError);
  }
  {
    test::EtcdCluster open(1, kToken, /*auth=*/false);
    const auto e = error_of<UsageError>([&] { EtcdStore s(options(open)); });
    CHECK(e.find("authentication is not enabled") != std::string::npos);
  }
  EtcdOptions nobody;
  nobody.endpoints = {"127.0.0.1:" + std::to_string(test::free_port())};
  nobody.password = kToken;
  nobody.timeout = 500ms;
  const auto t0 = std::chrono::steady_clock::now();
  const auto e = error_of<TimeoutError>([&] { EtcdStore s(nobody); });
  CHECK(std::chrono::steady_clock::now() - t0 < 3s);
  CHECK(e.find(nobody.endpoints[0]) != std::string::npos);
}

TEST_CASE("three etcd members, one killed mid-run: the clients go on through the others and 4 x 60 adds end at exactly 240") {
  SKIP_WITHOUT_ETCD();
  test::EtcdCluster etcd(3, kToken);
  {
    EtcdStore s(options(etcd));
    s.set("before", "1");
  }
  std::atomic<int> done{0};
  std::vector<std::vector<std::int64_t>> seen(4);
  std::thread killer([&] {
    while (done < 4) std::this_thread::sleep_for(5ms);
    etcd.kill(0);  // the member every client talks to first
  });
  const auto errors = test::run_ranks(4, [&](int c) {
    EtcdStore s(options(etcd, 20s));
    for (int i = 0; i < 60; ++i) {
      seen[std::size_t(c)].push_back(s.add("counter", 1));
      if (i == 10) ++done;
    }
  });
  killer.join();
  test::require_all_ok(errors);
  EtcdStore s(options(etcd));
  CHECK(s.get("before") == "1");
  CHECK(s.add("counter", 0) == 240);
  std::vector<int> hits(241, 0);
  for (const auto& v : seen)
    for (const auto x : v) ++hits[std::size_t(x)];
  for (int x = 1; x <= 240; ++x) CHECK_MESSAGE(hits[std::size_t(x)] == 1, "value " << x);
}

TEST_CASE("three etcd members, the one in use hung (SIGSTOP): a set and a get go through another member within the 5 s a request "
          "may take, plus an election") {
  SKIP_WITHOUT_ETCD();
  test::EtcdCluster etcd(3, kToken);
  EtcdStore s(options(etcd, 30s));
  s.set("before", "1");
  etcd.stop(0);
  const auto t0 = std::chrono::steady_clock::now();
  s.set("after", "2");
  CHECK(s.get("before") == "1");
  CHECK(s.get("after") == "2");
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(took < 5.0 + 3.0);
  MESSAGE("fail-over from a hung member took " << took << " s");
}

// A cut-off member: a SilentMember.
TEST_CASE("a cut-off member first in the endpoints (its SYNs dropped), calls of 3 s: a set, an add and a get go through the next "
          "member, each well within its call's time, and later stores in the process ask that member first") {
  SKIP_WITHOUT_ETCD();
  test::EtcdCluster etcd(1, kToken);
  const SilentMember cut;
  auto o = options(etcd, 3s);
  o.endpoints.insert(o.endpoints.begin(), cut.endpoint);
  std::unique_ptr<EtcdStore> s;
  const double made = timed([&] { s = std::make_unique<EtcdStore>(o); });
  CHECK(made < 2.5);
  CHECK(timed([&] { s->set("cut", "1"); }) < 1.0);
  CHECK(timed([&] { CHECK(s->add("cut/count", 2) == 2); }) < 1.0);
  CHECK(timed([&] { CHECK(s->get("cut") == "1"); }) < 1.0);
  // A store made later (a round's, a rank's) starts at the member that answered.
  CHECK(timed([&] { EtcdStore later(o); CHECK(later.get("cut") == "1"); }) < 1.0);
  MESSAGE("the first call, past the cut-off member, took " << made << " s");
}

// Note [Members that answer, members that do not] (etcd_store.cpp)
TEST_CASE("a member that gave no answer is passed over while it stays quiet: a store going round after a quick error skips it, "
          "whatever order its endpoints are in") {
  SKIP_WITHOUT_ETCD();
  test::EtcdCluster etcd(2, kToken);
  const SilentMember cut;
  const std::string nobody = "127.0.0.1:" + std::to_string(test::free_port());  // refuses at once
  // Calls of 3 s: a request's share is 1.5 s among two members, 1 s among three.
  auto o = options(etcd, 3s);
  o.endpoints = {cut.endpoint, etcd.endpoints()[0]};
  const double first = timed([&] { EtcdStore s(o); s.set("quiet", "1"); });
  CHECK(first >= 0.9);  // it waited its share on the cut-off member, and marked it
  // Another order, and a member that answered last not in it: this store starts at `nobody`, whose
  // refusal sends it on past the quiet member to the one that answers.
  o.endpoints = {nobody, cut.endpoint, etcd.endpoints()[1]};
  const double second = timed([&] { EtcdStore s(o); CHECK(s.get("quiet") == "1"); });
  CHECK(second < 0.5);
  MESSAGE("past the cut-off member: " << first << " s the first time, " << second << " s once it was known quiet");
}

TEST_CASE("world 3 rendezvous on etcd: Gloo and shared-memory groups run every collective right, and nobody serves a store") {
  SKIP_WITHOUT_ETCD();
  test::EtcdCluster etcd(1, "t");  // store_world's token
  const auto nobody = std::uint16_t(test::free_port());  // the TCP store's port: nothing listens there
  GlooOptions go;
  go.etcd_endpoints = etcd.endpoints();
  go.etcd_root = "/shardflow/world3/";
  go.key_prefix = "gloo/";
  go.timeout = 20s;
  CHECK(test::wrong_elements(test::store_world(3, nobody, go, make_gloo_communicator), 1000) == 0);
  ShmOptions so;
  static_cast<StoreRendezvous&>(so) = go;
  so.key_prefix = "shm/";
  CHECK(test::wrong_elements(test::store_world(3, nobody, so, make_shm_communicator), 1000) == 0);
}

TEST_CASE("launch environment: SHARDFLOW_RDZV_BACKEND=etcd needs its endpoints and a run id, and names what is missing") {
  auto detect = [](std::map<std::string, std::string> vars) {
    vars.emplace("RANK", "0");
    vars.emplace("WORLD_SIZE", "2");
    vars.emplace("SHARDFLOW_STORE_TOKEN", "t");
    return LaunchEnv::detect([vars](const char* name) -> const char* {
      const auto it = vars.find(name);
      return it == vars.end() ? nullptr : it->second.c_str();
    });
  };
  const auto env = detect({{"SHARDFLOW_RDZV_BACKEND", "etcd"}, {"SHARDFLOW_RDZV_ENDPOINTS", "h1:2379,h2:2379,h3:2379"}, {"SHARDFLOW_RUN_ID", "job9"}});
  CHECK(env.etcd_endpoints == std::vector<std::string>{"h1:2379", "h2:2379", "h3:2379"});
  CHECK(env.etcd_root == "/shardflow/job9/");
  CHECK(env.describe().find("store on etcd at h1:2379,h2:2379,h3:2379 under /shardflow/job9/") != std::string::npos);
  CHECK(detect({}).etcd_endpoints.empty());
  CHECK_THROWS_WITH_AS(detect({{"SHARDFLOW_RDZV_BACKEND", "etcd"}, {"SHARDFLOW_RUN_ID", "j"}}), doctest::Contains("SHARDFLOW_RDZV_ENDPOINTS"), UsageError);
  CHECK_THROWS_WITH_AS(detect({{"SHARDFLOW_RDZV_BACKEND", "etcd"}, {"SHARDFLOW_RDZV_ENDPOINTS", "h:1"}}), doctest::Contains("run id"), UsageError);
  CHECK_THROWS_WITH_AS(detect({{"SHARDFLOW_RDZV_BACKEND", "zookeeper"}}), doctest::Contains("expected tcp or etcd"), UsageError);
  CHECK_THROWS_WITH_AS(detect({{"SHARDFLOW_RDZV_ENDPOINTS", "h:1"}}), doctest::Contains("not etcd"), UsageError);
  CHECK_THROWS_WITH_AS(detect({{"SHARDFLOW_ETCD_ROOT", "/x/"}}), doctest::Contains("SHARDFLOW_ETCD_ROOT is set but"), UsageError);
  CHECK_THROWS_WITH_AS(detect({{"SHARDFLOW_ETCD_USER", "u"}}), doctest::Contains("SHARDFLOW_ETCD_USER is set but"), UsageError);
}
