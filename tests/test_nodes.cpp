// Several nodes' launchers on one host, meeting over loopback: the rendezvous, failures that cross
// nodes, and where sockets bind (Note [Failures cross hosts], Note [Choosing the socket address]).
// tests/test_two_hosts.cpp runs the same jobs across two network namespaces joined by a veth link.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>

#include "support/etcd_cluster.hpp"
#include "support/helpers.hpp"
#include "support/launch_helpers.hpp"
#include "support/saved_params.hpp"
#include "runtime/bootstrap/etcd_names.hpp"
#include "runtime/bootstrap/net_address.hpp"
#include "shardflow/errors.hpp"
#include "shardflow/launch.hpp"
#include "shardflow/safetensors.hpp"
#include "shardflow/store.hpp"
#include "support/subprocess.hpp"

using namespace shardflow;
using namespace std::chrono_literals;
using test::Child;
using test::gloo_trainer;
constexpr auto env = &test::one_blas_thread_env;

namespace {

std::string scratch(const std::string& name) { return test::scratch("test_nodes", name); }

struct Node {
  int rank = 0, nnodes = 2, nproc = 1, port = 0;
  std::vector<std::string> flags;  // extra launcher flags
};

std::vector<std::string> node_cmd(const Node& n, const std::vector<std::string>& prog) {
  std::vector<std::string> argv{test::kLauncher, "run", "--nnodes", std::to_string(n.nnodes), "--node-rank",
                                std::to_string(n.rank), "--nproc-per-node", std::to_string(n.nproc), "--master-port",
                                std::to_string(n.port), "--token", "test-nodes", "--kill-grace", "2",
                                "--heartbeat-timeout", "3"};
  argv.insert(argv.end(), n.flags.begin(), n.flags.end());
  argv.push_back("--");
  argv.insert(argv.end(), prog.begin(), prog.end());
  return argv;
}

// Waits for both nodes' launchers (node 1 first: node 0 serves the store until the others are
// done), puts both outputs into every later failure's report (a macro, so that the INFO stays in
// the test's scope), and requires that both succeeded.
#define REQUIRE_BOTH_NODES_OK(n0, n1)    \
  const auto s1_ = (n1).wait(120s);      \
  const auto s0_ = (n0).wait(120s);      \
  INFO((n0).output());                   \
  INFO((n1).output());                   \
  REQUIRE(test::exited_ok(s0_));         \
  REQUIRE(test::exited_ok(s1_))

using test::check_params;

// The restart scenarios' trainer: 8 steps over Gloo, saving its parameters, with snapshots every 2
// steps in `snaps` (a directory every node sees) unless empty.
std::vector<std::string> eight_steps(const std::string& save, const std::string& snaps, const std::string& backend = "gloo") {
  std::vector<std::string> extra{"--save", save};
  if (!snaps.empty()) extra.insert(extra.end(), {"--snapshot-dir", snaps, "--snapshot-every", "2"});
  auto args = gloo_trainer(extra);  // a global batch of 12
  test::set_flag(args, "--steps", "8");
  test::set_flag(args, "--backend", backend);
  return args;
}

// The same trainer uninterrupted on one node of `ranks` ranks: the parameters a restarted job must end with.
void one_node_of(int ranks, const std::string& save) {
  Child job(node_cmd({0, 1, ranks, test::free_port(), {}}, eight_steps(save, "")), env());
  INFO(job.output());
  REQUIRE(test::exited_ok(job.wait(120s)));
}
void one_node_of_four(const std::string& save) { one_node_of(4, save); }

// A node's command with `nnodes` (e.g. {"--nnodes", "1:2", "--max-restarts", "1"}) in place of its --nnodes N.
std::vector<std::string> with_nnodes(std::vector<std::string> argv, const std::vector<std::string>& nnodes) {
  const auto at = std::find(argv.begin(), argv.end(), "--nnodes");
  argv.erase(at, at + 2);
  argv.insert(argv.begin() + 2, nnodes.begin(), nnodes.end());
  return argv;
}

// `prog` with SHARDFLOW_TEST_FAULT=`fault` in generation 0 only.
std::vector<std::string> fault_in_first_generation(const std::string& fault, const std::vector<std::string>& prog) {
  std::string cmd = "if [ \"$SHARDFLOW_RESTART_COUNT\" = 0 ]; then export SHARDFLOW_TEST_FAULT=" + fault + "; fi; exec";
  for (const auto& a : prog) cmd += " '" + a + "'";
  return {"/bin/sh", "-c", cmd};
}

// Note [Each node scenario under one sanitizer]
// The scenarios here are whole jobs of several launchers and their ranks, about 290 s a sanitizer
// pass one at a time (2026-12-03), the longest chain of CI's passes. The Release pass runs them all;
// the sanitizer passes split them: ThreadSanitizer takes those where the launchers' own threads
// meet (heartbeats, a node lost or silent, rounds of in-place recovery and shrink, rejoins), and
// AddressSanitizer + UBSan those that move state between nodes (two levels, snapshots and their
// copies, restarts that resume them, the rendezvous' and sockets' parsing, the store on etcd).
// A scenario left out of a pass is not listed there (doctest::skip), so ctest does not count it.
const auto memory_pass = doctest::skip(test::kThreadSanitized);
const auto thread_pass = doctest::skip(test::kAddressSanitized);

pid_t pid_of_rank(const std::string& out, int rank) {
  const std::string needle = "rank " + std::to_string(rank) + " (pid ";
  const auto at = out.find(needle);
  return at == std::string::npos ? -1 : pid_t(std::atoi(out.c_str() + at + needle.size()));
}

}  // namespace

TEST_CASE("2 nodes x 2 ranks, --backend auto -> two levels (shm inside a node, gloo between nodes), within 1e-5 of 1 node x 4 ranks, every stage and overlap mode" * memory_pass) {
  int port = 0;
  test::two_levels_match_one_host("test_nodes", [&](int node, int nnodes, int nproc, const std::vector<std::string>& prog) {
    if (node == 0) port = test::free_port();  // a fresh store for each job
    return node_cmd({node, nnodes, nproc, port, {}}, prog);
  }, env());
}

TEST_CASE("2 nodes x 2 ranks on one host over Gloo -> the parameters of 1 node x 4 ranks, bit for bit — torchrun's --rdzv-endpoint" * memory_pass) {
  const std::string one = scratch("one_node.safetensors"), two = scratch("two_nodes.safetensors");
  {
    Child job(node_cmd({0, 1, 4, test::free_port(), {}}, gloo_trainer({"--save", one})), env());
    INFO(job.output());
    REQUIRE(test::exited_ok(job.wait(120s)));
  }
  const int port = test::free_port();
  Child n0(node_cmd({0, 2, 2, port, {}}, gloo_trainer({"--save", two})), env());
  Node second{1, 2, 2, 0, {"--rdzv-endpoint", "127.0.0.1:" + std::to_string(port)}};
  auto cmd = node_cmd(second, gloo_trainer({}));
  cmd.erase(std::find(cmd.begin(), cmd.end(), "--master-port"), std::find(cmd.begin(), cmd.end(), "--master-port") + 2);
  Child n1(cmd, env());
  REQUIRE_BOTH_NODES_OK(n0, n1);
  CHECK(n0.says("[rank 0] mlp_train: sizes 24,40,40,6, world 4 (gloo)"));
  CHECK(n1.says("started rank 2 (pid"));
  CHECK(n1.says("rank 3 (pid"));
  check_params(two, one);
}

TEST_CASE("a rank killed on node 1 -> node 0's launcher stops its own within seconds, naming node 1 and the rank" * thread_pass) {
  const int port = test::free_port();
  Child n0(node_cmd({0, 2, 1, port, {}}, test::endless_gloo_trainer()), env());
  Child n1(node_cmd({1, 2, 1, port, {}}, test::endless_gloo_trainer()), env());
  REQUIRE(n1.read_until("started rank 1", 60s));
  REQUIRE(n0.read_until("3/1000000", 60s));  // rank 0 prints the progress
  const pid_t victim = pid_of_rank(n1.output(), 1);
  REQUIRE(victim > 0);
  ::kill(victim, SIGKILL);
  const double killed_at = n0.seconds_since_start();
  const auto s0 = n0.wait(30s);
  const auto s1 = n1.wait(30s);
  INFO(n0.output());
  INFO(n1.output());
  REQUIRE(test::failed(s0));
  REQUIRE(test::failed(s1));
  CHECK(n0.seconds() - killed_at < 3.0 + 2.0 + 2.0);  // heartbeat interval, kill grace, slack
  CHECK(n0.says("node 1 (host "));
  CHECK(n0.says("rank 1 (local rank 0, pid " + std::to_string(victim) + ") was killed by signal 9"));
  CHECK(n1.says("FAILED: rank 1 (local rank 0, pid " + std::to_string(victim) + ") was killed by signal 9"));
}

