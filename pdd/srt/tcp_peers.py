"""This process's TCP connections to a peer, as the kernel lists them: whether closed ones still
hold bytes for it, the round trip the kernel measured on the open ones, when they last received
data, and making them reset, not drain, when the process exits.

Mooncake's TCP transport owns these sockets; pdd only reads /proc and reads or sets an option
on a duplicate of a socket's descriptor, so no transfer is disturbed. Linux only (as is Mooncake's
TCP transport)."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Iterator

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
# struct tcp_info (linux/tcp.h): u32s at these bytes
LAST_DATA_RECV_OFFSET = 52  # milliseconds since the connection last received data
MIN_RTT_OFFSET = 148  # microseconds
TCP_INFO_BYTES = 152


def peer_addresses(session: str) -> set[Address]:
    """The addresses of a Mooncake session id, "host:port" (SGLang's are "ip:port"); empty when
    the host does not resolve."""
    host = session.rsplit(":", 1)[0].strip("[]")
    try:
        return {ipaddress.ip_address(host)}
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return set()
    return {_plain(ipaddress.ip_address(info[4][0])) for info in infos}


def orphaned_bytes(peers: set[Address]) -> int:
    """Unacknowledged bytes that closed connections of this network namespace (no process holds
    them: inode 0) still hold for `peers`. The kernel goes on sending a closed socket's queue, so
    these bytes can land at the peer after whoever wrote them gave up."""
    # A closed socket's count includes its FIN, one sequence number: data is what is above it.
    return sum(queued - 1 for queued, inode in _sockets(peers) if inode == 0 and queued > 1)


def reset_on_exit(peers: set[Address]) -> int:
    """Makes this process's open connections to `peers` reset when closed (SO_LINGER 0), so that
    when the process exits the kernel drops what they have not sent instead of delivering it.
    Returns how many it set."""
    count = 0
    for dup in _own_sockets(peers):
        with dup:  # closes the duplicate only
            try:
                dup.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:  # closed, or the number reused, since it was listed
                continue
            count += 1
    return count


def min_rtt_s(peers: set[Address]) -> float | None:
    """The lowest round trip the kernel measured on this process's open connections to `peers`
    (TCP_INFO's min_rtt: the path's, without the queueing a busy link adds); None when there
    is no such connection yet."""
    rtts = [rtt for rtt in _tcp_info_u32(peers, MIN_RTT_OFFSET) if rtt]
    return min(rtts) / 1e6 if rtts else None


def last_received_s(peers: set[Address]) -> float | None:
    """Seconds since any of this process's open connections to `peers` last received data
    (the peer is alive and its bytes get through); None without such a connection."""
    ages = _tcp_info_u32(peers, LAST_DATA_RECV_OFFSET)
    return min(ages) / 1e3 if ages else None


def _tcp_info_u32(peers: set[Address], offset: int) -> list[int]:
    """One u32 field of TCP_INFO from each of this process's open connections to `peers`."""
    found = []
    for dup in _own_sockets(peers):
        with dup:
            try:
                info = dup.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES)
            except OSError:
                continue
        if len(info) >= offset + 4:  # older kernels have a shorter tcp_info
            found.append(struct.unpack_from("I", info, offset)[0])
    return found


def _own_sockets(peers: set[Address]) -> Iterator[socket.socket]:
    """A duplicate of each descriptor of this process that is an open TCP socket to `peers`
    (the caller closes it; the original is untouched)."""
    mine = {inode for _, inode in _sockets(peers) if inode}
    if not mine:
        return
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:[") and int(link[8:-1]) in mine:
                yield socket.socket(fileno=os.dup(int(fd)))
        except OSError:  # closed meanwhile
            continue


def _sockets(peers: set[Address]) -> Iterator[tuple[int, int]]:
    """(unacknowledged bytes, inode) of each TCP socket of this network namespace to `peers`."""
    for table in TABLES:
        try:
            with open(table) as f:
                rows = f.readlines()[1:]
        except OSError:  # no IPv6
            continue
        for row in rows:
            fields = row.split()
            if _address(fields[2].split(":")[0]) in peers:
                yield int(fields[4].split(":")[0], 16), int(fields[9])


def _address(hex_address: str) -> Address:
    """An address as /proc/net/tcp prints it: 32-bit words, each in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    return _plain(
        ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))
    )


def _plain(address: Address) -> Address:
    """IPv4 for an IPv4-mapped IPv6 address (a dual-stack socket's view of an IPv4 peer)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address
