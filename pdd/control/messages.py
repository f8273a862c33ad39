"""PDD control-plane messages: typed, versioned, size-limited, optionally HMAC-signed.

Pure code (msgpack + hmac/hashlib only) so the router, the MainDecode plugin and tests share it
without importing zmq or SGLang.

Wire format: `payload` or `payload + tag`, where `payload` is a msgpack map
`{"version": 2, "type": NAME, "ts": unix seconds, "sender": ID, "n": COUNT, "body": {...}}`
and `tag` is the 32-byte HMAC-SHA256 of `payload`, present exactly when the sender has a secret.
A receiver with a secret rejects untagged or badly tagged messages; a receiver without one
rejects tagged ones (they show up as trailing bytes), so a secret configured on one side only
fails loudly. `sender` (random per sending socket) and `n` (counting up from 1) let a receiver
reject replayed and out-of-order messages (pdd.control.replay); under the HMAC they cannot be
forged.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import math
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import urlsplit

import msgpack

PROTOCOL_VERSION = 2
MAX_MESSAGE_BYTES = 1 << 20
MAX_TOKENS = 65536
MAX_TOKEN_ID = 2**31  # exclusive
MAX_RID_CHARS = 128
MAX_REASON_CHARS = 1024
MAX_INT = 2**63 - 1  # byte counts and positions fit an int64
HASH_BYTES = 8
MAX_SYNC_HASHES = 65536  # per CacheSync field: 512 KiB
MAX_EPOCH_CHARS = 64
MAX_BLOCK = 4096
MAX_SENDER_CHARS = 32
TAG_BYTES = hashlib.sha256().digest_size

ROUTE_ACTION = "pdd.route"
ROUTE_ACTION_VERSION = 1
KV_HINTS_PROTOCOL_VERSION = 1  # of the kv_hints envelope the route hint travels in
ROUTE_ROLES = ("prefill", "relay", "main")


class ControlError(ValueError):
    """A control message or route hint was rejected; the text says why."""


@dataclass(frozen=True)
class Ready:
    """MD -> router: the request's KV has landed on MD and it is parked."""

    rid: str
    prompt_len: int
    cached_len: int
    wan_kv_bytes: int
    first_token: int


@dataclass(frozen=True)
class Handoff:
    """Router -> MD: extend `tokens` (output positions start..) and take over decoding."""

    rid: str
    start: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Chunk:
    """Router -> MD (Catch-Up): extend `tokens` (output positions start..), stay parked."""

    rid: str
    start: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Ack:
    """MD -> router: MD now holds KV for the first `done` output tokens."""

    rid: str
    done: int


@dataclass(frozen=True)
class Cancel:
    """Router -> MD: drop the parked request (RLD finished it, or MD was too slow)."""

    rid: str
    reason: str


@dataclass(frozen=True)
class Error:
    """MD -> router: MD cannot serve this request; RLD keeps it."""

    rid: str
    reason: str


@dataclass(frozen=True)
class SyncRequest:
    """Router -> MD: send cache-sync to `reply_to`; the router holds MD's tree as of (epoch, seq).

    Sent at start-up and then periodically: MD answers with a snapshot when the router's view
    is of another epoch (MD restarted) or has a gap, else with an empty CacheSync (a heartbeat).
    """

    reply_to: str
    name: str  # the router's name for this MD, echoed in every CacheSync it gets
    epoch: str
    seq: int


@dataclass(frozen=True)
class CacheSync:
    """MD -> router: what changed in MD's radix tree, as chained hashes of `block`-token blocks
    (pdd.cache.blocks), 8 bytes each. `cleared`: forget everything before applying `added`
    (the first part of a snapshot, or a flushed tree). `seq` counts messages within `epoch`."""

    name: str
    epoch: str
    seq: int
    block: int
    cleared: bool
    added: bytes
    removed: bytes


Message = Ready | Handoff | Chunk | Ack | Cancel | Error | SyncRequest | CacheSync

_TYPES: dict[str, type[Message]] = {
    "ready": Ready,
    "handoff": Handoff,
    "chunk": Chunk,
    "ack": Ack,
    "cancel": Cancel,
    "error": Error,
    "sync_request": SyncRequest,
    "cache_sync": CacheSync,
}
_NAMES: dict[type, str] = {cls: name for name, cls in _TYPES.items()}
_ENVELOPE_KEYS = frozenset({"version", "type", "ts", "sender", "n", "body"})