TEST_CASE("node 1's launcher goes silent (stopped, like a host gone) -> node 0 names it lost within the heartbeat timeout + 5 s" * thread_pass) {
  const int port = test::free_port();
  Child n0(node_cmd({0, 2, 1, port, {}}, test::endless_gloo_trainer()), env());
  Child n1(node_cmd({1, 2, 1, port, {}}, test::endless_gloo_trainer()), env());
  REQUIRE(n0.read_until("3/1000000", 60s));
  ::kill(n1.pid(), SIGSTOP);  // its rank trains on; only its heartbeats stop
  const double stopped_at = n0.seconds_since_start();
  const auto s0 = n0.wait(30s);
  INFO(n0.output());
  REQUIRE(test::failed(s0));
  CHECK(n0.seconds() - stopped_at < 3.0 + 5.0);
  CHECK(n0.seconds() - stopped_at > 2.0);  // not before the timeout
  CHECK(n0.says("FAILED: node 1 (host "));
  CHECK(n0.says("lost: no heartbeat for"));
}

TEST_CASE("node 0's launcher killed -> node 1 exits non-zero naming node 0" * thread_pass) {
  const int port = test::free_port();
  Child n0(node_cmd({0, 2, 1, port, {}}, test::endless_gloo_trainer()), env());
  Child n1(node_cmd({1, 2, 1, port, {}}, test::endless_gloo_trainer()), env());
  REQUIRE(n0.read_until("3/1000000", 60s));
  ::kill(n0.pid(), SIGKILL);
  const double killed_at = n1.seconds_since_start();
  const auto s1 = n1.wait(30s);
  INFO(n1.output());
  REQUIRE(test::failed(s1));
  CHECK(n1.seconds() - killed_at < 3.0 + 5.0);
  CHECK(n1.says("FAILED: "));
  CHECK(n1.says("node 0 (host "));
  CHECK(n1.says("unreachable"));
}

TEST_CASE("rendezvous: missing nodes, a node rank claimed twice, nodes that disagree, no token" * memory_pass) {
  const std::vector<std::string> brief{"/bin/sh", "-c", "sleep 2"};
  SUBCASE("node 1 of 3 never starts -> nodes 0 and 2 stop at the deadline naming it, no rank started") {
    const int port = test::free_port();
    Child n0(node_cmd({0, 3, 1, port, {"--rdzv-timeout", "2"}}, brief), env());
    Child n2(node_cmd({2, 3, 1, port, {"--rdzv-timeout", "2"}}, brief), env());
    const auto s0 = n0.wait(20s), s2 = n2.wait(20s);
    INFO(n0.output());
    INFO(n2.output());
    REQUIRE(test::failed(s0));
    REQUIRE(test::failed(s2));
    CHECK(n0.says("rendezvous: node 1 of 3 never arrived"));
    CHECK(n2.says("rendezvous: node 1 of 3 never arrived"));
    CHECK(!n0.says("started rank"));
    CHECK(n0.seconds() < 2.0 + 3.0);
  }
  SUBCASE("Ctrl-C while node 0 waits for the others -> it stops at once, exit 130, no rank started") {
    Child n0(node_cmd({0, 2, 1, test::free_port(), {}}, brief), env());
    REQUIRE(n0.read_until("waiting for the other nodes", 20s));
    std::this_thread::sleep_for(200ms);
    ::kill(n0.pid(), SIGINT);
    const auto st = n0.wait(10s);
    INFO(n0.output());
    REQUIRE(st.has_value());
    CHECK(WEXITSTATUS(*st) == 130);
    CHECK(n0.says("stopped by SIGINT during the rendezvous"));
    CHECK(!n0.says("started rank"));
  }
  SUBCASE("node 0 never starts -> node 1 says its store accepted no connection") {
    Child n1(node_cmd({1, 2, 1, test::free_port(), {"--rdzv-timeout", "2"}}, brief), env());
    const auto s1 = n1.wait(20s);
    INFO(n1.output());
    REQUIRE(test::failed(s1));
    CHECK(n1.says("node 0's store at 127.0.0.1:"));
    CHECK(n1.says("accepted no connection within 2.0 s"));
  }
  SUBCASE("two launchers say --node-rank 1 -> the second is told, the job runs") {
    const int port = test::free_port();
    Child n0(node_cmd({0, 2, 1, port, {}}, brief), env());
    Child n1(node_cmd({1, 2, 1, port, {}}, brief), env());
    REQUIRE(n1.read_until("started rank 1", 20s));
    Child again(node_cmd({1, 2, 1, port, {}}, brief), env());
    const auto sa = again.wait(20s);
    INFO(again.output());
    REQUIRE(test::failed(sa));
    CHECK(again.says("node rank 1 is already taken by host "));
    CHECK(test::exited_ok(n0.wait(20s)));
    CHECK(test::exited_ok(n1.wait(20s)));
  }
  SUBCASE("--nproc-per-node 2 on node 0, 1 on node 1 -> both stop, naming both") {
    const int port = test::free_port();
    Child n0(node_cmd({0, 2, 2, port, {}}, brief), env());
    Child n1(node_cmd({1, 2, 1, port, {}}, brief), env());
    const auto s0 = n0.wait(20s), s1 = n1.wait(20s);
    INFO(n0.output());
    INFO(n1.output());
    CHECK(test::failed(s0));
    CHECK(test::failed(s1));
    CHECK(n1.says("--nproc-per-node 2"));
    CHECK(n1.says("every node must be started with the same values"));
  }
  SUBCASE("a wrong token -> refused, saying every node needs the same one") {
    const int port = test::free_port();
    Child n0(node_cmd({0, 2, 1, port, {"--rdzv-timeout", "3"}}, brief), env());
    auto cmd = node_cmd({1, 2, 1, port, {}}, brief);
    test::set_flag(cmd, "--token", "not-the-job's");
    Child n1(cmd, env());
    const auto s1 = n1.wait(20s);
    INFO(n1.output());
    REQUIRE(test::failed(s1));
    CHECK(n1.says("wrong token"));
    CHECK(n1.says("every node needs the same --token"));
    CHECK(test::failed(n0.wait(20s)));
  }
  SUBCASE("--nnodes 2 without a token -> an error saying how to pass one") {
    Child job({test::kLauncher, "run", "--nnodes", "2", "--node-rank", "0", "--", "/bin/true"},
              [] { auto e = env(); e["SHARDFLOW_STORE_TOKEN"] = ""; return e; }());
    const auto st = job.wait(20s);
    INFO(job.output());
    REQUIRE(test::failed(st));
    CHECK(job.says("--token T (or export SHARDFLOW_STORE_TOKEN=T)"));
  }
}

TEST_CASE("sockets: --iface reaches the ranks (and NCCL's bootstrap) — a missing interface is named before any rank starts" * memory_pass) {
  SUBCASE("--iface lo") {
    Child job({test::kLauncher, "run", "--nproc-per-node", "2", "--iface", "lo", "--", "/bin/sh", "-c",
               "echo iface=$SHARDFLOW_SOCKET_IFNAME nccl=$NCCL_SOCKET_IFNAME"},
              [] { auto e = env(); e["NCCL_SOCKET_IFNAME"] = ""; return e; }());
    REQUIRE(test::exited_ok(job.wait(20s)));
    CHECK(job.says("[rank 1] iface=lo nccl=lo"));
  }
  SUBCASE("--iface nosuch0") {
    Child job({test::kLauncher, "run", "--nnodes", "2", "--node-rank", "0", "--token", "t", "--iface", "nosuch0", "--",
               "/bin/true"},
              env());
    const auto st = job.wait(20s);
    INFO(job.output());
    REQUIRE(test::failed(st));
    CHECK(job.says("--iface: interface 'nosuch0' does not exist on this host or has no IPv4 address"));
    CHECK(job.says("lo=127.0.0.1"));
    CHECK(!job.says("started rank"));
  }
  SUBCASE("a Gloo job with GLOO_SOCKET_IFNAME=lo trains as torchrun users set it") {
    auto e = env();
    e["GLOO_SOCKET_IFNAME"] = "lo";
    const int port = test::free_port();
    Child n0(node_cmd({0, 2, 1, port, {}}, gloo_trainer({})), e);
    Child n1(node_cmd({1, 2, 1, port, {}}, gloo_trainer({})), e);
    CHECK(test::exited_ok(n0.wait(60s)));
    CHECK(test::exited_ok(n1.wait(60s)));
    CHECK(n0.says("sockets on 127.0.0.1 (GLOO_SOCKET_IFNAME=lo)"));
  }
}

