"""CURVE keys for an encrypted control plane, derived from the control secret.

ZeroMQ's CURVE (CurveZMQ) encrypts a connection and authenticates its server: each receiving
PULL socket is a CURVE server, each sending PUSH a client that must know the server's public
key. Router and MD already share the control secret, so each role's keypair is a keyed hash of
that secret and its role's name: nothing new to distribute, and a peer with another secret
derives another server key and fails the handshake. Whoever holds the secret can derive every
key; that is no weaker than the secret itself, which already lets one forge any message.

The HMAC envelopes and the replay guard stay on top: CURVE authenticates a connection, they
authenticate each message's origin and order (pdd.control.messages, pdd.control.replay).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Literal

import zmq
from zmq.utils import z85

from pdd.control.secret import ENV_SECRET

Role = Literal["router", "md"]
# Versioned, so a future derivation cannot collide with this one's keys.
LABEL = b"pdd-control-curve-v1:"


@dataclass(frozen=True)
class CurveKeys:
    """One side's keypair (its PULL's server key, its PUSHes' client key) and the public key
    of the peers it sends to (their PULLs' server key). Keys are z85, 40 bytes."""

    public: bytes
    secret: bytes
    peer_public: bytes

    @classmethod
    def derive(cls, shared: bytes | None, role: Role) -> CurveKeys:
        """`role`'s keys from the control secret `shared` (flags check both errors first)."""
        if not shared:
            raise ValueError("CURVE keys derive from the control secret, and there is none")
        if not zmq.has("curve"):
            raise RuntimeError(_NO_CURVE)
        peer: Role = "md" if role == "router" else "router"
        secret = _secret_key(shared, role)
        return cls(zmq.curve_public(secret), secret, zmq.curve_public(_secret_key(shared, peer)))

    def serve(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE server (before it binds): plaintext and wrong-key peers fail the
        handshake, so nothing of theirs reaches recv."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)

    def client(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE client of the peer role's server (before it connects)."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.peer_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)


def _secret_key(shared: bytes, role: Role) -> bytes:
    # Any 32 bytes are a valid Curve25519 secret key (the library clamps them).
    return z85.encode(hmac.new(shared, LABEL + role.encode(), hashlib.sha256).digest())


_NO_CURVE = (
    f"this pyzmq's libzmq {zmq.zmq_version()} was built without CURVE (zmq.has('curve') is "
    "False): install a pyzmq wheel (it bundles libzmq with CURVE) or a libzmq built with "
    "libsodium"
)


def encrypt_problem(secret: bytes | None, flags: tuple[str, str]) -> str:
    """Why the control plane cannot be encrypted as asked, or "". `flags` names the encrypt
    flag and the secret's flag."""
    encrypt_flag, secret_flag = flags
    if secret is None:
        return (
            f"{encrypt_flag} derives its keys from the control secret: give {secret_flag} "
            f"(or ${ENV_SECRET}), the same on the router and on MD"
        )
    if not zmq.has("curve"):
        return f"{encrypt_flag}: {_NO_CURVE}"
    return ""
