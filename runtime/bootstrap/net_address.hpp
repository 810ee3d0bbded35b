// Which local address a rank's sockets bind and advertise: the one address its peers on other
// hosts can reach.
//
// Note [Choosing the socket address]
// A socket that binds the host name's address advertises whatever /etc/hosts says, often
// 127.0.1.1, and a peer on another host then connects to its own loopback (the first two-host
// run failed exactly so). The choice, first match wins:
//   1. an explicit address (`--local-addr`, SHARDFLOW_SOCKET_ADDR): must be one of this host's;
//   2. an interface (`--iface`, SHARDFLOW_SOCKET_IFNAME, then GLOO_SOCKET_IFNAME, which torchrun
//      users already set): its first IPv4 address; an interface without one is an error naming it;
//   3. every rank on one host: loopback, as before any of this existed;
//   4. otherwise the source address the kernel's routing table picks for the master address (a
//      connected UDP socket sends nothing, it only asks the route). On the master's own host that
//      is the master address itself.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace shardflow::net {

struct SocketChoice {
  std::string address;  // explicit local address, or empty
  std::string ifname;   // interface name, or empty
  std::string origin;   // where the setting came from, for error messages ("--iface", "GLOO_SOCKET_IFNAME", ...)
};

// SHARDFLOW_SOCKET_ADDR, else SHARDFLOW_SOCKET_IFNAME, else GLOO_SOCKET_IFNAME; `getenv` replaces
// ::getenv (tests). Empty when none is set.
SocketChoice socket_choice_from_env(const std::function<const char*(const char*)>& getenv = {});

// A host name or IPv4 literal to an IPv4 literal. CommError naming the host when it does not resolve.
std::string resolve_ipv4(const std::string& host);

// The interfaces with an IPv4 address, as "name=addr" (for error messages and tests).
std::vector<std::string> ipv4_interfaces();

// The first IPv4 address of `ifname`; UsageError naming the interface (and listing the ones that
// have an address) when it does not exist or has none.
std::string interface_address(const std::string& ifname, const std::string& origin);

// The local address the routing table uses to reach `host`; CommError when there is no route.
std::string address_routing_to(const std::string& host);

// Whether `ip` is assigned to an interface of this host (loopback included).
bool is_local_address(const std::string& ip);

// Note [Choosing the socket address]. `why` says which rule chose, for the launcher's log.
struct LocalAddress {
  std::string address;
  std::string why;
};
LocalAddress choose_local_address(const SocketChoice& choice, const std::string& master_host, bool single_host);

// Where the store that node 0 (or rank 0) serves listens: loopback when every rank is on this
// host; else the master address when it is one of this host's (everyone connects to it), else the
// socket address above. Never 0.0.0.0: a store that answers on every interface answers where
// nobody meant it to.
std::string store_bind_address(const SocketChoice& choice, const std::string& master_host, bool single_host);

}  // namespace shardflow::net