TEST_CASE("socket address rules: explicit, interface, one host, the route to the master" * memory_pass) {
  using net::choose_local_address;
  CHECK(choose_local_address({}, "127.0.0.1", true).address == "127.0.0.1");
  CHECK(choose_local_address({}, "127.0.0.1", false).address == "127.0.0.1");  // the route to a loopback master
  CHECK(choose_local_address({"", "lo", "--iface"}, "10.1.2.3", false).address == "127.0.0.1");
  CHECK(choose_local_address({"127.0.0.1", "", "--local-addr"}, "10.1.2.3", false).address == "127.0.0.1");
  CHECK_THROWS_WITH_AS(choose_local_address({"192.0.2.77", "", "SHARDFLOW_SOCKET_ADDR"}, "127.0.0.1", false),
                       doctest::Contains("SHARDFLOW_SOCKET_ADDR: address 192.0.2.77 is not one of this host's"), UsageError);
  CHECK_THROWS_WITH_AS(choose_local_address({"", "nosuch0", "GLOO_SOCKET_IFNAME"}, "127.0.0.1", false),
                       doctest::Contains("GLOO_SOCKET_IFNAME: interface 'nosuch0'"), UsageError);
  CHECK_THROWS_WITH_AS(net::resolve_ipv4("no-such-host.invalid"), doctest::Contains("no-such-host.invalid"), CommError);
  CHECK(net::store_bind_address({}, "127.0.0.1", true) == "127.0.0.1");
  CHECK(net::store_bind_address({}, "127.0.0.1", false) == "127.0.0.1");  // the master is this host: bind it, not 0.0.0.0

  auto from = [](std::map<std::string, std::string> vars) {
    return LaunchEnv::detect([vars](const char* k) -> const char* {
      auto it = vars.find(k);
      return it == vars.end() ? nullptr : it->second.c_str();
    });
  };
  const auto both = from({{"GLOO_SOCKET_IFNAME", "eth9"}, {"SHARDFLOW_SOCKET_IFNAME", "lo"}});
  CHECK(both.socket_ifname == "lo");  // shardflow's own variable first
  CHECK(both.socket_origin == "SHARDFLOW_SOCKET_IFNAME");
  const auto gloo = from({{"GLOO_SOCKET_IFNAME", "eth9"}});
  CHECK(gloo.socket_ifname == "eth9");
  const auto addr = from({{"SHARDFLOW_SOCKET_ADDR", "127.0.0.1"}, {"GLOO_SOCKET_IFNAME", "eth9"}});
  CHECK(addr.socket_address == "127.0.0.1");
  CHECK(addr.socket_ifname.empty());
  CHECK(addr.socket_bind_address() == "127.0.0.1");
}

// The launchers' environment with the runtime's info lines ("resumed from the snapshot of step N in memory").
std::map<std::string, std::string> env_info() {
  auto e = env();
  e["SHARDFLOW_LOG_LEVEL"] = "info";
  return e;
}

// Note [Restarting the worker group] across nodes, Note [Snapshots], Note [Snapshots on the other host]
TEST_CASE("2 nodes x 2 ranks, --max-restarts 1, snapshots every 2 steps: rank 3 (node 1) killed in step 7 -> both nodes restart "
          "together, resume from step 4 (in memory, each host holding the other's copies — or on disk), and end where 1 node x 4 "
          "ranks ends uninterrupted, bit for bit" * memory_pass) {
  const std::string one = scratch("restart_one_node.safetensors"), two = scratch("restart_two_nodes.safetensors");
  const std::string snaps = scratch("restart_snapshots");
  std::filesystem::remove_all(snaps);
  one_node_of_four(one);
  bool memory = true;
  SUBCASE("in memory") {}
  SUBCASE("on disk (--no-snapshot-memory)") { memory = false; }
  auto prog = [&](const std::string& save) {
    auto args = eight_steps(save, snaps);
    if (!memory) args.push_back("--no-snapshot-memory");
    return fault_in_first_generation("collective:3:kill:13", args);
  };
  // Two collectives a step at ZeRO-1: rank 3's 13th is in step 7, while step 6's snapshot is pending.
  const int port = test::free_port();
  Child n0(node_cmd({0, 2, 2, port, {"--max-restarts", "1"}}, prog(two)), env_info());
  Child n1(node_cmd({1, 2, 2, port, {"--max-restarts", "1"}}, prog(scratch("unused.safetensors"))), env_info());
  REQUIRE_BOTH_NODES_OK(n0, n1);
  CHECK(n1.says("rank 3 (local rank 1, pid "));
  CHECK(n1.says("restarting every rank (1 of 1 restarts)"));
  CHECK(n0.says("restarting every rank (1 of 1 restarts)"));
  CHECK(n0.says("; restart 1 of 1"));
  CHECK(n0.says("[rank 0] done: 4 steps"));  // steps 5 to 8 after the restart
  // Every rank reads every rank's parameter slices: node 1's from node 0's copies, and back.
  const std::string where = memory ? "in memory (/dev/shm/shardflow-snapshots-" : "on disk (" + snaps;
  CHECK(n0.says("[shardflow] [rank 0] [info] resumed from the snapshot of step 4 " + where));
  CHECK(n1.says("[shardflow] [rank 3] [info] resumed from the snapshot of step 4 " + where));
  check_params(two, one);
}

namespace {

// `prog` with SHARDFLOW_TEST_FAULT=`fault` only in the processes the launchers start first (generation
// 0, before any round of in-place recovery): a replacement, or a restarted job, runs clean.
std::vector<std::string> fault_in_first_process(const std::string& fault, const std::vector<std::string>& prog) {
  std::string cmd = "if [ \"$SHARDFLOW_RESTART_COUNT\" = 0 ] && [ \"$SHARDFLOW_RECOVERY_ROUND\" = 0 ]; then export SHARDFLOW_TEST_FAULT=" +
                    fault + "; fi; exec";
  for (const auto& a : prog) cmd += " '" + a + "'";
  return {"/bin/sh", "-c", cmd};
}

// The survivors' own processes went on: rank r's first pid (the launcher's "rank r (pid P)") is the
// one that says it recovered in place as rank r of `world`.
void check_kept_process(const std::string& out, int r, int world) {
  const pid_t pid = pid_of_rank(out, r);
  REQUIRE(pid > 0);
  CHECK(out.find("[rank " + std::to_string(r) + "] rank " + std::to_string(r) + " (pid " + std::to_string(pid) +
                 "): recovered in place as rank " + std::to_string(r) + " of " + std::to_string(world) + ", going on after step ") !=
        std::string::npos);
}


bool says(const std::string& out, const std::string& what) { return out.find(what) != std::string::npos; }

// The launcher's own lines of a node's output: what a failed check about rounds needs first (a
// report that keeps only the start of a long log still shows them).
std::string launcher_lines(const std::string& out) {
  std::string lines;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);)
    if (line.rfind("shardflow run: ", 0) == 0) lines += line + "\n";
  return lines;
}

// The 8-step job healing itself across 2 nodes x `nproc` ranks under `flags`, node k's first
// processes with faults[k] (empty: none): both nodes must succeed, and the parameters must equal
// (within `tolerance`; 0: bit for bit) those of the same job uninterrupted on 1 node. Both nodes' output.
std::array<std::string, 2> heal_across_two_nodes(const std::string& tag, int nproc, const std::vector<std::string>& flags,
                                                 const std::array<std::string, 2>& faults, double tolerance = 0.0,
                                                 const std::string& backend = "gloo", const std::string& snapshot_every = "2") {
  const std::string one = scratch(tag + "_one_node.safetensors"), two = scratch(tag + "_two_nodes.safetensors");
  const std::string snaps = scratch(tag + "_snapshots");
  std::filesystem::remove_all(snaps);
  one_node_of(2 * nproc, one);
  const int port = test::free_port();
  auto prog = [&](int k, const std::string& save) {
    auto args = eight_steps(save, snaps, backend);
    test::set_flag(args, "--snapshot-every", snapshot_every);
    return faults[std::size_t(k)].empty() ? args : fault_in_first_process(faults[std::size_t(k)], args);
  };
  Child n0(node_cmd({0, 2, nproc, port, flags}, prog(0, two)), env_info());
  Child n1(node_cmd({1, 2, nproc, port, flags}, prog(1, scratch(tag + "_unused.safetensors"))), env_info());
  REQUIRE_BOTH_NODES_OK(n0, n1);
  check_params(two, one, tolerance);
  return {n0.output(), n1.output()};
}

}  // namespace

// Note [Recovering in place], Note [Rounds across nodes]
TEST_CASE("2 nodes x 2 ranks, --recovery in-place: a rank killed in step 7 on node 1, or on node 0 (which serves the store) -> "
          "only its process starts again, on its node — the other three keep theirs, no node fails, and the job ends where 1 "
          "node x 4 ranks ends uninterrupted, bit for bit" * thread_pass) {
  int killed = 3;
  SUBCASE("rank 3, node 1") {}
  SUBCASE("rank 1, node 0") { killed = 1; }
  CAPTURE(killed);
  // Two collectives a step at ZeRO-1: the 13th is in step 7.
  const std::string fault = "collective:" + std::to_string(killed) + ":kill:13";
  const auto out = heal_across_two_nodes("in_place", 2, {"--max-restarts", "1", "--recovery", "in-place"}, {fault, fault});
  const std::string& home = out[killed / 2];  // the lost rank's node runs the round
  const std::string& other = out[1 - killed / 2];
  CHECK(says(home, "recovering in place (round 1, 1 of 1 restarts): the other ranks keep running, rank(s) " + std::to_string(killed) +
                       " start again"));
  CHECK(says(home, "started rank " + std::to_string(killed) + " (pid "));
  CHECK(says(home, "recovered in place: every rank joined round 1"));
  CHECK(!says(other, "recovering in place (round"));  // its launcher has nothing to do
  for (const auto& o : out) {
    CHECK(!says(o, "restarting every rank"));
    CHECK(!says(o, "FAILED"));
  }
  for (int r = 0; r < 4; ++r)
    if (r != killed) check_kept_process(out[r / 2], r, 4);
}

