"""The state of one request through the tiers, the events its task consumes, and what the
client gets (`meta_info["pdd"]`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from pdd.router.upstream import UpstreamError

ROOM_LIMIT = 2**62  # rooms travel as int64; stay well inside it
MAX_REASON = 1000
TIER_NAMES = {"relay": "RLD", "main": "MD"}


class MdState(Enum):
    UNUSED = "unused"  # the path does not hand off to MD
    PENDING = "pending"  # waiting for READY
    CATCHUP = "catchup"  # a Catch-Up chunk is in flight
    HANDED_OFF = "handed_off"
    DEAD = "dead"  # failed, timed out or cancelled; RLD serves the request


class RelayState(Enum):
    UNUSED = "unused"
    RUNNING = "running"
    STOPPED = "stopped"  # we stopped it at the handoff
    FINISHED = "finished"  # it finished the request
    DEAD = "dead"


@dataclass(frozen=True)
class StreamChunk:
    source: str  # "relay" | "main"
    chunk: dict[str, Any]
    rid: str  # the call's request id: a resumed side's old call must not count


@dataclass(frozen=True)
class StreamEnd:
    source: str
    error: UpstreamError | None
    rid: str


@dataclass(frozen=True)
class PrefillDone:
    which: str  # "p" (room R, or the only one on P->MD) | "p2" (room R2, for MD)
    error: UpstreamError | None
    cached_tokens: int | None = None  # P's radix-cache hit, as P reports it


@dataclass(frozen=True)
class Output:
    chunk: dict[str, Any]
    final: bool = False
    failed: bool = False  # the final chunk reports a failure after output had begun


@dataclass
class PddMeta:
    """`meta_info["pdd"]` of the client's final chunk."""

    path: str
    path_reason: str
    rid: str
    relay_tokens: int = 0
    main_tokens: int = 0
    handoff_mode: str | None = None
    chunks: int = 0
    handoff_latency_s: float | None = None
    wan_kv_bytes: int | None = None
    md_cached_tokens: int | None = None
    # What the router's mirror of MD's cache predicted before sending (block granularity).
    md_predicted_cached_tokens: int | None = None
    md_prompt_tokens: int | None = None
    p_cached_tokens: int | None = None
    control_bytes: int = 0
    md_failure: str | None = None
    relay_failure: str | None = None
    # The side feeding the client failed and the other finished the request ("RLD" or "MD"):
    # the tokens the client had then.
    resumed_at: int | None = None
    resumed_on: str | None = None
    instances: dict[str, str] = field(default_factory=dict)
    # The request's states (pdd.router.request_machine), each with the second it began.
    states: list[tuple[str, float]] = field(default_factory=list)
    # Seconds since the router received the request.
    timings: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cut(reason: str) -> str:
    return reason if len(reason) <= MAX_REASON else reason[: MAX_REASON - 3] + "..."
