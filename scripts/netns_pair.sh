#!/bin/sh
# Network namespaces as "hosts" on one machine, with real sockets and links that can be cut. Two
# hosts are joined by one veth pair; three to six hang off a bridge in a switch namespace (NAME-s),
# each by its own veth, so every host has a full-duplex port of its own, as on a switch. Root only.
# Used by tests/test_two_hosts.cpp, bench/two_hosts.py and scripts/soak.py.
#
#   netns_pair.sh up NAME [PREFIX [HOSTS]]  HOSTS (default 2, at most 6) namespaces NAME-a (PREFIX.1),
#                                      NAME-b (PREFIX.2), NAME-c (PREFIX.3) ..., /24, each host's
#                                      interface NAMEa, NAMEb, ...; PREFIX defaults to 10.213.0
#   netns_pair.sh mtu NAME BYTES       the MTU of every host's link (a veth starts at 1500)
#   netns_pair.sh link NAME up|down [HOST]
#                                      takes HOST's end of its link up or down (default b): the
#                                      host cut off, its processes left running
#   netns_pair.sh rate NAME RATE       shapes every link, both directions, to RATE (tc tbf: "1gbit",
#                                      "10gbit", "500mbit"); `rate NAME off` takes the shaping away.
#                                      netem is not in every kernel; tbf is. Measured here: a TCP
#                                      stream between two namespaces reaches 0.95 Gbit/s at 1gbit.
#   netns_pair.sh down NAME            kills every process left in the hosts, removes them (and
#                                      the links, and the switch)
#
# NAME must be at most 14 characters (interface names are at most 15).
set -eu
cmd=${1:?usage: netns_pair.sh up|mtu|link|rate|down NAME}
name=${2:?usage: netns_pair.sh up|mtu|link|rate|down NAME}

# The hosts that exist now, by their letters.
hosts() {
  for h in a b c d e f; do
    ip netns list | grep -q "^$name-$h\b" && printf '%s ' "$h"
  done
  return 0
}
switched() { ip netns list | grep -q "^$name-s\b"; }

case "$cmd" in
  up)
    prefix=${3:-10.213.0}
    count=${4:-2}
    case "$count" in 2|3|4|5|6) ;; *) echo "netns_pair.sh: HOSTS is 2 to 6, not '$count'" >&2; exit 2 ;; esac
    letters=$(echo "a b c d e f" | cut -d' ' -f1-"$count")
    for h in $letters; do ip netns add "$name-$h"; done
    if [ "$count" = 2 ]; then
      ip link add "${name}a" netns "$name-a" type veth peer name "${name}b" netns "$name-b"
    else
      # The switch: a bridge whose ports are the hosts' peers (named port-a ... in its own namespace).
      ip netns add "$name-s"
      ip -n "$name-s" link add sw type bridge
      ip -n "$name-s" link set sw up
      for h in $letters; do
        ip link add "$name$h" netns "$name-$h" type veth peer name "port-$h" netns "$name-s"
        ip -n "$name-s" link set "port-$h" master sw
        ip -n "$name-s" link set "port-$h" up
      done
    fi
    i=1
    for h in $letters; do
      ip -n "$name-$h" addr add "$prefix.$i/24" dev "$name$h"
      ip -n "$name-$h" link set lo up
      ip -n "$name-$h" link set "$name$h" up
      i=$((i + 1))
    done
    ;;
  mtu)
    for h in $(hosts); do
      ip -n "$name-$h" link set "$name$h" mtu "${3:?bytes}"
      if switched; then ip -n "$name-s" link set "port-$h" mtu "$3"; fi
    done
    ;;
  link)
    host=${4:-b}
    ip -n "$name-$host" link set "$name$host" "${3:?up or down}"
    ;;
  rate)
    rate=${3:?rate: a tc rate such as 1gbit, or off}
    # The bucket holds at least one MTU-sized burst per timer tick at this rate (tbf drops what
    # does not fit); 256 KiB is enough up to 10 Gbit/s at a 250 Hz tick. With a switch, each host
    # sends through its own end and receives through its port's: both directions of its link.
    shape() {
      tc -n "$1" qdisc del dev "$2" root 2>/dev/null || true
      [ "$rate" = off ] || tc -n "$1" qdisc add dev "$2" root tbf rate "$rate" burst 256kb latency 100ms
    }
    for h in $(hosts); do
      shape "$name-$h" "$name$h"
      if switched; then shape "$name-s" "port-$h"; fi
    done
    ;;
  down)
    for h in a b c d e f s; do
      if ip netns list | grep -q "^$name-$h\b"; then
        pids=$(ip netns pids "$name-$h" || true)
        [ -n "$pids" ] && kill -9 $pids 2>/dev/null || true
        ip netns del "$name-$h" || true
      fi
    done
    ;;
  *)
    echo "netns_pair.sh: unknown command '$cmd' (up, mtu, link, rate, down)" >&2
    exit 2
    ;;
esac
