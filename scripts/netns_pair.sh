#!/bin/sh
# Two network namespaces joined by a veth pair: two "hosts" on one machine, with real sockets and
# a link that can be cut. Root only. Used by tests/test_two_hosts.cpp and bench/two_hosts.sh.
#
#   netns_pair.sh up NAME [PREFIX]     namespaces NAME-a (PREFIX.1) and NAME-b (PREFIX.2), /24,
#                                      interfaces NAMEa / NAMEb; PREFIX defaults to 10.213.0
#   netns_pair.sh mtu NAME BYTES       the link's MTU on both ends (a veth starts at 1500)
#   netns_pair.sh link NAME up|down    takes host b's end of the link up or down
#   netns_pair.sh rate NAME RATE       shapes both ends of the link to RATE (tc tbf: "1gbit", "10gbit",
#                                      "500mbit"); `rate NAME off` takes the shaping away. netem is not
#                                      in every kernel; tbf is. Measured here: a TCP stream between the
#                                      namespaces reaches 0.95 Gbit/s at 1gbit.
#   netns_pair.sh down NAME            kills every process left in both, removes them (and the link)
#
# NAME must be at most 14 characters (interface names are at most 15).
set -eu
cmd=${1:?usage: netns_pair.sh up|mtu|link|rate|down NAME}
name=${2:?usage: netns_pair.sh up|mtu|link|rate|down NAME}
case "$cmd" in
  up)
    prefix=${3:-10.213.0}
    ip netns add "$name-a"
    ip netns add "$name-b"
    ip link add "${name}a" netns "$name-a" type veth peer name "${name}b" netns "$name-b"
    ip -n "$name-a" addr add "$prefix.1/24" dev "${name}a"
    ip -n "$name-b" addr add "$prefix.2/24" dev "${name}b"
    for h in a b; do
      ip -n "$name-$h" link set lo up
      ip -n "$name-$h" link set "$name$h" up
    done
    ;;
  mtu)
    ip -n "$name-a" link set "${name}a" mtu "${3:?bytes}"
    ip -n "$name-b" link set "${name}b" mtu "$3"
    ;;
  link)
    ip -n "$name-b" link set "${name}b" "${3:?up or down}"
    ;;
  rate)
    rate=${3:?rate: a tc rate such as 1gbit, or off}
    for h in a b; do
      tc -n "$name-$h" qdisc del dev "$name$h" root 2>/dev/null || true
      # The bucket holds at least one MTU-sized burst per timer tick at this rate (tbf drops what
      # does not fit); 256 KiB is enough up to 10 Gbit/s at a 250 Hz tick.
      [ "$rate" = off ] || tc -n "$name-$h" qdisc add dev "$name$h" root tbf rate "$rate" burst 256kb latency 100ms
    done
    ;;
  down)
    for h in a b; do
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
