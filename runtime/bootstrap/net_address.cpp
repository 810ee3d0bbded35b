#include "runtime/bootstrap/net_address.hpp"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "shardflow/errors.hpp"

namespace shardflow::net {
namespace {

std::string ntop(const in_addr& a) {
  char buf[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &a, buf, sizeof buf);
  return buf;
}

// Every (interface, IPv4 address) pair, in the kernel's order.
template <class Visit>
void each_ipv4(Visit visit) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) throw CommError("getifaddrs: " + std::string(std::strerror(errno)));
  std::unique_ptr<ifaddrs, void (*)(ifaddrs*)> guard(list, ::freeifaddrs);
  for (const ifaddrs* i = list; i; i = i->ifa_next)
    if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET)
      if (visit(std::string(i->ifa_name), ntop(reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr))) return;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s.empty() ? "none" : s;
}

}  // namespace

SocketChoice socket_choice_from_env(const std::function<const char*(const char*)>& getenv) {
  auto get = [&](const char* name) -> std::string {
    const char* v = getenv ? getenv(name) : std::getenv(name);
    return v ? v : "";
  };
  if (auto a = get("SHARDFLOW_SOCKET_ADDR"); !a.empty()) return {a, "", "SHARDFLOW_SOCKET_ADDR"};
  for (const char* name : {"SHARDFLOW_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"})
    if (auto i = get(name); !i.empty()) return {"", i, name};
  return {};
}

std::string resolve_ipv4(const std::string& host) {
  in_addr literal{};
  if (::inet_pton(AF_INET, host.c_str(), &literal) == 1) return host;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || !res) throw CommError("cannot resolve host '" + host + "' to an IPv4 address: " + ::gai_strerror(rc));
  const std::string out = ntop(reinterpret_cast<const sockaddr_in*>(res->ai_addr)->sin_addr);
  ::freeaddrinfo(res);
  return out;
}

std::vector<std::string> ipv4_interfaces() {
  std::vector<std::string> out;
  each_ipv4([&](const std::string& name, const std::string& addr) {
    out.push_back(name + "=" + addr);
    return false;
  });
  return out;
}

std::string interface_address(const std::string& ifname, const std::string& origin) {
  std::string found;
  each_ipv4([&](const std::string& name, const std::string& addr) {
    if (name == ifname) found = addr;
    return !found.empty();
  });
  if (found.empty())
    throw UsageError(origin + ": interface '" + ifname + "' does not exist on this host or has no IPv4 address (interfaces with one: " +
                     join(ipv4_interfaces()) + ")");
  return found;
}

std::string address_routing_to(const std::string& host) {
  const std::string ip = resolve_ipv4(host);
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw CommError("socket: " + std::string(std::strerror(errno)));
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(9);  // any port: connecting a UDP socket sends nothing, it only picks the route
  ::inet_pton(AF_INET, ip.c_str(), &to.sin_addr);
  sockaddr_in local{};
  socklen_t len = sizeof local;
  const bool ok = ::connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof to) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
  const int err = errno;
  ::close(fd);
  if (!ok)
    throw CommError("no route from this host to " + host + " (" + ip + "): " + std::strerror(err) +
                    " (pass --iface NAME or SHARDFLOW_SOCKET_IFNAME to pick the interface)");
  return ntop(local.sin_addr);
}

bool is_local_address(const std::string& ip) {
  bool found = false;
  each_ipv4([&](const std::string&, const std::string& addr) { return found = (addr == ip); });
  return found;
}

LocalAddress choose_local_address(const SocketChoice& choice, const std::string& master_host, bool single_host) {
  if (!choice.address.empty()) {
    std::string ip;
    try {
      ip = resolve_ipv4(choice.address);
    } catch (const CommError& e) {
      throw UsageError(choice.origin + ": " + e.what());
    }
    if (!is_local_address(ip))
      throw UsageError(choice.origin + ": address " + choice.address + " is not one of this host's (interfaces: " +
                       join(ipv4_interfaces()) + ")");
    return {ip, choice.origin};
  }
  if (!choice.ifname.empty()) return {interface_address(choice.ifname, choice.origin), choice.origin + "=" + choice.ifname};
  if (single_host) return {"127.0.0.1", "every rank on this host"};
  return {address_routing_to(master_host), "the route to " + master_host};
}

std::string store_bind_address(const SocketChoice& choice, const std::string& master_host, bool single_host) {
  if (single_host) return "127.0.0.1";
  const std::string master = resolve_ipv4(master_host);
  if (is_local_address(master)) return master;
  return choose_local_address(choice, master_host, false).address;
}

}  // namespace shardflow::net
