"""Control-plane messages: round trips, every rejection path, route hints, and the ZMQ channel."""

from __future__ import annotations

import hashlib
import hmac
import random
import time

import msgpack
import pytest

from pdd.control.messages import (
    MAX_MESSAGE_BYTES,
    MAX_TOKENS,
    PROTOCOL_VERSION,
    Ack,
    Cancel,
    Chunk,
    ControlError,
    Error,
    Handoff,
    Message,
    Origin,
    Ready,
    RouteHint,
    decode,
    encode,
    parse_route_hint,
    route_hint,
)

SECRET = b"s3cret"
MESSAGES: list[Message] = [
    Ready("r1", prompt_len=100, cached_len=90, wan_kv_bytes=123_456, first_token=7),
    Handoff("r1", start=0, tokens=(7, 8, 9)),
    Handoff("r1", start=64, tokens=tuple(range(MAX_TOKENS))),
    Chunk("r-2", start=0, tokens=(0, 2**31 - 1)),
    Ack("r-2", done=64),
    Cancel("abc", reason="RLD finished first"),
    Error("abc", reason=""),
]


def pack(msg_type: str, body: object, version: object = PROTOCOL_VERSION, **extra: object) -> bytes:
    envelope = {"version": version, "type": msg_type, "ts": time.time(), "sender": "t", "n": 1,
                "body": body, **extra}  # fmt: skip
    return msgpack.packb(envelope, use_bin_type=True)


def sign(payload: bytes, secret: bytes = SECRET) -> bytes:
    return payload + hmac.new(secret, payload, hashlib.sha256).digest()


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("secret", [None, SECRET])
def test_round_trip(msg: Message, secret: bytes | None) -> None:
    data = encode(msg, secret)
    assert len(data) <= MAX_MESSAGE_BYTES
    assert decode(data, secret) == msg


def test_handoff_of_100_tokens_is_small() -> None:
    # The design's point: handing over 100 token ids costs ~hundreds of bytes, not KV.
    data = encode(Handoff("0" * 32, 0, tuple(range(50_000, 50_100))), SECRET)
    assert len(data) < 600


@pytest.mark.parametrize(
    "data, secret, reason",
    [
        (encode(MESSAGES[0]), SECRET, "bad HMAC"),  # unsigned, receiver has a secret
        (encode(MESSAGES[0], b"other"), SECRET, "bad HMAC"),  # wrong secret
        (encode(MESSAGES[0], SECRET), None, "trailing bytes"),  # signed, receiver has none
        (encode(MESSAGES[0], SECRET)[:-1], SECRET, "bad HMAC"),  # truncated tag
        (b"\x00" * 10, SECRET, "too short"),
        (b"", None, "empty"),
    ],
)
def test_authentication_rejections(data: bytes, secret: bytes | None, reason: str) -> None:
    with pytest.raises(ControlError, match=reason):
        decode(data, secret)


def test_tampered_payload_is_rejected() -> None:
    data = bytearray(encode(Ack("r1", 5), SECRET))
    data[-40] ^= 0x01  # a byte of the payload, not of the tag
    with pytest.raises(ControlError, match="bad HMAC"):
        decode(bytes(data), SECRET)


def test_oversize_rejected_before_unpacking() -> None:
    with pytest.raises(ControlError, match="exceeds"):
        decode(b"\x91" + b"\x00" * MAX_MESSAGE_BYTES)
    with pytest.raises(ControlError, match="at most"):
        encode(Handoff("r", 0, tuple(range(MAX_TOKENS + 1))))


GOOD_BODY = {"rid": "r1", "done": 3}


