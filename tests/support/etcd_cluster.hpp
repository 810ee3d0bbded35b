// A real etcd cluster for the store's scenarios: 1 or 3 members of Debian's etcd-server on
// loopback ports, in a temporary directory, with authentication enabled the way docs/launching.md
// tells a user to (a root user, and a user "shardflow" whose password is the job's token, with
// readwrite on /shardflow/). Members can be killed (SIGKILL) to test fail-over.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "free_port.hpp"
#include "subprocess.hpp"

namespace shardflow::test {

inline bool etcd_installed() { return ::access("/usr/bin/etcd", X_OK) == 0 && ::access("/usr/bin/etcdctl", X_OK) == 0; }

class EtcdCluster {
 public:
  // `host`: the address its members listen on; `wrap`: a command they and etcdctl run under
  // ("/usr/sbin/ip netns exec NS": a member inside a network-namespace host).
  EtcdCluster(int members, const std::string& token, bool auth = true, std::string host = "127.0.0.1", std::string wrap = "")
      : host_(std::move(host)), wrap_(std::move(wrap)) {
    // A port free when picked can be another process's by the time etcd binds it (the kernel
    // hands the same ephemeral range to outgoing connections; a clean clone's `make test` lost a
    // case to "bind: address already in use"). Such a start is made again on new ports.
    for (int attempt = 1; !start(members); ++attempt)
      if (attempt == 5) throw std::runtime_error("etcd could not bind its ports in 5 tries: see " + dir_.string());
    if (auth) {
      for (const std::string& c : std::vector<std::string>{"user add root:root-password", "user grant-role root root", "role add shardflow-job",
                                   "role grant-permission shardflow-job --prefix=true readwrite /shardflow/", "user add shardflow:" + token,
                                   "user grant-role shardflow shardflow-job", "auth enable"})
        if (!ctl(c)) throw std::runtime_error("etcdctl " + c + " failed");
    }
  }
  ~EtcdCluster() { tear_down(); }

  std::vector<std::string> endpoints() const {
    std::vector<std::string> out;
    for (const int p : client_) out.push_back(host_ + ":" + std::to_string(p));
    return out;
  }
  void kill(int member) { members_[std::size_t(member)].reset(); }
  // Hung, not gone: its sockets stay open and say nothing (the destructor's SIGKILL still ends it).
  void stop(int member) { ::kill(members_[std::size_t(member)]->pid(), SIGSTOP); }

 private:
  static std::string name(int m) { return "m" + std::to_string(m); }

  // Starts the members on ports picked now and waits until they answer: false (the members
  // stopped; the next start removes their directory) when one found its port taken; throws for
  // any other failure.
  bool start(int members) {
    tear_down();
    client_.clear();
    peer_.clear();
    dir_ = std::filesystem::temp_directory_path() / ("sf-etcd-" + std::to_string(::getpid()) + "-" + std::to_string(free_port()));
    std::filesystem::create_directories(dir_);
    std::string cluster;
    for (int m = 0; m < members; ++m) {
      client_.push_back(free_port());
      peer_.push_back(free_port());
      cluster += (m ? "," : "") + name(m) + "=http://" + host_ + ":" + std::to_string(peer_[m]);
    }
    for (int m = 0; m < members; ++m) {
      const std::string c = "http://" + host_ + ":" + std::to_string(client_[m]), p = "http://" + host_ + ":" + std::to_string(peer_[m]);
      // Elections in 0.5 s rather than 1 s: the fail-over scenarios wait for one.
      const std::string cmd = "exec " + wrap_ + " /usr/bin/etcd --name " + name(m) + " --data-dir " + (dir_ / name(m)).string() + " --listen-client-urls " + c +
                              " --advertise-client-urls " + c + " --listen-peer-urls " + p + " --initial-advertise-peer-urls " + p +
                              " --initial-cluster " + cluster + " --initial-cluster-state new --initial-cluster-token " + dir_.filename().string() +
                              " --heartbeat-interval 50 --election-timeout 500 > " + log(m).string() + " 2>&1";
      members_.push_back(std::make_unique<Child>(std::vector<std::string>{"/bin/sh", "-c", cmd}));
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!ctl("endpoint health")) {
      for (int m = 0; m < members; ++m)
        if (log_says(m, "address already in use")) {
          members_.clear();  // SIGKILL: the others are up on ports a new start does not use
          return false;
        }
      if (std::chrono::steady_clock::now() > deadline) throw std::runtime_error("etcd did not become healthy: see " + dir_.string());
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return true;
  }
  // The members SIGKILLed, their directory gone (a start made again, the end).
  void tear_down() {
    members_.clear();
    std::error_code ignored;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ignored);
  }
  std::filesystem::path log(int m) const { return dir_ / (name(m) + ".log"); }
  bool log_says(int m, const std::string& what) const {
    std::ifstream in(log(m));
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return text.find(what) != std::string::npos;
  }
  bool ctl(const std::string& args) const {
    std::string eps;
    for (const auto& e : endpoints()) eps += (eps.empty() ? "" : ",") + e;
    return std::system(("ETCDCTL_API=3 " + wrap_ + " /usr/bin/etcdctl --dial-timeout 2s --endpoints " + eps + " " + args + " >/dev/null 2>&1").c_str()) == 0;
  }

  std::string host_, wrap_;
  std::filesystem::path dir_;
  std::vector<int> client_, peer_;
  std::vector<std::unique_ptr<Child>> members_;
};

}  // namespace shardflow::test