// Note [A round that did not heal]
TEST_CASE("2 nodes x 2 ranks, --recovery in-place --max-restarts 1: rank 3 (node 1) killed in step 3, before any snapshot -> the "
          "survivors of both nodes refuse to go on from round 1, which then counts as no restart on either node: every rank "
          "restarts once, and the job ends where 1 node x 4 ranks ends uninterrupted, bit for bit" * memory_pass) {
  // Two collectives a step at ZeRO-1: the 5th is in step 3, with no snapshot before step 100's.
  const std::string fault = "collective:3:kill:5";
  const auto out = heal_across_two_nodes("refused_round", 2, {"--max-restarts", "1", "--recovery", "in-place"}, {fault, fault}, 0.0,
                                         "gloo", "100");
  CHECK(says(out[1], "recovering in place (round 1, 1 of 1 restarts)"));
  CHECK((says(out[0], "so that round counts as no restart") || says(out[1], "so that round counts as no restart")));
  CHECK((says(out[0], "restarting every rank (1 of 1 restarts)") || says(out[1], "restarting every rank (1 of 1 restarts)")));
}

// Note [Rounds across nodes], shrinking
TEST_CASE("2 nodes x 2 ranks, --recovery shrink: a rank killed in step 7 on node 1, or on node 0 -> no process starts, the "
          "three survivors of both nodes go on at world 3 in their own processes, numbered afresh (the other node's launcher "
          "learns its ranks' new numbers), and the job ends within float rounding of 1 node x 4 ranks" * thread_pass) {
  int killed = 3;
  std::string backend = "gloo";
  SUBCASE("rank 3, node 1") {}
  SUBCASE("rank 1, node 0: node 1's ranks 2 and 3 become 1 and 2") { killed = 1; }
  SUBCASE("rank 3, node 1, --backend auto: two levels, then flat Gloo at world 3, said") { backend = "auto"; }
  CAPTURE(killed);
  CAPTURE(backend);
  // A global batch of 12: 3 a rank at world 4, 4 at world 3, summed in another order. The fault
  // counts the collectives the runtime issues, so two levels' 13th is in the same step as Gloo's.
  const std::string fault = "collective:" + std::to_string(killed) + ":kill:13";
  const auto out = heal_across_two_nodes("shrink_nodes", 2, {"--max-restarts", "1", "--recovery", "shrink"}, {fault, fault}, 1e-5, backend);
  for (int k : {0, 1})
    CHECK(says(out[std::size_t(k)], "backend 'auto' reduces over flat Gloo from here on instead of two levels") == (backend == "auto"));
  const std::string& home = out[killed / 2];
  CHECK(says(home, "recovering in place (round 1, 1 of 1 restarts): the other ranks keep running, at world 3 from now on"));
  CHECK(says(home, "recovered in place: every rank joined round 1"));
  CHECK(!says(out[1 - killed / 2], "recovering in place (round"));
  for (const auto& o : out) {
    CHECK(!says(o, "restarting every rank"));
    CHECK(!says(o, "started rank " + std::to_string(killed) + " (pid"));  // nothing started
  }
  // Each survivor in its first process, under its new number.
  for (int r = 0; r < 4; ++r) {
    if (r == killed) continue;
    const pid_t pid = pid_of_rank(out[r / 2], r);
    REQUIRE(pid > 0);
    const int now = r < killed ? r : r - 1;
    CHECK(says(out[r / 2], "rank " + std::to_string(r) + " (pid " + std::to_string(pid) + "): recovered in place as rank " +
                               std::to_string(now) + " of 3, going on after step "));
  }
  if (killed == 1) CHECK(says(out[1], "round 1 shrank the world to 3: this node's rank(s) 2 -> 1, 3 -> 2"));
}

// Note [Rounds across nodes], shrinking: no node is emptied
TEST_CASE("2 nodes x 1 rank, --recovery shrink: node 1's only rank killed in step 7 -> a shrink would leave node 1 without a "
          "rank, so its rank starts again in place instead, rank 0 keeps its process, and the job ends where 1 node x 2 ranks "
          "ends, bit for bit" * thread_pass) {
  const std::string fault = "collective:1:kill:13";
  const auto out = heal_across_two_nodes("shrink_empty", 1, {"--max-restarts", "1", "--recovery", "shrink"}, {fault, fault});
  CHECK(says(out[1], "recovering in place (round 1, 1 of 1 restarts): the other ranks keep running, rank(s) 1 start again (a "
                     "shrink would leave this node without a rank)"));
  CHECK(says(out[1], "recovered in place: every rank joined round 1"));
  CHECK(!says(out[0], "restarting every rank"));
  check_kept_process(out[0], 0, 2);
}

// Note [Rounds across nodes]: rounds numbered in the store, counted against --max-restarts together
TEST_CASE("2 nodes x 2 ranks, --recovery in-place --max-restarts 2: rank 3 (node 1) lost in step 7, then rank 1 (node 0) in "
          "the second step after the recovery -> round 1 run by node 1 and round 2 by node 0, 2 of 2 restarts, ranks 0 and 2 keep "
          "their processes through both, and the job ends where 1 node x 4 ranks ends, bit for bit" * memory_pass) {
  // Rank 1 issues at most its 14th reduction (step 7's second) before rank 3's loss holds everyone,
  // and at least 4 more after resuming from step 6's or 4's snapshot. The two of the first step
  // after it rejoined round 1 may go out before that round is over: no collective of round 1 need
  // complete before them (killed at its 14th, its loss could not join the open round in 4 of 4
  // runs). Those of the step after wait for the syncs before it, which every rank's group of round
  // 1 took part in, and a rank counts itself joined before it can take part in one: its 17th is one
  // of them, whether it issued 13 or 14 before.
  const auto out = heal_across_two_nodes("in_place_twice", 2, {"--max-restarts", "2", "--recovery", "in-place"},
                                         {"collective:1:kill:17", "collective:3:kill:13"});
  INFO("the launchers' lines:\n" << launcher_lines(out[0]) << launcher_lines(out[1]));  // lazily, when a check below fails
  INFO("node 0's output:\n" << out[0]);
  INFO("node 1's output:\n" << out[1]);
  CHECK(says(out[1], "recovering in place (round 1, 1 of 2 restarts): the other ranks keep running, rank(s) 3 start again"));
  CHECK(says(out[1], "recovered in place: every rank joined round 1"));
  CHECK(says(out[0], "recovering in place (round 2, 2 of 2 restarts): the other ranks keep running, rank(s) 1 start again"));
  CHECK(says(out[0], "recovered in place: every rank joined round 2"));
  for (const auto& o : out) CHECK(!says(o, "restarting every rank"));
  check_kept_process(out[0], 0, 4);
  check_kept_process(out[1], 2, 4);
}

// Note [Rounds across nodes]: no split brain
TEST_CASE("2 nodes x 2 ranks, --recovery in-place --max-restarts 2: rank 1 (node 0) and rank 3 (node 1) killed at once -> one "
          "node holds the round, the other's loss cannot join it and fails the generation: every rank restarts, and the job "
          "still ends where 1 node x 4 ranks ends, bit for bit" * thread_pass) {
  const auto out = heal_across_two_nodes("in_place_both", 2, {"--max-restarts", "2", "--recovery", "in-place"},
                                         {"collective:1:kill:13", "collective:3:kill:13"});
  const bool zero_holds = says(out[0], "recovering in place (round 1");
  CHECK(zero_holds != says(out[1], "recovering in place (round 1"));  // exactly one node held round 1
  CHECK(says(out[zero_holds ? 1 : 0], "; not recovered in place: round 1 of another node's recovery is still open"));
  for (const auto& o : out) {
    CHECK(!says(o, "recovered in place: every rank joined"));
    // The round that did not heal does not count: the restart is the first of two.
    CHECK(says(o, "; restarting every rank (1 of 2 restarts)"));
  }
}