@pytest.mark.parametrize(
    "data, reason",
    [
        (pack("ack", GOOD_BODY, version=1), "unsupported protocol version"),
        (pack("ack", GOOD_BODY, version="1"), "unsupported protocol version"),
        (pack("ack", GOOD_BODY, version=True), "unsupported protocol version"),
        (pack("hello", GOOD_BODY), "unknown message type"),
        (pack("ack", {"rid": "r1"}), "missing fields \\['done'\\]"),
        (pack("ack", {**GOOD_BODY, "x": 1}), "unexpected fields \\['x'\\]"),
        (pack("ack", GOOD_BODY, seq=1), "envelope keys"),
        (pack("ack", [1, 2]), "body must be a map"),
        (msgpack.packb([1, 2, 3]), "envelope must be a map"),
        (pack("ack", {"rid": 5, "done": 3}), "rid must be a string"),
        (pack("ack", {"rid": "", "done": 3}), "1-128 characters"),
        (pack("ack", {"rid": "x" * 129, "done": 3}), "1-128 characters"),
        (pack("ack", {"rid": "a\nb", "done": 3}), "printable"),
        (pack("ack", {"rid": "r", "done": -1}), "done must be in"),
        (pack("ack", {"rid": "r", "done": "3"}), "done must be an integer"),
        (pack("ack", {"rid": "r", "done": True}), "done must be an integer"),
        (pack("ack", {"rid": "r", "done": 3.0}), "done must be an integer"),
        (pack("handoff", {"rid": "r", "start": 0, "tokens": []}), "must not be empty"),
        (pack("handoff", {"rid": "r", "start": 0, "tokens": [1, -1]}), "tokens\\[1\\]"),
        (pack("handoff", {"rid": "r", "start": 0, "tokens": [2**31]}), "tokens\\[0\\]"),
        (pack("handoff", {"rid": "r", "start": 0, "tokens": [1.5]}), "tokens\\[0\\]"),
        (pack("handoff", {"rid": "r", "start": 0, "tokens": "abc"}), "tokens must be a list"),
        (pack("chunk", {"rid": "r", "start": -3, "tokens": [1]}), "start must be in"),
        (
            pack("ready", {"rid": "r", "prompt_len": 5, "cached_len": 6, "wan_kv_bytes": 0,
                           "first_token": 1}),
            "cached_len must be in",
        ),  # fmt: skip
        (
            pack("ready", {"rid": "r", "prompt_len": 0, "cached_len": 0, "wan_kv_bytes": 0,
                           "first_token": 1}),
            "prompt_len must be in",
        ),  # fmt: skip
        (pack("cancel", {"rid": "r", "reason": 5}), "reason must be a string"),
        (pack("cancel", {"rid": "r", "reason": "x" * 1500}), "reason longer than"),
        (pack("cancel", {"rid": "r", "reason": "x" * 5000}), "max_str_len"),  # unpack limit
        (pack("ack", GOOD_BODY, ts="now"), "ts must be a number"),
        (pack("ack", GOOD_BODY, ts=float("nan")), "ts must be finite"),
        (pack("ack", GOOD_BODY, sender=""), "sender must be a string"),
        (pack("ack", GOOD_BODY, sender=7), "sender must be a string"),
        (pack("ack", GOOD_BODY, n=0), "n must be in"),
        (pack("ack", GOOD_BODY, n=True), "n must be an integer"),
        (msgpack.packb({1: 2}), "msgpack"),  # integer map keys
        (pack("ack", {"rid": b"r", "done": 1}), "rid must be a string"),  # bytes, not a str
        (encode(Ack("r1", 5))[:-3], "msgpack"),  # truncated
        (b"\xc1", "msgpack"),  # a byte msgpack never uses
        (encode(Ack("r1", 5)) + b"\x00", "trailing bytes"),
    ],
    ids=lambda v: v if isinstance(v, str) else "msg",  # stable ids: the bytes carry a timestamp
)  # fmt: skip
def test_rejections(data: bytes, reason: str) -> None:
    with pytest.raises(ControlError, match=reason):
        decode(data)


def test_too_many_tokens_rejected_by_unpack_limit() -> None:
    body = {"rid": "r", "start": 0, "tokens": [1] * (MAX_TOKENS + 1)}
    with pytest.raises(ControlError):
        decode(pack("handoff", body))


def test_deep_nesting_rejected() -> None:
    nested: object = 1
    for _ in range(200):
        nested = [nested]
    with pytest.raises(ControlError):
        decode(pack("ack", {"rid": "r", "done": nested}))


def test_encode_validates_too() -> None:
    with pytest.raises(ControlError, match="tokens\\[0\\]"):
        encode(Handoff("r", 0, (-1,)))
    with pytest.raises(ControlError, match="rid"):
        encode(Ack("", 1))
    with pytest.raises(ControlError, match="not a control message"):
        encode("hello")  # type: ignore[arg-type]


def test_random_bytes_never_crash() -> None:
    rng = random.Random(1234)
    good = [encode(m) for m in MESSAGES[:2]] + [encode(m, SECRET) for m in MESSAGES[3:]]
    for i in range(3000):
        if i % 2:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 200)))
        else:
            # Bit flips and cuts of valid messages get past the first checks more often.
            flipped = bytearray(rng.choice(good))
            for _ in range(rng.randrange(1, 4)):
                flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            data = bytes(flipped[: rng.randrange(1, len(flipped) + 1)])
        for secret in (None, SECRET):
            try:
                msg = decode(data, secret)
            except ControlError:
                continue
            # Whatever got through is a fully valid message.
            assert decode(encode(msg)) == msg


