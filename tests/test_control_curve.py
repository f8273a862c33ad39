"""The CURVE-encrypted control plane over real ZMQ sockets (no servers): keys from the secret,
encrypted round trips, peers without the keys kept out, the flags, and how a mismatch shows."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq

from pdd.control.channel import AsyncControlSocket, ControlSocket
from pdd.control.curve import CurveKeys, Role
from pdd.control.messages import Ack, CacheSync, Chunk, Message, Ready
from pdd.control.secret import ENV_SECRET
from pdd.router import config as router_config
from pdd.router.md_caches import MdCaches
from pdd.srt.flags import ENV_CONTROL_ENCRYPT, PddConfig, add_args, config_from_args

SECRET = b"0123456789abcdef0123456789abcdef"
READY = Ready("rid-visible", prompt_len=100, cached_len=0, wan_kv_bytes=1, first_token=7)


def endpoint(role: Role, curve_secret: bytes | None = SECRET) -> ControlSocket:
    """A sync endpoint of `role`: HMAC with SECRET, CURVE keys from `curve_secret` (None: off),
    so a test can give a peer the right HMAC secret and still the wrong CURVE keys."""
    keys = None if curve_secret is None else CurveKeys.derive(curve_secret, role)
    return ControlSocket(SECRET, curve=keys)


def drain(sock: ControlSocket, want: int, timeout: float = 5.0) -> list[Message]:
    got: list[Message] = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        got += sock.recv_nowait()
        time.sleep(0.01)
    return got


def test_keys_derive_from_the_secret_and_each_side_knows_the_others() -> None:
    router, md = CurveKeys.derive(SECRET, "router"), CurveKeys.derive(SECRET, "md")
    assert router == CurveKeys.derive(SECRET, "router")  # deterministic: nothing to distribute
    assert router.peer_public == md.public and md.peer_public == router.public
    assert router.public != md.public and len(router.secret) == len(router.public) == 40
    assert zmq.curve_public(router.secret) == router.public
    other = CurveKeys.derive(b"another secret", "router")
    assert other.public != router.public and other.peer_public != router.peer_public
    with pytest.raises(ValueError, match="control secret"):
        CurveKeys.derive(None, "md")


def test_encrypted_round_trip_between_md_and_the_router() -> None:
    async def run() -> None:
        router = AsyncControlSocket(SECRET, curve=CurveKeys.derive(SECRET, "router"))
        md = endpoint("md")
        try:
            router_addr = router.bind("tcp://127.0.0.1:*")
            md_addr = md.bind("tcp://127.0.0.1:*")
            chunk = Chunk("r1", start=0, tokens=tuple(range(64)))
            assert router.send(md_addr, chunk) > 0
            deadline = time.monotonic() + 5
            got: list[Message] = []
            while not got and time.monotonic() < deadline:
                got = md.recv_nowait()
                await asyncio.sleep(0.01)
            assert got == [chunk]
            assert md.send(router_addr, READY) > 0
            received = await asyncio.wait_for(router.recv(), 5)
            assert received.msg == READY and router.stats.received == 1
            assert md.socket.getsockopt(zmq.MECHANISM) == zmq.CURVE
        finally:
            router.close()
            md.close()

    asyncio.run(run())


@contextmanager
def tap(target: str) -> Iterator[tuple[str, bytearray]]:
    """A TCP relay to `target` that keeps every byte the client sends: what the WAN sees."""
    host, port = target.removeprefix("tcp://").rsplit(":", 1)
    listener = socket.create_server(("127.0.0.1", 0))
    seen = bytearray()

    def pump(src: socket.socket, dst: socket.socket, keep: bool) -> None:
        try:
            while data := src.recv(65536):
                if keep:
                    seen.extend(data)
                dst.sendall(data)
        except OSError:  # the other side closed
            pass

    def serve() -> None:
        try:
            client, _ = listener.accept()
        except OSError:  # closed before anyone connected
            return
        server = socket.create_connection((host, int(port)))
        for args in ((client, server, True), (server, client, False)):
            threading.Thread(target=pump, args=args, daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"tcp://127.0.0.1:{listener.getsockname()[1]}", seen
    finally:
        listener.close()


@pytest.mark.parametrize("encrypt", [False, True], ids=["hmac-only", "curve"])
def test_what_the_wire_carries(encrypt: bool) -> None:
    curve = SECRET if encrypt else None
    rx, tx = endpoint("router", curve), endpoint("md", curve)
    try:
        with tap(rx.bind("tcp://127.0.0.1:*")) as (addr, seen):
            assert tx.send(addr, READY) > 0
            assert drain(rx, 1) == [READY]
        # HMAC alone authenticates but shows the request id to whoever watches; CURVE does not.
        assert (b"rid-visible" in seen) is not encrypt
        assert (b"CURVE" in seen) is encrypt  # the mechanism ZMTP's greeting names
    finally:
        rx.close()
        tx.close()


@pytest.mark.parametrize(
    "stranger",
    [
        pytest.param(lambda: endpoint("md", b"another secret"), id="wrong-key"),
        pytest.param(lambda: endpoint("md", None), id="plaintext"),
    ],
)
def test_a_peer_without_the_keys_gets_nothing_through(stranger: object) -> None:
    rx, friend, intruder = endpoint("router"), endpoint("md"), stranger()  # type: ignore[operator]
    try:
        addr = rx.bind("tcp://127.0.0.1:*")
        start = time.monotonic()
        for i in range(1, 21):
            intruder.send(addr, Ack("intruder", i))  # same HMAC secret: only CURVE stops it
        assert time.monotonic() - start < 1.0  # queued or dropped, never blocking
        assert drain(rx, 1, timeout=0.5) == []
        assert friend.send(addr, READY) > 0  # the receiver goes on serving everyone else
        assert drain(rx, 1) == [READY]
        assert drain(rx, 1, timeout=0.3) == [] and rx.stats.malformed == 0
    finally:
        for sock in (rx, friend, intruder):
            sock.close()


def test_an_encrypting_sender_to_a_plaintext_receiver_gets_nothing_through() -> None:
    rx, tx, plain = endpoint("router", None), endpoint("md"), endpoint("md", None)
    try:
        addr = rx.bind("tcp://127.0.0.1:*")
        assert tx.send(addr, READY) > 0  # queued; the handshake never completes
        assert drain(rx, 1, timeout=0.5) == []
        assert plain.send(addr, READY) > 0
        assert drain(rx, 1) == [READY]
    finally:
        for sock in (rx, tx, plain):
            sock.close()


def parse_md(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--disaggregation-mode", default="decode")
    add_args(parser)
    return parser.parse_args(["--pdd-role", "main", "--pdd-control-port", "7500", *argv])


def test_md_flag_needs_the_secret_and_reaches_the_scheduler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_SECRET, raising=False)
    with pytest.raises(SystemExit, match="--pdd-control-encrypt derives.*--pdd-secret-file"):
        config_from_args(parse_md("--pdd-control-encrypt"))
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    assert config_from_args(parse_md("--pdd-secret-file", str(secret))).curve() is None
    config = config_from_args(parse_md("--pdd-secret-file", str(secret), "--pdd-control-encrypt"))
    config.to_env()  # the scheduler processes read it back from the environment
    try:
        assert PddConfig.from_env() == config
        assert config.curve() == CurveKeys.derive(SECRET, "md")
    finally:
        monkeypatch.delenv(ENV_CONTROL_ENCRYPT, raising=False)


def parse_router(*argv: str) -> argparse.Namespace:
    parser = router_config.build_parser(argparse.ArgumentParser())
    return parser.parse_args(["--prefill", "http://10.0.0.1:30000", "8998",
                              "--main", "http://10.0.0.2:30002", "7500", *argv])  # fmt: skip


def test_router_flag_needs_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_SECRET, raising=False)
    assert router_config.config_from_args(parse_router()).curve() is None
    with pytest.raises(ValueError, match="--control-encrypt derives.*--secret-file"):
        router_config.config_from_args(parse_router("--control-encrypt"))
    monkeypatch.setenv(ENV_SECRET, SECRET.decode())
    keys = router_config.config_from_args(parse_router("--control-encrypt")).curve()
    assert keys == CurveKeys.derive(SECRET, "router")


def test_a_libzmq_without_curve_is_refused_at_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(zmq, "has", lambda capability: capability != "curve")
    monkeypatch.setenv(ENV_SECRET, SECRET.decode())
    with pytest.raises(ValueError, match="built without CURVE"):
        router_config.config_from_args(parse_router("--control-encrypt"))
    with pytest.raises(SystemExit, match="built without CURVE"):
        config_from_args(parse_md("--pdd-control-encrypt"))
    assert router_config.config_from_args(parse_router()).curve() is None  # off: no need


def test_a_silent_md_is_reported_with_the_encryption_switch_as_a_cause(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="pdd.router.md_caches")
    clock = [0.0]
    md = "tcp://10.0.0.2:7500"
    caches = MdCaches([md], lambda addr, msg: 1, "tcp://10.0.0.1:7600", 5.0, now=lambda: clock[0])
    caches.report_silence(md)
    assert caches.silence(md) == "" and not caplog.records
    clock[0] = 16.0  # three intervals without a cache sync: what a mismatch looks like
    caches.report_silence(md)
    caches.report_silence(md)
    [record] = caplog.records  # once, not at every round
    assert "--control-encrypt / --pdd-control-encrypt" in record.getMessage()
    assert caches.status()[md]["silent"] and "for 16s" in caches.silence(md)
    caches.on_sync(CacheSync(md, "e", 1, 16, True, b"", b""))
    caches.report_silence(md)
    assert caches.silence(md) == "" and not caches.status()[md]["silent"]
    assert "answers again" in caplog.records[-1].getMessage()