TEST_CASE("--max-restarts across nodes: node 1's launcher killed (a node lost, not a rank) -> node 0 does not restart, and says why "
          "— under --recovery shrink too, which heals a lost host in place only with --nnodes MIN:MAX" * thread_pass) {
  std::vector<std::string> flags{"--max-restarts", "3"};
  SUBCASE("restart") {}
  SUBCASE("--recovery shrink") { flags.insert(flags.end(), {"--recovery", "shrink"}); }  // Note [A lost host healed in place]
  const int port = test::free_port();
  Child n0(node_cmd({0, 2, 1, port, flags}, test::endless_gloo_trainer()), env());
  Child n1(node_cmd({1, 2, 1, port, flags}, test::endless_gloo_trainer()), env());
  REQUIRE(n0.read_until("3/1000000", 60s));
  ::kill(n1.pid(), SIGKILL);  // its rank dies with it (PR_SET_PDEATHSIG)
  const auto s0 = n0.wait(60s);
  INFO(n0.output());
  REQUIRE(test::failed(s0));
  CHECK(n0.says("not restarted: "));
  CHECK(!n0.says("restarting every rank"));
  if (flags.size() > 2) {
    CHECK(n0.says(" lost: no heartbeat for "));
    CHECK(n0.says("; not recovered in place: --nnodes is not elastic (MIN:MAX)"));
    CHECK(!n0.says("; recovering in place (round"));
  }
}

// Note [Shrinking the world]
TEST_CASE("--nnodes 1:2 --max-restarts 1: node 1 lost in step 7 (its launcher and ranks gone at once) -> node 0 goes on alone "
          "after --rejoin-timeout, resumes the world-4 snapshot at world 2, and ends where 1 node x 4 ranks ends, to float rounding" * thread_pass) {
  const std::string one = scratch("shrink_one_node.safetensors"), two = scratch("shrink_two_nodes.safetensors");
  const std::string snaps = scratch("shrink_snapshots");
  std::filesystem::remove_all(snaps);
  one_node_of_four(one);
  // Rank 3 takes node 1's launcher down with it at its 13th collective (step 7). A global batch of
  // 12 is 3 a rank at world 4 and 6 at world 2.
  const int port = test::free_port();
  auto cmd_for = [&](int node, const std::string& save) {
    return with_nnodes(node_cmd({node, 2, 2, port, {}}, fault_in_first_generation("collective:3:host:13", eight_steps(save, snaps))),
                       {"--nnodes", "1:2", "--max-restarts", "1", "--rejoin-timeout", "1"});
  };
  Child n0(cmd_for(0, two), env_info());
  Child n1(cmd_for(1, scratch("shrink_unused.safetensors")), env_info());
  const auto s1 = n1.wait(120s);
  const auto s0 = n0.wait(120s);
  INFO(n0.output());
  INFO(n1.output());
  REQUIRE(test::exited_ok(s0));
  CHECK(test::failed(s1));  // killed
  CHECK(n0.says("going on without node 1 (host "));
  CHECK(n0.says("1 node(s), world 2"));
  CHECK(n0.says("[rank 0] mlp_train: sizes 24,40,40,6, world 2 (gloo)"));
  CHECK(n0.says("[rank 0] done: 4 steps"));  // steps 5 to 8, from step 4's snapshot
  // Node 1's shards come from the copies node 0's memory holds (Note [Snapshots on the other host]).
  CHECK(n0.says("[shardflow] [rank 1] [info] resumed from the snapshot of step 4 in memory"));
  check_params(two, one, 1e-5);  // the same global batch, summed in another order (measured 4e-8)
}

namespace {

// One file pushed to a launcher's copy port as the other node's launcher would (Note [Snapshots on
// the other host]): the greeting with `token`, then `path` holding "abcd". Returns the answer byte,
// 0 when the launcher closed the connection instead.
char push_copy(const std::string& where, const std::string& token, const std::string& path) {
  const auto colon = where.rfind(':');
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(std::uint16_t(std::stoi(where.substr(colon + 1))));
  REQUIRE(::inet_pton(AF_INET, where.substr(0, colon).c_str(), &a.sin_addr) == 1);
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0);
  std::string msg;
  auto u32 = [&](std::uint32_t v) { msg.append(reinterpret_cast<const char*>(&v), 4); };
  auto str = [&](const std::string& v) {
    u32(std::uint32_t(v.size()));
    msg += v;
  };
  u32(0x524d4653);  // "SFMR"
  str(token);
  str(path);
  const std::uint64_t size = 4;
  msg.append(reinterpret_cast<const char*>(&size), 8);
  msg += "abcd";
  ::send(fd, msg.data(), msg.size(), MSG_NOSIGNAL);
  timeval tv{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  char ack = 0;
  if (::recv(fd, &ack, 1, 0) != 1) ack = 0;
  ::close(fd);
  return ack;
}

}  // namespace

TEST_CASE("two nodes: a launcher's copy port keeps a snapshot's shard file only from a sender with the job's token, and no "
          "other name (no path out of its memory)" * memory_pass) {
  const int port = test::free_port();
  Child n0(node_cmd({0, 2, 1, port, {}}, test::endless_gloo_trainer()), env());
  Child n1(node_cmd({1, 2, 1, port, {}}, test::endless_gloo_trainer()), env());
  REQUIRE(n0.read_until("3/1000000", 60s));
  TcpStoreClient store("127.0.0.1", std::uint16_t(port), "test-nodes", 10s);
  const std::string where = store.get("launch/mirror/0");
  const std::string memory = "/dev/shm/shardflow-snapshots-" + std::to_string(n0.pid());
  REQUIRE(std::filesystem::is_directory(memory));
  const std::string good = "step-2/ckpt-0000abcd-rank1-of-2.safetensors";
  CHECK(push_copy(where, "not-the-token", good) == 0);
  CHECK(!std::filesystem::exists(memory + "/" + good));
  CHECK(push_copy(where, "test-nodes", "step-2/../../escape-rank1-of-2.safetensors") == 0);
  CHECK(push_copy(where, "test-nodes", "step-2/notes.txt") == 0);
  CHECK(push_copy(where, "test-nodes", good) == 'k');
  std::ifstream kept(memory + "/" + good);
  std::string got((std::istreambuf_iterator<char>(kept)), std::istreambuf_iterator<char>());
  CHECK(got == "abcd");
  ::kill(n0.pid(), SIGTERM);
  ::kill(n1.pid(), SIGTERM);
  n0.wait(60s);
  n1.wait(60s);
  INFO(n0.output());
  CHECK(n0.says("refused 'step-2/../../escape-rank1-of-2.safetensors' from another node"));
  CHECK(!std::filesystem::exists(memory));  // the job's end takes its memory
}

namespace {

// Three nodes x 1 rank of the eight-step job (snapshots every 2 steps in `snaps`), `fault` in the
// first generation; node `saver` saves the parameters to `save`.
std::vector<std::unique_ptr<Child>> ring_of_three(const std::vector<std::string>& flags, const std::vector<std::string>& nnodes,
                                                  const std::string& fault, int saver, const std::string& save, const std::string& snaps) {
  const int port = test::free_port();
  std::vector<std::unique_ptr<Child>> nodes;
  for (int k = 0; k < 3; ++k) {
    auto argv = node_cmd({k, 3, 1, port, flags}, fault_in_first_generation(fault, eight_steps(k == saver ? save : scratch("ring_unused.safetensors"), snaps)));
    nodes.push_back(std::make_unique<Child>(with_nnodes(argv, nnodes), env_info()));
  }
  return nodes;
}

}  // namespace

// The three nodes' statuses s0, s1, s2 (waited for from the last: node 0 outlives the others on the
// TCP store), with every output in the failures' report.
#define WAIT_THREE_NODES(nodes)              \
  const auto s2 = (nodes)[2]->wait(120s);    \
  const auto s1 = (nodes)[1]->wait(120s);    \
  const auto s0 = (nodes)[0]->wait(120s);    \
  INFO((nodes)[0]->output());                \
  INFO((nodes)[1]->output());                \
  INFO((nodes)[2]->output())

// Note [Snapshots on the other host] with a ring of three
TEST_CASE("3 nodes x 1 rank, snapshots every 2 steps in memory, each host holding its own and its predecessor's files: rank 1 "
          "killed in step 7 -> every host fetches what it lacks before the restart, resumes from step 4 in memory, and ends where "
          "1 node x 3 ranks ends, bit for bit — node 2 lost instead (--nnodes 2:3) -> nodes 0 and 1 resume it at world 2 from memory "
          "— the rank lost healed in place -> every host gathers it before the round's word, and the survivors resume it from memory" * memory_pass) {
  const std::string one = scratch("ring_one_node.safetensors"), three = scratch("ring_three_nodes.safetensors");
  const std::string snaps = scratch("ring_snapshots");
  one_node_of(3, one);
  std::string fault = "collective:1:kill:13";
  std::vector<std::string> elastic{"--nnodes", "3"}, flags{"--max-restarts", "1"};
  SUBCASE("a rank lost") {}
  SUBCASE("a node lost") {
    fault = "collective:2:host:13";
    elastic = {"--nnodes", "2:3", "--rejoin-timeout", "1"};
  }
  // Note [Copies gathered before the word]: without it the ranks went back to the start here
  // (this job keeps no snapshots on disk), as each host lacked one node's file of step 4.
  SUBCASE("a rank lost, healed in place") { flags.insert(flags.end(), {"--recovery", "in-place"}); }
  std::filesystem::remove_all(snaps);
  const auto nodes = ring_of_three(flags, elastic, fault, 0, three, snaps);
  WAIT_THREE_NODES(nodes);
  REQUIRE(test::exited_ok(s0));
  REQUIRE(test::exited_ok(s1));
  CHECK(nodes[0]->says("[shardflow] [rank 0] [info] resumed from the snapshot of step 4 in memory"));
  CHECK(nodes[1]->says("[shardflow] [rank 1] [info] resumed from the snapshot of step 4 in memory"));
  if (flags.size() > 2) {
    CHECK(test::exited_ok(s2));
    CHECK(nodes[2]->says("[shardflow] [rank 2] [info] resumed from the snapshot of step 4 in memory"));
    CHECK(nodes[1]->says("recovered in place: every rank joined round 1"));
    CHECK(!nodes[0]->says("restarting every rank"));
    check_params(three, one);
    return;
  }
  CHECK(nodes[0]->says("[rank 0] done: 4 steps"));
  if (elastic.size() == 2) {
    CHECK(test::exited_ok(s2));
    check_params(three, one);
  } else {
    CHECK(test::failed(s2));
    CHECK(nodes[0]->says("going on without node 2 (host "));
    check_params(three, one, 1e-5);  // world 3, then 2: the same global batch in another order
  }
}