# --- route hints -------------------------------------------------------------------------------


def test_route_hint_round_trip() -> None:
    hint = route_hint(role="main", park=True, reply_to="tcp://10.0.0.1:7600")
    assert hint["protocol_version"] == "1"
    (action,) = hint["actions"]
    assert action["action_type"] == "pdd.route" and action["action_version"] == "1"
    assert action["payload"] == {"role": "main", "park": True, "reply_to": "tcp://10.0.0.1:7600"}
    assert parse_route_hint(hint) == RouteHint("main", True, "tcp://10.0.0.1:7600")
    other = route_hint(role="main", park=True, reply_to="tcp://10.0.0.1:7600")
    assert other["message_id"] != hint["message_id"]


def test_route_hint_accepted_by_sglang() -> None:
    """SGLang converts kv_hints into its own struct; the hint must survive that, and parse from
    the struct too (that is what MD's plugin sees on `req.kv_hints`)."""
    kv_hints = pytest.importorskip("sglang.srt.managers.kv_hints")
    hint = route_hint(role="main", park=False, reply_to="tcp://127.0.0.1:1234")
    struct = kv_hints.decode_kv_hints_envelope(hint)
    assert parse_route_hint(struct) == RouteHint("main", False, "tcp://127.0.0.1:1234")


def _envelope(payload: object, **action: object) -> dict:
    base = {"action_id": "a", "action_type": "pdd.route", "action_version": "1"}
    return {"protocol_version": "1", "message_id": "m", "actions": [{**base, **action,
            "payload": payload}]}  # fmt: skip


GOOD_PAYLOAD = {"role": "main", "park": True, "reply_to": "tcp://h:1"}


def test_parse_route_hint_absent() -> None:
    assert parse_route_hint(None) is None
    assert parse_route_hint({"protocol_version": "1", "message_id": "m", "actions": []}) is None
    other = _envelope({"x": 1}, action_type="someone.else")
    assert parse_route_hint(other) is None
    assert parse_route_hint(_envelope(GOOD_PAYLOAD)) == RouteHint("main", True, "tcp://h:1")


@pytest.mark.parametrize(
    "kv_hints, reason",
    [
        ("text", "must be an envelope"),
        ({"actions": "x"}, "actions must be a list"),
        (_envelope(GOOD_PAYLOAD, action_version="2"), "action_version"),
        ({**_envelope(GOOD_PAYLOAD), "protocol_version": "9"}, "protocol_version"),
        (_envelope([1]), "payload must be a map"),
        (_envelope({**GOOD_PAYLOAD, "extra": 1}), "payload keys"),
        (_envelope({"role": "main", "park": True}), "payload keys"),
        (_envelope({**GOOD_PAYLOAD, "role": "boss"}), "role must be one of"),
        (_envelope({**GOOD_PAYLOAD, "park": "yes"}), "wrong types"),
        (_envelope({**GOOD_PAYLOAD, "reply_to": "http://h:1"}), "tcp://host:port"),
        (_envelope({**GOOD_PAYLOAD, "reply_to": "tcp://h"}), "tcp://host:port"),
        (_envelope({**GOOD_PAYLOAD, "reply_to": "tcp://h:0"}), "tcp://host:port"),
        (_envelope({**GOOD_PAYLOAD, "reply_to": "tcp://h:99999"}), "bad port"),
        (_envelope({**GOOD_PAYLOAD, "reply_to": "tcp://:5"}), "tcp://host:port"),
        (_envelope({**GOOD_PAYLOAD, "reply_to": "tcp://h:5/x"}), "tcp://host:port"),
        (
            {
                "protocol_version": "1",
                "message_id": "m",
                "actions": _envelope(GOOD_PAYLOAD)["actions"] * 2,
            },
            "2 pdd.route actions",
        ),  # fmt: skip
    ],
)
def test_parse_route_hint_rejections(kv_hints: object, reason: str) -> None:
    with pytest.raises(ControlError, match=reason):
        parse_route_hint(kv_hints)


def test_route_hint_refuses_bad_values() -> None:
    with pytest.raises(ControlError):
        route_hint(role="main", park=True, reply_to="localhost:5")
    with pytest.raises(ControlError):
        route_hint(role="chef", park=True, reply_to="tcp://h:5")


