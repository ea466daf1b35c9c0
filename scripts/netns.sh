#!/bin/sh
# Hosts on one machine, for running servelm "across hosts" without a second machine: each
# host a network namespace with its own address on a bridge, which this (the root)
# namespace also joins, so that a client here reaches every host.
#
#   scripts/netns.sh up [N]      N hosts (default 2): servelm-h1 (10.77.0.1) ... servelm-hN,
#                                this namespace 10.77.0.254 on bridge servelm-br0
#   scripts/netns.sh down        remove them
#   scripts/netns.sh run K CMD   run CMD on host K (ip netns exec servelm-hK CMD)
#
# Needs root (or CAP_NET_ADMIN) and iproute2. A host's processes see only its own network:
# loopback and its 10.77.0.K address; the filesystem (and so /dev/shm) is still shared, so
# pass --no-kv-transfer-shm where a KV transfer must cross the network.
set -eu
PREFIX=servelm-h
BRIDGE=servelm-br0
NET=10.77.0

up() {
    n=${1:-2}
    down >/dev/null 2>&1 || true
    ip link add "$BRIDGE" type bridge
    ip addr add "$NET.254/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    k=1
    while [ "$k" -le "$n" ]; do
        ns="$PREFIX$k"
        ip netns add "$ns"
        ip link add "svh$k" type veth peer name "svh$k-in"
        ip link set "svh$k" master "$BRIDGE"
        ip link set "svh$k" up
        ip link set "svh$k-in" netns "$ns"
        ip -n "$ns" link set "svh$k-in" name eth0
        ip -n "$ns" addr add "$NET.$k/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        k=$((k + 1))
    done
    echo "hosts: $(ip netns list | grep -o "^$PREFIX[0-9]*" | sort | tr '\n' ' ')(${NET}.1-${NET}.$n); this namespace: $NET.254"
}

down() {
    for ns in $(ip netns list | grep -o "^$PREFIX[0-9]*"); do
        ip netns del "$ns"
    done
    # A namespace a process still holds outlives its name: its veth's outer end is removed
    # here, so the next `up` starts clean.
    for link in $(ip -o link show | grep -o "svh[0-9]*@" | tr -d @); do
        ip link del "$link" 2>/dev/null || true
    done
    if ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link del "$BRIDGE"
    fi
}

case "${1:-}" in
    up) shift; up "$@" ;;
    down) down ;;
    run) shift; k=$1; shift; exec ip netns exec "$PREFIX$k" "$@" ;;
    *) echo "usage: $0 up [N] | down | run K CMD..." >&2; exit 2 ;;
esac