@dataclass(frozen=True)
class Origin:
    """Who sent a message and its number among that sender's messages (1, 2, ...)."""

    sender: str
    n: int

    @classmethod
    def new_sender(cls) -> Iterator[Origin]:
        """Origins of a fresh sender: a random id, numbers counting up from 1."""
        sender = uuid.uuid4().hex[:16]
        return (cls(sender, n) for n in itertools.count(1))


@dataclass(frozen=True)
class Envelope:
    msg: Message
    origin: Origin
    ts: float  # the sender's clock, unix seconds


# Messages encoded without an explicit origin (tests, one-off tools) share this sender.
_DEFAULT_ORIGINS = Origin.new_sender()


# --- field validation ------------------------------------------------------------------------


def _check_rid(value: object) -> str:
    if not isinstance(value, str):
        raise ControlError(f"rid must be a string, got {type(value).__name__}")
    if not value or len(value) > MAX_RID_CHARS:
        raise ControlError(f"rid must have 1-{MAX_RID_CHARS} characters, got {len(value)}")
    if not value.isprintable():
        raise ControlError("rid must be printable")
    return value


def _check_int(name: str, value: object, low: int = 0, high: int = MAX_INT) -> int:
    # bool is an int subclass; a True where a count belongs is a bug on the sender's side.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ControlError(f"{name} must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise ControlError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def _check_token(name: str, value: object) -> int:
    return _check_int(name, value, 0, MAX_TOKEN_ID - 1)


def _check_tokens(value: object) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise ControlError(f"tokens must be a list, got {type(value).__name__}")
    if not value:
        raise ControlError("tokens must not be empty")
    if len(value) > MAX_TOKENS:
        raise ControlError(f"at most {MAX_TOKENS} tokens, got {len(value)}")
    return tuple(_check_token(f"tokens[{i}]", t) for i, t in enumerate(value))


def _check_reason(value: object) -> str:
    if not isinstance(value, str):
        raise ControlError(f"reason must be a string, got {type(value).__name__}")
    if len(value) > MAX_REASON_CHARS:
        raise ControlError(f"reason longer than {MAX_REASON_CHARS} characters")
    return value


def _check_epoch(value: object) -> str:
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_EPOCH_CHARS:
        raise ControlError(f"epoch must be a string of 1-{MAX_EPOCH_CHARS} characters")
    if not value.isprintable():
        raise ControlError("epoch must be printable")
    return value


def _check_hashes(name: str, value: object) -> bytes:
    if not isinstance(value, bytes):
        raise ControlError(f"{name} must be bytes, got {type(value).__name__}")
    if len(value) % HASH_BYTES or len(value) > MAX_SYNC_HASHES * HASH_BYTES:
        raise ControlError(
            f"{name} must be a multiple of {HASH_BYTES} bytes, at most {MAX_SYNC_HASHES} hashes"
        )
    return value


def _build_sync(cls: type[Message], body: dict[str, Any]) -> Message:
    name = _check_rid(body["name"])  # same rules as a request id
    epoch = _check_epoch(body["epoch"])
    seq = _check_int("seq", body["seq"])
    if cls is SyncRequest:
        return SyncRequest(check_zmq_tcp_address(body["reply_to"]), name, epoch, seq)
    cleared = body["cleared"]
    if not isinstance(cleared, bool):
        raise ControlError(f"cleared must be a bool, got {type(cleared).__name__}")
    return CacheSync(
        name,
        epoch,
        seq,
        _check_int("block", body["block"], 1, MAX_BLOCK),
        cleared,
        _check_hashes("added", body["added"]),
        _check_hashes("removed", body["removed"]),
    )


def _build(cls: type[Message], body: dict[str, Any]) -> Message:
    """Validate a body dict against `cls` and construct it."""
    expected = {f.name for f in fields(cls)}
    if set(body) != expected:
        missing, extra = sorted(expected - set(body)), sorted(set(body) - expected)
        raise ControlError(f"{_NAMES[cls]}: missing fields {missing}, unexpected fields {extra}")
    if cls is SyncRequest or cls is CacheSync:
        return _build_sync(cls, body)
    rid = _check_rid(body["rid"])
    if cls is Ready:
        prompt_len = _check_int("prompt_len", body["prompt_len"], 1)
        cached_len = _check_int("cached_len", body["cached_len"], 0, prompt_len)
        return Ready(
            rid,
            prompt_len,
            cached_len,
            _check_int("wan_kv_bytes", body["wan_kv_bytes"]),
            _check_token("first_token", body["first_token"]),
        )
    if cls is Handoff or cls is Chunk:
        start = _check_int("start", body["start"], 0, MAX_TOKEN_ID - 1)
        return cls(rid, start, _check_tokens(body["tokens"]))
    if cls is Ack:
        return Ack(rid, _check_int("done", body["done"], 0, MAX_TOKEN_ID - 1))
    if cls is Cancel or cls is Error:
        return cls(rid, _check_reason(body["reason"]))
    raise ControlError(f"unknown message class {cls.__name__}")


