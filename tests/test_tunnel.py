"""The WAN leg inside WireGuard (pdd.launch.tunnel) on a real testbed: what crosses the link is
encrypted, and Mooncake's KV writes reach B intact through it.

A raw socket on B's end of the WAN link sees every packet the link delivers: bytes sent inside
the tunnel must not appear there in clear, while the same bytes sent on the bare WAN do (so the
capture would have caught them)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from pdd.eval.bench_wan_mooncake import transfer
from pdd.launch import netns, tunnel
from pdd.launch.testbed import WAN_DEVICE, Testbed
from pdd.launch.wan import LinkParams
from tests.marks import needs_root

pytestmark = needs_root
MARKER = b"pdd-kv-in-clear:"
PAYLOAD = MARKER * (1 << 16)  # 1 MiB
ETH_P_ALL = 0x0003
SO_RCVBUFFORCE = 33  # linux/socket.h; Python does not name it


@pytest.fixture(scope="module")
def tunnelled() -> Iterator[Testbed]:
    why = tunnel.missing()
    if why is not None:
        pytest.fail(f"the tunnel test needs WireGuard, which launch/setup.sh installs: {why}")
    tb = Testbed("pddtun", LinkParams(200.0, 5.0), net="10.245", tunnel=True)
    tb.down()
    tb.up()
    try:
        yield tb
    finally:
        tb.down()


def captured_while_sending(tb: Testbed, to: str) -> bytes:
    """Every packet B's end of the link received while PAYLOAD went from A to `to` over TCP."""
    with netns.entered(tb.ns("b")):
        tap = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        server = socket.create_server((to, 0))
    tap.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)  # lose no packet
    tap.bind((WAN_DEVICE, 0))
    tap.settimeout(0.2)
    got: list[bytes] = []
    frames: list[bytes] = []
    done = threading.Event()

    def capture() -> None:
        # Until the socket is drained after the transfer: under load this thread lags behind
        # the frames queued for it, and they all count.
        while True:
            try:
                frames.append(tap.recv(1 << 16))
            except TimeoutError:
                if done.is_set():
                    return

    def receive() -> None:
        conn, _ = server.accept()
        with conn:
            while chunk := conn.recv(1 << 20):
                got.append(chunk)

    threads = [threading.Thread(target=f, daemon=True) for f in (capture, receive)]
    for t in threads:
        t.start()
    with netns.entered(tb.ns("a")):
        client = socket.create_connection(server.getsockname(), timeout=30)
    with client:
        client.sendall(PAYLOAD)
    threads[1].join(timeout=30)
    done.set()
    threads[0].join(timeout=5)
    tap.close()
    server.close()
    assert b"".join(got) == PAYLOAD
    return b"".join(frames)


def test_bytes_in_the_tunnel_cross_the_link_encrypted(tunnelled: Testbed) -> None:
    inside = captured_while_sending(tunnelled, tunnelled.ip("b"))
    assert tunnelled.ip("b") == tunnel.address(tunnelled.net, "b") != tunnelled.wan_ip("b")
    assert len(inside) >= len(PAYLOAD), "the capture missed packets"
    assert MARKER not in inside
    bare = captured_while_sending(tunnelled, tunnelled.wan_ip("b"))
    assert MARKER in bare, "the capture cannot see cleartext: the check above proves nothing"


def test_mooncake_writes_kv_through_the_tunnel(tunnelled: Testbed) -> None:
    results = transfer(tunnelled, 8 << 20, flows="auto", warm_rounds=1)
    assert results and all(r.intact for r in results), results
    assert tunnel.cpu_seconds(tunnelled) > 0  # wireguard-go carried it
