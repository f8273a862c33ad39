"""pdd.srt.tcp_peers: reading /proc/net/tcp{,6}, on a written table and on real loopback sockets
of this process (a few MB, an address of 127/8 that nothing else uses)."""

from __future__ import annotations

import ipaddress
import socket
import struct
import time
from pathlib import Path

import pytest

from pdd.srt import tcp_peers
from tests.loopback import connection

HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"  # noqa: E501
PEER = ipaddress.ip_address("10.1.2.3")


def row(remote: str, tx_queue: int, inode: int, state: str = "04") -> str:
    return (f"   0: 0100007F:9C40 {remote} {state} {tx_queue:08X}:00000000 01:00000014 00000000"
            f"     0        0 {inode} 1 0000000000000000 20 4 30 10 -1\n")  # fmt: skip


def test_orphaned_bytes_counts_closed_sockets_to_the_peer_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    v4, v6 = tmp_path / "tcp", tmp_path / "tcp6"
    v4.write_text(HEADER + row("0302010A:1F90", 0x2001, 0)  # closed, 8 KiB and its FIN unacked
                  + row("0302010A:1F91", 0x300, 4711)  # open: a lane still writing
                  + row("0302010A:1F92", 1, 0)  # closed, only its FIN unacknowledged
                  + row("0302010A:1F93", 0, 0, "06")  # TIME_WAIT
                  + row("0402010A:1F90", 0x5001, 0))  # closed, another host  # fmt: skip
    v6.write_text(HEADER + row("0000000000000000FFFF00000302010A:1F94", 0x101, 0))  # mapped v4
    monkeypatch.setattr(tcp_peers, "TABLES", (str(v4), str(v6), str(tmp_path / "absent")))
    assert tcp_peers.orphaned_bytes({PEER}) == 0x2000 + 0x100
    assert tcp_peers.orphaned_bytes(set()) == 0


def test_addresses_as_proc_prints_them_and_as_sessions_name_them() -> None:
    assert tcp_peers._address("0100007F") == ipaddress.ip_address("127.0.0.1")
    assert tcp_peers._address("00000000000000000000000001000000") == ipaddress.ip_address("::1")
    assert tcp_peers.peer_addresses("10.1.2.3:17000") == {PEER}
    assert tcp_peers.peer_addresses("[::1]:17000") == {ipaddress.ip_address("::1")}
    assert tcp_peers.peer_addresses("localhost:1") >= {ipaddress.ip_address("127.0.0.1")}
    assert tcp_peers.peer_addresses("no-such-host.invalid:1") == set()


def test_a_closed_socket_with_unsent_bytes_is_seen_until_the_peer_takes_them() -> None:
    host = "127.0.0.77"
    peers = {ipaddress.ip_address(host)}
    with socket.create_server((host, 0)) as server:
        client = socket.create_connection(server.getsockname())
        receiver, _ = server.accept()
        with receiver:
            client.setblocking(False)
            sent = 0
            try:  # until both sides' buffers are full: the receiver reads nothing yet
                while True:
                    sent += client.send(b"\xbb" * (1 << 20))
            except BlockingIOError:
                pass
            client.close()
            assert tcp_peers.orphaned_bytes(peers) > 0
            got = 0
            while got < sent:
                got += len(receiver.recv(1 << 20))
            deadline = time.monotonic() + 5
            while tcp_peers.orphaned_bytes(peers) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert tcp_peers.orphaned_bytes(peers) == 0


def test_reset_on_exit_sets_linger_zero_on_this_process_sockets_to_the_peer() -> None:
    host = "127.0.0.78"
    with (
        socket.create_server((host, 0)) as server,
        socket.create_connection(server.getsockname(), source_address=(host, 0)) as client,
    ):
        accepted, _ = server.accept()
        with accepted:
            assert tcp_peers.reset_on_exit({ipaddress.ip_address("127.0.0.79")}) == 0
            # both ends are this process's, from and to 127.0.0.78
            assert tcp_peers.reset_on_exit({ipaddress.ip_address(host)}) == 2
            for s in (client, accepted):
                linger = s.getsockopt(socket.SOL_SOCKET, socket.SO_LINGER, 8)
                assert struct.unpack("ii", linger) == (1, 0)
            assert client.fileno() >= 0  # the sockets themselves stay open


def test_the_kernels_round_trip_is_read_from_this_processs_connections() -> None:
    host = "127.0.0.78"
    peers = {ipaddress.ip_address(host)}
    assert tcp_peers.min_rtt_s(peers) is None  # no connection yet
    with connection(host) as (client, receiver):
        for _ in range(5):  # a few round trips for the kernel to measure
            client.sendall(b"ping")
            assert receiver.recv(4) == b"ping"
            receiver.sendall(b"pong")
            assert client.recv(4) == b"pong"
        rtt = tcp_peers.min_rtt_s(peers)
    assert rtt is not None and 0 < rtt < 0.05, rtt


def test_the_time_since_a_connection_to_the_peer_last_received_data_is_read() -> None:
    host = "127.0.0.80"
    peers = {ipaddress.ip_address(host)}
    assert tcp_peers.last_received_s(peers) is None  # no connection yet
    with connection(host) as (client, receiver):
        client.sendall(b"kv")
        assert receiver.recv(2) == b"kv"
        fresh = tcp_peers.last_received_s(peers)
        time.sleep(0.5)
        stale = tcp_peers.last_received_s(peers)
    # Both ends are this process's: the freshest of them (the receiver) counts.
    assert fresh is not None and fresh < 0.3, fresh
    assert stale is not None and stale >= 0.45, stale