# --- the ZMQ channel (real sockets on loopback) --------------------------------------------------


def _drain(sock: object, want: int, timeout: float = 5.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        got += sock.recv_nowait()  # type: ignore[attr-defined]
        time.sleep(0.01)
    return got


def test_replay_guard_rejects_repeats_reordering_and_stale_messages() -> None:
    from pdd.control.replay import ReplayGuard

    guard = ReplayGuard(window_s=60, max_senders=2)
    now = 1_000_000.0
    a, b, c = Origin("a", 1), Origin("b", 1), Origin("c", 1)
    assert guard.check(a, now, now) is None
    assert "replayed or out of order" in (guard.check(a, now, now) or "")  # the same again
    assert guard.check(Origin("a", 5), now, now) is None  # gaps are fine (other receivers)
    assert "out of order" in (guard.check(Origin("a", 4), now, now) or "")
    assert "stale" in (guard.check(b, now - 61, now) or "")
    assert "skewed clock" in (guard.check(b, now + 61, now) or "")
    assert "outside" in (guard.check(b, float("nan"), now) or "")
    assert guard.check(b, now - 59, now) is None
    assert guard.check(c, now, now) is None  # a third sender: "a", least recently heard, goes
    assert list(guard.last) == ["b", "c"]


def test_channel_rejects_a_replayed_message() -> None:
    zmq = pytest.importorskip("zmq")
    from pdd.control.channel import ControlSocket

    rx = ControlSocket(SECRET)
    raw = zmq.Context.instance().socket(zmq.PUSH)
    try:
        addr = rx.bind("tcp://127.0.0.1:*")
        raw.connect(addr)
        captured = encode(Ack("r", 1), SECRET, Origin("eve", 7))
        later = encode(Ack("r", 2), SECRET, Origin("eve", 8))
        for data in (captured, later, captured, later):  # the last two: replays
            raw.send(data)
        assert _drain(rx, 2) == [Ack("r", 1), Ack("r", 2)]
        deadline = time.monotonic() + 5
        while rx.stats.replayed < 2 and time.monotonic() < deadline:
            rx.recv_nowait()
            time.sleep(0.01)
        assert rx.stats.replayed == 2 and rx.stats.malformed == 2 and rx.stats.received == 2
    finally:
        raw.close(linger=0)
        rx.close()


def test_channel_delivers_and_drops_malformed() -> None:
    zmq = pytest.importorskip("zmq")
    from pdd.control.channel import ControlSocket

    rx, tx = ControlSocket(SECRET), ControlSocket(SECRET)
    try:
        addr = rx.bind("tcp://127.0.0.1:*")
        assert rx.recv_nowait() == []  # nothing queued: returns at once
        for msg in MESSAGES:
            assert tx.send(addr, msg) > 0
        # A stranger without the secret, garbage, and a multipart message are dropped.
        ControlSocket().send(addr, Ack("intruder", 1))
        raw = zmq.Context.instance().socket(zmq.PUSH)
        raw.connect(addr)
        raw.send(b"garbage")
        raw.send_multipart([encode(Ack("x", 1), SECRET), b"more"])
        assert tx.send(addr, Ack("last", 2)) > 0
        got = _drain(rx, len(MESSAGES) + 1)
        assert got == MESSAGES + [Ack("last", 2)]
        deadline = time.monotonic() + 5
        while rx.stats.malformed < 3 and time.monotonic() < deadline:
            rx.recv_nowait()
            time.sleep(0.01)
        assert rx.stats.malformed == 3
        assert rx.stats.received == len(MESSAGES) + 1
        raw.close(linger=0)
    finally:
        rx.close()
        tx.close()


def test_send_to_dead_peer_never_blocks() -> None:
    pytest.importorskip("zmq")
    from pdd.control.channel import ControlSocket

    tx = ControlSocket(hwm=10)
    try:
        start = time.monotonic()
        results = [tx.send("tcp://127.0.0.1:9", Ack("r", i)) for i in range(100)]
        assert time.monotonic() - start < 2.0
        assert results.count(0) >= 80  # beyond the high-water mark: dropped, not blocked
        assert tx.stats.dropped == results.count(0)
        assert tx.send("not-an-address", Ack("r", 1)) == 0
        # An invalid message is dropped too, not raised into the sender's loop.
        dropped = tx.stats.dropped
        assert tx.send("tcp://127.0.0.1:9", Ready("r", 5, 6, 0, 1)) == 0
        assert tx.stats.dropped == dropped + 1
    finally:
        tx.close()