// Note [Rejoining]
TEST_CASE("--nnodes 1:2 --max-restarts 2: node 1 lost in step 7, node 0 goes on alone — node 1's launcher started again waits, and "
          "the next restart (a rank of node 0 killed) takes it back in at world 4, from node 0's snapshot copied into its memory: "
          "the run ends where 1 node x 4 ranks ends, to float rounding" * thread_pass) {
  const std::string one = scratch("rejoin_one_node.safetensors"), two = scratch("rejoin_two_nodes.safetensors");
  const std::string snaps = scratch("rejoin_snapshots"), go = scratch("rejoin_go");
  std::filesystem::remove_all(snaps);
  std::filesystem::remove(go);
  one_node_of_four(one);
  // Generation 0: rank 3 takes node 1 down at its 13th collective (step 7). Generation 1 (node 0
  // alone) waits until the returning launcher has asked to rejoin, then loses its rank 1 at its 5th.
  auto prog = [&](const std::string& save) {
    std::string cmd = "if [ \"$SHARDFLOW_RESTART_COUNT\" = 0 ]; then export SHARDFLOW_TEST_FAULT=collective:3:host:13; fi; "
                      "if [ \"$SHARDFLOW_RESTART_COUNT\" = 1 ]; then while [ ! -e '" + go + "' ]; do sleep 0.05; done; "
                      "export SHARDFLOW_TEST_FAULT=collective:1:kill:5; fi; exec";
    for (const auto& a : eight_steps(save, snaps)) cmd += " '" + a + "'";
    return std::vector<std::string>{"/bin/sh", "-c", cmd};
  };
  const int port = test::free_port();
  auto cmd_for = [&](int node, const std::string& save) {
    return with_nnodes(node_cmd({node, 2, 2, port, {}}, prog(save)), {"--nnodes", "1:2", "--max-restarts", "2", "--rejoin-timeout", "1"});
  };
  Child n0(cmd_for(0, two), env_info());
  Child n1(cmd_for(1, scratch("rejoin_unused.safetensors")), env_info());
  REQUIRE(n0.read_until("going on without node 1 (host ", 60s));
  CHECK(test::failed(n1.wait(60s)));  // its launcher was killed with its host
  Child back(cmd_for(1, scratch("rejoin_unused.safetensors")), env_info());
  REQUIRE(back.read_until("for the next restart to take it back in", 60s));
  std::ofstream(go).put('1');
  REQUIRE_BOTH_NODES_OK(n0, back);
  CHECK(n0.says("taking node 1 (host "));
  CHECK(n0.says("back in, which asked to rejoin: 2 node(s), world 4"));
  CHECK(back.says("node 1 rejoins the job at its restart 2: 2 node(s), world 4"));
  CHECK(back.says("started rank 2 (pid"));
  // Its ranks read every rank's files from its own memory: node 0 copied its newest snapshot there first.
  CHECK(back.says("[shardflow] [rank 2] [info] resumed from the snapshot of step 4 in memory"));
  CHECK(n0.says("[rank 0] done: 4 steps"));
  check_params(two, one, 1e-5);  // world 4, then 2, then 4 again: the same global batch in other orders
}

TEST_CASE("node 1 left out, its launcher started again, and no restart comes before the job ends -> the returning launcher "
          "fails naming that — a second returning launcher for the same node is refused" * thread_pass) {
  const std::string snaps = scratch("rejoin_end_snapshots"), go = scratch("rejoin_end_go");
  std::filesystem::remove_all(snaps);
  std::filesystem::remove(go);
  auto prog = [&]() {  // generation 1 (node 0 alone) starts once the returning launcher waits, and ends
    std::string cmd = "if [ \"$SHARDFLOW_RESTART_COUNT\" = 0 ]; then export SHARDFLOW_TEST_FAULT=collective:3:host:13; fi; "
                      "if [ \"$SHARDFLOW_RESTART_COUNT\" = 1 ]; then while [ ! -e '" + go + "' ]; do sleep 0.05; done; fi; exec";
    for (const auto& a : eight_steps(scratch("rejoin_end.safetensors"), snaps)) cmd += " '" + a + "'";
    return std::vector<std::string>{"/bin/sh", "-c", cmd};
  };
  const int port = test::free_port();
  auto cmd_for = [&](int node) {
    return with_nnodes(node_cmd({node, 2, 2, port, {}}, prog()), {"--nnodes", "1:2", "--max-restarts", "2", "--rejoin-timeout", "1"});
  };
  Child n0(cmd_for(0), env());
  Child n1(cmd_for(1), env());
  REQUIRE(n0.read_until("going on without node 1 (host ", 60s));
  n1.wait(60s);
  Child back(cmd_for(1), env());
  REQUIRE(back.read_until("for the next restart to take it back in", 60s));
  Child twice(cmd_for(1), env());
  const auto s_twice = twice.wait(60s);
  std::ofstream(go).put('1');
  const auto s0 = n0.wait(120s);
  const auto s_back = back.wait(60s);
  INFO(n0.output());
  INFO(back.output());
  INFO(twice.output());
  CHECK(test::exited_ok(s0));
  CHECK(test::failed(s_back));
  CHECK(back.says("the job ended"));
  CHECK(back.says("before a restart took node 1 (host "));
  CHECK(test::failed(s_twice));
  CHECK(twice.says("node rank 1 is already taken by host "));
}

TEST_CASE("--nnodes MIN:MAX refused without --max-restarts, or with MIN outside [1, MAX], or not a number: each named" * memory_pass) {
  for (const auto& [flags, says] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--nnodes", "1:2", "--node-rank", "0", "--token", "t"}, "give --max-restarts N too"},
           {{"--nnodes", "3:2", "--node-rank", "0", "--token", "t", "--max-restarts", "1"}, "MIN must be in [1, MAX]"},
           {{"--nnodes", "1:x", "--node-rank", "0", "--token", "t"}, "--nnodes '1:x' is not N or MIN:MAX"}}) {
    std::vector<std::string> argv{test::kLauncher, "run"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.insert(argv.end(), {"--", "/bin/true"});
    Child job(argv, env());
    const auto st = job.wait(20s);
    INFO(job.output());
    REQUIRE(st.has_value());
    CHECK(test::failed(st));
    CHECK(job.says(says));
  }
}

// Note [A store no node owns], Note [No node decides alone]
namespace {

// The flags that put a node's store on `etcd`, for the job `id`.
std::vector<std::string> on_etcd(const test::EtcdCluster& etcd, const std::string& id) {
  return {"--rdzv-backend", "etcd", "--rdzv-endpoints", etcd::join_endpoints(etcd.endpoints()), "--rdzv-id", id};
}

// A one-member etcd in `etcd` and its flags appended to `flags`; false (said) where etcd is not installed.
bool start_etcd(std::optional<test::EtcdCluster>& etcd, const std::string& id, std::vector<std::string>& flags) {
  if (!test::etcd_installed()) {
    MESSAGE("etcd-server / etcd-client are not installed (make deps): skipped");
    return false;
  }
  etcd.emplace(1, "test-nodes");
  const auto where = on_etcd(*etcd, id);
  flags.insert(flags.end(), where.begin(), where.end());
  return true;
}

}  // namespace