def validate(msg: Message) -> Message:
    """The message itself if every field is valid (encode checks before sending, too)."""
    if type(msg) not in _NAMES:
        raise ControlError(f"not a control message: {type(msg).__name__}")
    return _build(type(msg), {f.name: getattr(msg, f.name) for f in fields(msg)})


# --- encode / decode -------------------------------------------------------------------------


def _tag(secret: bytes, payload: bytes) -> bytes:
    return hmac.new(secret, payload, hashlib.sha256).digest()


def encode(msg: Message, secret: bytes | None = None, origin: Origin | None = None) -> bytes:
    validate(msg)
    origin = origin or next(_DEFAULT_ORIGINS)
    _check_origin(origin.sender, origin.n)
    body: dict[str, Any] = {}
    for f in fields(msg):
        value = getattr(msg, f.name)
        body[f.name] = list(value) if isinstance(value, tuple) else value
    envelope = {"version": PROTOCOL_VERSION, "type": _NAMES[type(msg)], "ts": time.time(),
                "sender": origin.sender, "n": origin.n}  # fmt: skip
    payload: bytes = msgpack.packb({**envelope, "body": body}, use_bin_type=True)
    data = payload + _tag(secret, payload) if secret else payload
    if len(data) > MAX_MESSAGE_BYTES:
        raise ControlError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return data


def _check_origin(sender: object, n: object) -> None:
    if not isinstance(sender, str) or not 1 <= len(sender) <= MAX_SENDER_CHARS:
        raise ControlError(f"sender must be a string of 1-{MAX_SENDER_CHARS} characters")
    _check_int("n", n, 1)


def _unpack(payload: bytes) -> object:
    try:
        return msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=4 * MAX_REASON_CHARS,
            max_bin_len=MAX_SYNC_HASHES * HASH_BYTES,
            max_array_len=MAX_TOKENS,
            max_map_len=16,
            max_ext_len=0,
        )
    except msgpack.ExtraData as err:
        raise ControlError(
            "trailing bytes after the message (a signed message to a receiver without a secret?)"
        ) from err
    except (ValueError, TypeError, msgpack.UnpackException) as err:
        raise ControlError(f"not a valid msgpack message: {err}") from err


def decode(data: bytes, secret: bytes | None = None) -> Message:
    return open_envelope(data, secret).msg


