"""The PDD control plane: messages between the router and MainDecode (pure), and their ZMQ
transport (`pdd.control.channel`, imported separately so pure users need no zmq)."""

from pdd.control.messages import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Ack,
    CacheSync,
    Cancel,
    Chunk,
    ControlError,
    Error,
    Handoff,
    Message,
    Ready,
    RouteHint,
    SyncRequest,
    decode,
    encode,
    parse_route_hint,
    route_hint,
)

__all__ = [
    "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "Ack",
    "CacheSync",
    "Cancel",
    "Chunk",
    "ControlError",
    "Error",
    "Handoff",
    "Message",
    "Ready",
    "RouteHint",
    "SyncRequest",
    "decode",
    "encode",
    "parse_route_hint",
    "route_hint",
]