TEST_CASE("2 nodes x 2 ranks with the store on etcd (--rdzv-backend etcd): no launcher serves a store, and the job ends with the "
          "parameters of 1 node x 4 ranks, bit for bit" * memory_pass) {
  if (!test::etcd_installed()) {
    MESSAGE("etcd-server / etcd-client are not installed (make deps): skipped");
    return;
  }
  const std::string one = scratch("etcd_one_node.safetensors"), two = scratch("etcd_two_nodes.safetensors");
  {
    Child job(node_cmd({0, 1, 4, test::free_port(), {}}, gloo_trainer({"--save", one})), env());
    INFO(job.output());
    REQUIRE(test::exited_ok(job.wait(120s)));
  }
  test::EtcdCluster etcd(1, "test-nodes");
  const int port = test::free_port();  // MASTER_PORT only: nothing serves a store there
  Child n0(node_cmd({0, 2, 2, port, on_etcd(etcd, "bitwise")}, gloo_trainer({"--save", two})), env());
  Child n1(node_cmd({1, 2, 2, port, on_etcd(etcd, "bitwise")}, gloo_trainer({})), env());
  REQUIRE_BOTH_NODES_OK(n0, n1);
  CHECK(n0.says("waiting for the other nodes at etcd at 127.0.0.1:"));
  CHECK(!n0.says("(served here)"));
  CHECK(n0.says("[rank 0] mlp_train: sizes 24,40,40,6, world 4 (gloo)"));
  check_params(two, one);
}

TEST_CASE("3 nodes x 1 rank, the store on etcd, --nnodes 2:3 --max-restarts 1: node 0's host lost in step 7 (its launcher and rank "
          "gone at once) -> node 1 decides, nodes 1 and 2 resume step 4's snapshot from memory at world 2 and end where 1 node x 3 "
          "ranks ends, to float rounding" * thread_pass) {
  if (!test::etcd_installed()) {
    MESSAGE("etcd-server / etcd-client are not installed (make deps): skipped");
    return;
  }
  const std::string one = scratch("etcd_ring_one_node.safetensors"), three = scratch("etcd_ring_three_nodes.safetensors");
  const std::string snaps = scratch("etcd_ring_snapshots");
  one_node_of(3, one);
  std::filesystem::remove_all(snaps);
  test::EtcdCluster etcd(1, "test-nodes");
  auto flags = on_etcd(etcd, "node0-lost");
  flags.insert(flags.end(), {"--max-restarts", "1"});
  const auto nodes = ring_of_three(flags, {"--nnodes", "2:3", "--rejoin-timeout", "1"}, "collective:0:host:13", 1, three, snaps);
  WAIT_THREE_NODES(nodes);
  CHECK(test::failed(s0));  // killed
  REQUIRE(test::exited_ok(s1));
  REQUIRE(test::exited_ok(s2));
  CHECK(nodes[1]->says(") decides this restart (the lowest node whose heartbeat moves)"));
  CHECK(!nodes[2]->says("decides this restart"));
  CHECK(nodes[1]->says("going on without node 0 (host "));
  CHECK(nodes[1]->says("[rank 0] mlp_train: sizes 24,40,40,6, world 2 (gloo)"));
  CHECK(nodes[1]->says("[shardflow] [rank 0] [info] resumed from the snapshot of step 4 in memory"));
  CHECK(nodes[2]->says("[shardflow] [rank 1] [info] resumed from the snapshot of step 4 in memory"));
  CHECK(nodes[1]->says("[rank 0] done: 4 steps"));
  check_params(three, one, 1e-5);  // world 3, then 2: the same global batch in another order
}

// Note [A lost host healed in place]
TEST_CASE("--nnodes 1:2 --recovery shrink or in-place: a host lost in step 7 (its launcher and ranks gone at once) -> the other "
          "node's ranks keep their processes and go on at world 2 from the snapshot in its memory (the lost node's files were "
          "copied there), nothing restarts, and the job ends where 1 node x 4 ranks ends, to float rounding" * memory_pass) {
  std::string recovery = "shrink";
  int lost = 1;
  SUBCASE("node 1 lost, shrink") {}
  SUBCASE("node 1 lost, in-place: the lost host's ranks cannot start again anywhere, so it shrinks too") { recovery = "in-place"; }
  SUBCASE("node 0 lost with the store on etcd: node 1 runs the round, and its ranks 2 and 3 become 0 and 1") { lost = 0; }
  CAPTURE(recovery);
  CAPTURE(lost);
  std::optional<test::EtcdCluster> etcd;
  std::vector<std::string> flags{"--recovery", recovery};
  if (lost == 0 && !start_etcd(etcd, "lost-host-in-place", flags)) return;
  const std::string one = scratch("lost_host_one_node.safetensors"), two = scratch("lost_host_two_nodes.safetensors");
  const std::string snaps = scratch("lost_host_snapshots");
  std::filesystem::remove_all(snaps);
  one_node_of_four(one);
  const int port = test::free_port();
  // A rank of the lost node takes its launcher down at its 13th collective (step 7); the launcher's
  // other rank goes with it (PR_SET_PDEATHSIG).
  const std::string fault = "collective:" + std::to_string(2 * lost + 1) + ":host:13";
  auto cmd_for = [&](int node, const std::string& save) {
    return with_nnodes(node_cmd({node, 2, 2, port, flags}, fault_in_first_process(fault, eight_steps(save, snaps))),
                       {"--nnodes", "1:2", "--max-restarts", "1"});
  };
  Child n0(cmd_for(0, lost == 0 ? scratch("lost_host_unused.safetensors") : two), env_info());
  Child n1(cmd_for(1, lost == 1 ? scratch("lost_host_unused.safetensors") : two), env_info());
  const auto s1 = n1.wait(120s);
  const auto s0 = n0.wait(120s);
  INFO(n0.output());
  INFO(n1.output());
  REQUIRE(test::exited_ok(lost == 1 ? s0 : s1));
  CHECK(test::failed(lost == 1 ? s1 : s0));  // killed
  const std::string out = lost == 1 ? n0.output() : n1.output();
  CHECK(says(out, "node " + std::to_string(lost) + " (host "));
  CHECK(says(out, " lost: no heartbeat for "));
  CHECK(says(out, "; recovering in place (round 1, 1 of 1 restarts): the ranks of the node(s) left keep running, at world 2 from now on, "
                  "without it"));
  CHECK(says(out, "recovered in place: every rank joined round 1"));
  CHECK(!says(out, "restarting every rank"));
  CHECK(out.find("started rank") == out.rfind("started rank"));  // once, at the start
  if (lost == 0) CHECK(says(out, "round 1 shrank the world to 2: this node's rank(s) 2 -> 0, 3 -> 1"));
  for (int r = 2 * (1 - lost); r < 2 * (1 - lost) + 2; ++r) {  // each survivor in its first process
    const pid_t pid = pid_of_rank(out, r);
    REQUIRE(pid > 0);
    CHECK(says(out, "rank " + std::to_string(r) + " (pid " + std::to_string(pid) + "): recovered in place as rank " +
                        std::to_string(r % 2) + " of 2, going on after step "));
  }
  // The lost node's shards come from the copies this node's memory holds; later snapshots wait for no copy.
  CHECK(says(out, "in memory (/dev/shm/shardflow-snapshots-"));
  CHECK(!says(out, "did not reach"));
  check_params(two, one, 1e-5);
}

namespace {

// Note [A lost host healed in place] at three nodes of `nproc` ranks (`backend`, --nnodes 2:3,
// `flags` on every launcher): node 1's last rank takes its host down at its `at`-th collective.
// Nodes 0 and 2 must succeed in their first processes, without a restart, and end within 1e-5 of
// one node's uninterrupted run. Their outputs.
std::array<std::string, 2> lose_node_one_of_three(const std::string& tag, int nproc, const std::string& backend,
                                                  const std::vector<std::string>& flags, int at) {
  const std::string one = scratch(tag + "_one_node.safetensors"), three = scratch(tag + "_three_nodes.safetensors");
  const std::string snaps = scratch(tag + "_snapshots");
  one_node_of(3 * nproc, one);
  std::filesystem::remove_all(snaps);
  const int port = test::free_port();
  const std::string fault = "collective:" + std::to_string(2 * nproc - 1) + ":host:" + std::to_string(at);
  std::vector<std::unique_ptr<Child>> nodes;
  for (int k = 0; k < 3; ++k) {
    auto prog = eight_steps(k == 0 ? three : scratch(tag + "_unused.safetensors"), snaps);
    test::set_flag(prog, "--backend", backend);
    auto argv = node_cmd({k, 3, nproc, port, flags}, fault_in_first_process(fault, prog));
    nodes.push_back(std::make_unique<Child>(with_nnodes(argv, {"--nnodes", "2:3"}), env_info()));
  }
  WAIT_THREE_NODES(nodes);
  REQUIRE(test::exited_ok(s0));
  REQUIRE(test::exited_ok(s2));
  CHECK(test::failed(s1));  // killed
  for (const auto& n : nodes) CHECK(!n->says("restarting every rank"));
  check_params(three, one, 1e-5);
  return {nodes[0]->output(), nodes[2]->output()};
}

}  // namespace