def open_envelope(data: bytes, secret: bytes | None = None) -> Envelope:
    """The message with its origin and timestamp; ControlError says why it was rejected."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ControlError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > MAX_MESSAGE_BYTES:
        raise ControlError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    if secret:
        if len(data) <= TAG_BYTES:
            raise ControlError("message too short to carry an HMAC tag")
        payload, tag = data[:-TAG_BYTES], data[-TAG_BYTES:]
        if not hmac.compare_digest(tag, _tag(secret, payload)):
            raise ControlError("bad HMAC tag (wrong secret, or an unsigned message)")
    else:
        payload = data
    if not payload:
        raise ControlError("empty message")
    envelope = _unpack(payload)
    if not isinstance(envelope, dict):
        raise ControlError(f"envelope must be a map, got {type(envelope).__name__}")
    if set(envelope) != _ENVELOPE_KEYS:
        raise ControlError(
            f"envelope keys must be {sorted(_ENVELOPE_KEYS)}, got {sorted(envelope)}"
        )
    version = envelope["version"]
    if isinstance(version, bool) or version != PROTOCOL_VERSION:
        raise ControlError(f"unsupported protocol version {version!r} (want {PROTOCOL_VERSION})")
    name = envelope["type"]
    if not isinstance(name, str) or name not in _TYPES:
        raise ControlError(f"unknown message type {name!r}")
    ts = envelope["ts"]
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise ControlError(f"ts must be a number, got {type(ts).__name__}")
    if not math.isfinite(ts):
        raise ControlError("ts must be finite")
    _check_origin(envelope["sender"], envelope["n"])
    body = envelope["body"]
    if not isinstance(body, dict):
        raise ControlError(f"body must be a map, got {type(body).__name__}")
    origin = Origin(envelope["sender"], envelope["n"])
    return Envelope(_build(_TYPES[name], body), origin, float(ts))


# --- the per-request route hint (SGLang's kv_hints envelope) ----------------------------------


@dataclass(frozen=True)
class RouteHint:
    """What the router tells a decode server about one request: its tier, whether to park
    after the KV lands (wait for a handoff) and where to send control messages."""

    role: str
    park: bool
    reply_to: str


def route_hint(*, role: str, park: bool, reply_to: str) -> dict:
    """A `kv_hints` envelope carrying one `pdd.route` action.

    SGLang's envelope types `protocol_version` and `action_version` as strings and rejects
    ints, so the versions travel as "1".
    """
    hint = RouteHint(role, park, reply_to)
    _check_route(hint)
    return {
        "protocol_version": str(KV_HINTS_PROTOCOL_VERSION),
        "message_id": uuid.uuid4().hex,
        "actions": [
            {
                "action_id": uuid.uuid4().hex,
                "action_type": ROUTE_ACTION,
                "action_version": str(ROUTE_ACTION_VERSION),
                "payload": {"role": role, "park": park, "reply_to": reply_to},
            }
        ],
    }


def check_zmq_tcp_address(addr: object) -> str:
    """`tcp://host:port` with a non-empty host and a port in 1-65535."""
    if not isinstance(addr, str):
        raise ControlError(f"reply_to must be a string, got {type(addr).__name__}")
    parts = urlsplit(addr)
    try:
        port = parts.port
    except ValueError as err:
        raise ControlError(f"reply_to {addr!r}: bad port") from err
    if parts.scheme != "tcp" or not parts.hostname or port is None or port == 0:
        raise ControlError(f"reply_to must be tcp://host:port, got {addr!r}")
    if parts.path or parts.query or parts.fragment or parts.username:
        raise ControlError(f"reply_to must be tcp://host:port, got {addr!r}")
    return addr


def _check_route(hint: RouteHint) -> None:
    if hint.role not in ROUTE_ROLES:
        raise ControlError(f"route role must be one of {ROUTE_ROLES}, got {hint.role!r}")
    if not isinstance(hint.park, bool):
        raise ControlError(f"route park must be a bool, got {type(hint.park).__name__}")
    check_zmq_tcp_address(hint.reply_to)


def _get(obj: object, key: str) -> object:
    """A field of a dict (JSON) or of an attribute object (SGLang's msgspec structs)."""
    if isinstance(obj, dict):
        return obj.get(key)
    return getattr(obj, key, None)


def _version_is(value: object, want: int) -> bool:
    if isinstance(value, bool):
        return False
    return value == want or value == str(want)


def parse_route_hint(kv_hints: object) -> RouteHint | None:
    """The `pdd.route` action of a request's kv_hints (dict or SGLang's envelope struct).

    None when there are no hints or no pdd.route action (a plain request); ControlError when the
    envelope or the pdd.route action is malformed.
    """
    if kv_hints is None:
        return None
    if isinstance(kv_hints, str | bytes | int | float | list | tuple):
        raise ControlError(f"kv_hints must be an envelope, got {type(kv_hints).__name__}")
    actions = _get(kv_hints, "actions")
    if actions is None:
        return None
    if not isinstance(actions, list | tuple):
        raise ControlError(f"kv_hints actions must be a list, got {type(actions).__name__}")
    routes = [a for a in actions if _get(a, "action_type") == ROUTE_ACTION]
    if not routes:
        return None
    if len(routes) > 1:
        raise ControlError(f"kv_hints carries {len(routes)} {ROUTE_ACTION} actions, expected 1")
    if not _version_is(_get(kv_hints, "protocol_version"), KV_HINTS_PROTOCOL_VERSION):
        raise ControlError(f"kv_hints protocol_version {_get(kv_hints, 'protocol_version')!r}")
    action = routes[0]
    version = _get(action, "action_version")
    if not _version_is(version, ROUTE_ACTION_VERSION):
        raise ControlError(f"unsupported {ROUTE_ACTION} action_version {version!r}")
    payload = _get(action, "payload")
    if not isinstance(payload, dict):
        raise ControlError(f"{ROUTE_ACTION} payload must be a map, got {type(payload).__name__}")
    keys = {"role", "park", "reply_to"}
    if set(payload) != keys:
        raise ControlError(
            f"{ROUTE_ACTION} payload keys must be {sorted(keys)}, got {sorted(payload)}"
        )
    role, park, reply_to = payload["role"], payload["park"], payload["reply_to"]
    if not isinstance(role, str) or not isinstance(reply_to, str) or not isinstance(park, bool):
        raise ControlError(f"{ROUTE_ACTION} payload has wrong types: {payload!r}")
    hint = RouteHint(role, park, reply_to)
    _check_route(hint)
    return hint