// Note [A lost host healed in place] with a ring of three
TEST_CASE("3 nodes x 1 rank, --nnodes 2:3 --recovery shrink: node 1 lost in step 7 -> node 0 runs the round, node 2 learns it, "
          "both fetch the newest snapshot whole (node 1's file was on node 2 only) and go on at world 2 in their own processes, "
          "numbered 0 and 1, and the job ends where 1 node x 3 ranks ends, to float rounding" * thread_pass) {
  const auto [n0, n2] = lose_node_one_of_three("ring_lost", 1, "gloo", {"--max-restarts", "1", "--recovery", "shrink"}, 13);
  CHECK(says(n0, "node 1 (host "));
  CHECK(says(n0, "; recovering in place (round 1, 1 of 1 restarts): the ranks of the node(s) left keep running, at world 2 from now "
                 "on, without it"));
  CHECK(says(n0, "recovered in place: every rank joined round 1"));
  CHECK(!says(n2, "recovering in place (round"));
  CHECK(says(n2, "round 1 shrank the world to 2: this node's rank(s) 2 -> 1"));
  CHECK(says(n0, "rank 0 (pid " + std::to_string(pid_of_rank(n0, 0)) + "): recovered in place as rank 0 of 2, going on after step "));
  CHECK(says(n2, "rank 2 (pid " + std::to_string(pid_of_rank(n2, 2)) + "): recovered in place as rank 1 of 2, going on after step "));
  CHECK(says(n0, "[shardflow] [rank 0] [info] resumed from the snapshot of step "));
  CHECK(says(n2, "[shardflow] [rank 1] [info] resumed from the snapshot of step "));
  CHECK(!says(n0, " on disk ("));  // from memory, node 1's file fetched from node 2
  CHECK(!says(n2, " on disk ("));
}

// Note [A lost host healed in place]: whole hosts left out keep two levels
TEST_CASE("3 nodes x 2 ranks, --backend auto (two levels), --nnodes 2:3 --recovery in-place: node 1 lost in step 7 -> nodes 0 and 2 "
          "go on at world 4 over two levels in their own processes (node 2's ranks 4 and 5 become 2 and 3), and the job ends where 1 "
          "node x 6 ranks ends, to float rounding" * memory_pass) {
  const auto [n0, n2] = lose_node_one_of_three("two_levels_lost", 2, "auto", {"--max-restarts", "1", "--recovery", "in-place"}, 13);
  CHECK(says(n0, "[rank 0] mlp_train: sizes 24,40,40,6, world 6 (hierarchical"));
  CHECK(says(n0, "recovered in place: every rank joined round 1"));
  CHECK(says(n2, "round 1 shrank the world to 4: this node's rank(s) 4 -> 2, 5 -> 3"));
  CHECK(says(n2, "rank 4 (pid " + std::to_string(pid_of_rank(n2, 4)) + "): recovered in place as rank 2 of 4, going on after step "));
  CHECK(says(n0, "[shardflow] [rank 0] [info] resumed from the snapshot of step "));
  CHECK(says(n2, "[shardflow] [rank 3] [info] resumed from the snapshot of step "));
}

// Note [A node joins live]
TEST_CASE("--nnodes 1:2 --recovery shrink: a host lost in step 7, the other node goes on alone in place — the lost node's launcher "
          "started again is taken in by the running ranks at their next snapshot in memory, without a restart and without a step "
          "lost, and the job ends at world 4 where 1 node x 4 ranks ends, to float rounding" * thread_pass) {
  int lost = 1;
  bool memory = true;
  std::optional<test::EtcdCluster> etcd;
  std::vector<std::string> flags{"--recovery", "shrink"};
  SUBCASE("node 1 lost and back") {}
  SUBCASE("node 0 lost and back with the store on etcd: node 1 runs both rounds, and its ranks go 2 -> 0 -> 2") { lost = 0; }
  SUBCASE("snapshots on disk only: not taken in live, said once; it waits for a restart, which does not come before the end") {
    memory = false;
  }
  CAPTURE(lost);
  CAPTURE(memory);
  if (lost == 0 && !start_etcd(etcd, "grow-live", flags)) return;
  const std::string one = scratch("grow_one_node.safetensors"), two = scratch("grow_two_nodes.safetensors");
  const std::string snaps = scratch("grow_snapshots"), go = scratch("grow_go"), unused = scratch("grow_unused.safetensors");
  std::filesystem::remove_all(snaps);
  std::filesystem::remove(go);
  auto sixteen_steps = [](const std::string& save, const std::string& dir) {
    auto args = eight_steps(save, dir);
    test::set_flag(args, "--steps", "16");
    return args;
  };
  {
    Child job(node_cmd({0, 1, 4, test::free_port(), {}}, sixteen_steps(one, "")), env());
    INFO(job.output());
    REQUIRE(test::exited_ok(job.wait(120s)));
  }
  const int port = test::free_port();
  // A rank of the lost node takes its host down at its 13th collective (step 7); the survivors then
  // hold before step 10 until the returning launcher is waiting to be taken in.
  const std::string fault = "collective:" + std::to_string(2 * lost + 1) + ":host:13";
  auto cmd_for = [&](int node, const std::string& save) {
    auto args = sixteen_steps(save, snaps);
    if (!memory) args.push_back("--no-snapshot-memory");
    return with_nnodes(node_cmd({node, 2, 2, port, flags}, fault_in_first_process(fault, args)), {"--nnodes", "1:2", "--max-restarts", "1"});
  };
  auto held = env_info();
  held["SHARDFLOW_TEST_HOLD"] = "10:" + go;
  // Rank 0 saves the parameters at the end: node 0's, whichever launcher that is then.
  Child n0(cmd_for(0, lost == 0 ? unused : two), held);
  Child n1(cmd_for(1, lost == 1 ? unused : two), held);
  Child& survivor = lost == 1 ? n0 : n1;
  INFO("the survivor's output:\n" << survivor.output());  // lazily: what it said when a check fails
  REQUIRE(survivor.read_until("recovered in place: every rank joined round 1", 90s));
  CHECK(test::failed((lost == 1 ? n1 : n0).wait(60s)));  // its launcher went with its host
  Child back(cmd_for(lost, two), held);
  if (!memory) {
    INFO(survivor.output());
    INFO(back.output());
    REQUIRE(survivor.read_until("asks to join; not taken in live: the ranks keep no snapshots in memory (none, or on disk only), so "
                                "there is no step the job can go on from at once; it joins at the next restart", 60s));
    std::ofstream(go).put('1');
    const auto s_back = back.wait(120s);
    const auto s_survivor = survivor.wait(120s);
    REQUIRE(test::exited_ok(s_survivor));
    CHECK(test::failed(s_back));
    CHECK(back.says("before a restart took node 1 (host "));  // the job ended (or node 0's store with it) first
    CHECK(!says(survivor.output(), "taking it in"));
    check_params(two, one, 1e-5);  // world 4, then 2 to the end
    return;
  }
  REQUIRE(survivor.read_until("asks to join: taking it in (round 2): the ranks go on at world 4 from their next snapshot in memory, its "
                              "ranks taking their part of the state from the running ranks' memory", 60s));
  std::ofstream(go).put('1');
  REQUIRE_BOTH_NODES_OK(survivor, back);
  const std::string out = survivor.output();
  CHECK(back.says("the running ranks to take it in at their next snapshot in memory"));
  CHECK(back.says("node " + std::to_string(lost) + " joins the running job in round 2: 2 node(s), world 4"));
  CHECK(says(out, "grew in place: every rank joined round 2 at world 4"));
  if (lost == 0) CHECK(says(out, "round 2 grew the world to 4: this node's rank(s) 0 -> 2, 1 -> 3"));
  CHECK(!says(out, "restarting every rank"));
  CHECK(out.find("started rank") == out.rfind("started rank"));  // the survivors' launcher: once, at the start
  // The survivors stay in their first processes; nobody goes back a step: every rank goes on after
  // the step the survivors were at, where they completed a snapshot (the first after the newcomer
  // asked: 12 at the latest, after the hold), the newcomer's ranks from the survivors' memory
  // (Note [A join from memory]: no snapshot is copied to its host or read there).
  const auto at = out.find("the launcher takes a node into the job: snapshot of step ");
  REQUIRE(at != std::string::npos);
  const std::string step = std::to_string(std::atoi(out.c_str() + at + std::strlen("the launcher takes a node into the job: snapshot of step ")));
  CHECK(std::stoi(step) % 2 == 0);
  CHECK(std::stoi(step) <= 12);
  for (int r = 2 * (1 - lost); r < 2 * (1 - lost) + 2; ++r)
    CHECK(says(out, "rank " + std::to_string(r) + " (pid " + std::to_string(pid_of_rank(out, r)) + "): recovered in place as rank " +
                        std::to_string(r) + " of 4, going on after step " + step + "\n"));
  for (int r = 2 * lost; r < 2 * lost + 2; ++r)
    CHECK(back.says("[shardflow] [rank " + std::to_string(r) + "] [info] a join: resumed after step " + step + " from the ranks' memory"));
  CHECK(!back.says("resumed from the snapshot"));
  check_params(two, one, 1e-5);  // world 4, then 2, then 4 again: the same global batch in other orders
}
