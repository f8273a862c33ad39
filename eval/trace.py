"""Request traces as JSONL files: ours, and import of users' own.

Why a file: the simulator, the live harness and other people's tools should replay the very
same requests, and a user's production trace should drive the same code as a generated one.

Our format ("pdd-trace", version 1). The first line is a header, then one request per line:
    {"format": "pdd-trace", "v": 1, "requests": 2000, "meta": {"config": {...}}}
    {"id": 0, "session": 0, "turn": 0, "arrival_s": 0.41, "prompt_tokens": 5210,
     "cached_tokens": 0, "output_tokens": 96, "singular": false,
     "segments": [[4294967297, 5100], [4294967301, 110]]}
`cached_tokens` is the prefix shared with earlier requests of the trace. `segments`, optional,
is the token recipe: (seed, length) pairs, each the first `length` tokens of random stream
`seed` (see pdd.eval.workload.materialize); a request without it can be simulated, not sent.
Requests are in arrival order; unknown fields are errors, so a typo cannot pass unnoticed.

User traces (`import_trace`), JSONL, one request per line, unknown fields ignored:
- prompt length: "prompt_tokens" or "input_length" (required);
- output length: "output_tokens" or "output_length" (required);
- arrival: "timestamp" in milliseconds (Mooncake's convention) or "arrival_s" in seconds; on
  every line or on none (then all arrive at 0: replay them at a rate or a concurrency);
- "session_id" (any string or number), "cached_tokens", "singular" (bool), all optional;
- "hash_ids": Mooncake's block hashes, one per `block_size` (512) tokens, the last block
  partial: {"timestamp": 27482, "input_length": 6955, "output_length": 52,
  "hash_ids": [46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59]}
Cached tokens then come, in this order of preference, from: hash_ids (the leading blocks that
earlier requests already had; a given cached_tokens is ignored), cached_tokens as given (no
token recipe), session_id (each turn is assumed to extend its session's previous prompt), or
nothing (no sharing). Lines are sorted by arrival; without a "singular" field a request is
singular when its output is 4 tokens or fewer and its hit below 50%.
Format "mooncake" is the same reader requiring timestamp, input_length, output_length and
hash_ids on every line; "auto" picks "pdd" when the first line is our header, else "simple".
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdd.eval.workload import PrefixTrie, Segment, TraceRequest, is_singular_like

FORMAT = "pdd-trace"
VERSION = 1
FORMATS = ("auto", "pdd", "simple", "mooncake")
BLOCK_SIZE = 512  # Mooncake's hash block, in tokens

_FIELDS = (
    "id",
    "session",
    "turn",
    "arrival_s",
    "prompt_tokens",
    "cached_tokens",
    "output_tokens",
    "singular",
    "segments",
)


class TraceError(ValueError):
    """A trace file that cannot be read, with the place: path:line: field: problem."""


def _int(obj: dict[str, Any], key: str, where: str, minimum: int = 0) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(f"{where}: field {key!r} must be an integer, got {value!r}")
    if value < minimum:
        raise TraceError(f"{where}: field {key!r} must be >= {minimum}, got {value}")
    return value


def _number(obj: dict[str, Any], key: str, where: str) -> float:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TraceError(f"{where}: field {key!r} must be a finite number, got {value!r}")
    return float(value)


def _first(obj: dict[str, Any], keys: Sequence[str], where: str) -> str:
    for key in keys:
        if key in obj:
            return key
    raise TraceError(f"{where}: missing field {' or '.join(repr(k) for k in keys)}")


def _lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line; bad JSON names its line."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise TraceError(f"{path}:{number}: not JSON: {err}") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{path}:{number}: expected a JSON object, got {obj!r:.60}")
            yield number, obj


def request_to_json(req: TraceRequest) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "id": req.id,
        "session": req.session,
        "turn": req.turn,
        "arrival_s": req.arrival_s,
        "prompt_tokens": req.prompt_tokens,
        "cached_tokens": req.cached_tokens,
        "output_tokens": req.output_tokens,
        "singular": req.singular,
    }
    if req.segments is not None:
        obj["segments"] = [list(s) for s in req.segments]
    return obj


def request_from_json(obj: dict[str, Any], where: str) -> TraceRequest:
    """A request of our format, every field checked; errors start with `where`."""
    unknown = sorted(set(obj) - set(_FIELDS))
    if unknown:
        raise TraceError(f"{where}: unknown field {unknown[0]!r}")
    for key in _FIELDS[:-1]:
        if key not in obj:
            raise TraceError(f"{where}: missing field {key!r}")
    prompt = _int(obj, "prompt_tokens", where, 1)
    cached = _int(obj, "cached_tokens", where)
    if cached > prompt:
        raise TraceError(f"{where}: field 'cached_tokens' {cached} exceeds prompt_tokens {prompt}")
    arrival = _number(obj, "arrival_s", where)
    if arrival < 0:
        raise TraceError(f"{where}: field 'arrival_s' must be >= 0, got {arrival}")
    if not isinstance(obj["singular"], bool):
        raise TraceError(
            f"{where}: field 'singular' must be true or false, got {obj['singular']!r}"
        )
    return TraceRequest(
        id=_int(obj, "id", where),
        session=_int(obj, "session", where),
        turn=_int(obj, "turn", where),
        arrival_s=arrival,
        prompt_tokens=prompt,
        cached_tokens=cached,
        output_tokens=_int(obj, "output_tokens", where, 1),
        singular=obj["singular"],
        segments=_segments(obj.get("segments"), prompt, where),
    )


def _segments(value: Any, prompt: int, where: str) -> tuple[Segment, ...] | None:
    if value is None:
        return None
    bad = TraceError(f"{where}: field 'segments' must be a list of [seed, length] integer pairs")
    if not isinstance(value, list):
        raise bad
    out: list[Segment] = []
    for pair in value:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise bad
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in pair):
            raise bad
        if pair[0] < 0 or pair[1] < 1:
            raise TraceError(f"{where}: field 'segments': seeds must be >= 0, lengths >= 1")
        out.append((pair[0], pair[1]))
    total = sum(n for _, n in out)
    if total != prompt:
        raise TraceError(f"{where}: field 'segments' add up to {total}, prompt_tokens is {prompt}")
    return tuple(out)


def write_trace(
    path: str | Path, requests: Sequence[TraceRequest], meta: dict[str, Any] | None = None
) -> None:
    """Writes header + requests; via a temporary file, so a reader never sees half a trace."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    header = {"format": FORMAT, "v": VERSION, "requests": len(requests), "meta": meta or {}}
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(header) + "\n")
        for req in requests:
            f.write(json.dumps(request_to_json(req), separators=(",", ":")) + "\n")
    os.replace(tmp, path)


def _check_header(obj: dict[str, Any], where: str) -> dict[str, Any]:
    if obj.get("format") != FORMAT:
        raise TraceError(f"{where}: not a {FORMAT} header (first line needs format {FORMAT!r})")
    if obj.get("v") != VERSION:
        raise TraceError(f"{where}: trace version {obj.get('v')!r}; this reader knows {VERSION}")
    _int(obj, "requests", where)
    return obj


def read_header(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    for number, obj in _lines(path):
        return _check_header(obj, f"{path}:{number}")
    raise TraceError(f"{path}: empty file, no {FORMAT} header")


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Reads and checks a trace of our format; the first problem raises TraceError."""
    path = Path(path)
    header: dict[str, Any] | None = None
    out: list[TraceRequest] = []
    for number, obj in _lines(path):
        where = f"{path}:{number}"
        if header is None:
            header = _check_header(obj, where)
            continue
        req = request_from_json(obj, where)
        if out and req.arrival_s < out[-1].arrival_s:
            raise TraceError(
                f"{where}: field 'arrival_s' {req.arrival_s} is before the previous request's "
                f"{out[-1].arrival_s} (traces are in arrival order)"
            )
        out.append(req)
    if header is None:
        raise TraceError(f"{path}: empty file, no {FORMAT} header")
    if header["requests"] != len(out):
        raise TraceError(f"{path}: header says {header['requests']} requests, found {len(out)}")
    return out


@dataclass
class _UserLine:
    where: str
    arrival_s: float | None
    prompt: int
    output: int
    session: object | None
    cached: int | None
    hashes: list[object] | None
    singular: bool | None


def _user_line(obj: dict[str, Any], where: str, strict_mooncake: bool) -> _UserLine:
    if strict_mooncake:
        for key in ("timestamp", "input_length", "output_length", "hash_ids"):
            if key not in obj:
                raise TraceError(f"{where}: missing field {key!r} (format mooncake)")
    prompt = _int(obj, _first(obj, ("prompt_tokens", "input_length"), where), where, 1)
    output = _int(obj, _first(obj, ("output_tokens", "output_length"), where), where, 1)
    arrival: float | None = None
    if "arrival_s" in obj:
        arrival = _number(obj, "arrival_s", where)
    elif "timestamp" in obj:
        arrival = _number(obj, "timestamp", where) / 1000
    cached = None
    if "cached_tokens" in obj:
        cached = _int(obj, "cached_tokens", where)
        if cached > prompt:
            raise TraceError(f"{where}: field 'cached_tokens' {cached} exceeds the prompt {prompt}")
    hashes = obj.get("hash_ids")
    if hashes is not None:
        if not isinstance(hashes, list) or not all(
            isinstance(h, int | str) and not isinstance(h, bool) for h in hashes
        ):
            raise TraceError(f"{where}: field 'hash_ids' must be a list of integers or strings")
    singular = obj.get("singular")
    if singular is not None and not isinstance(singular, bool):
        raise TraceError(f"{where}: field 'singular' must be true or false, got {singular!r}")
    session = obj.get("session_id")
    if isinstance(session, dict | list):
        raise TraceError(f"{where}: field 'session_id' must be a string or a number")
    return _UserLine(where, arrival, prompt, output, session, cached, hashes, singular)


def _hash_segments(
    line: _UserLine, hashes: list[object], seeds: dict[object, int], block_size: int
) -> tuple[Segment, ...]:
    """One segment per block, seeded by its hash; the last block is partial."""
    blocks = -(-line.prompt // block_size)
    if len(hashes) != blocks:
        raise TraceError(
            f"{line.where}: field 'hash_ids' has {len(hashes)} blocks, but {line.prompt} "
            f"tokens make {blocks} blocks of {block_size} (set the block size?)"
        )
    out = []
    for i, h in enumerate(hashes):
        seed = seeds.setdefault(h, len(seeds))  # dense ids: any hash type, no negative seeds
        out.append((seed, min(block_size, line.prompt - i * block_size)))
    return tuple(out)


def _resolve_format(path: Path, format: str) -> str:
    if format not in FORMATS:
        raise ValueError(f"unknown trace format {format!r}; known: {', '.join(FORMATS)}")
    if format != "auto":
        return format
    for _, obj in _lines(path):
        return "pdd" if obj.get("format") == FORMAT else "simple"
    raise TraceError(f"{path}: empty file")


def import_trace(
    path: str | Path, format: str = "auto", block_size: int = BLOCK_SIZE
) -> list[TraceRequest]:
    """A user's trace as our requests: ids renumbered in arrival order, cached tokens derived.

    See the module docstring for the accepted fields and where cached tokens come from.
    """
    path = Path(path)
    kind = _resolve_format(path, format)
    if kind == "pdd":
        return read_trace(path)
    lines = [_user_line(obj, f"{path}:{n}", kind == "mooncake") for n, obj in _lines(path)]
    if not lines:
        raise TraceError(f"{path}: no requests")
    timed = [line.arrival_s is not None for line in lines]
    if any(timed) and not all(timed):
        where = lines[timed.index(not timed[0])].where
        raise TraceError(f"{where}: a timestamp on some lines but not on others")
    start = min(line.arrival_s or 0.0 for line in lines)
    lines.sort(key=lambda line: line.arrival_s or 0.0)  # stable: equal times keep file order

    sessions: dict[object, int] = {}  # user's session id -> ours
    count = 0  # sessions so far; a request without a session id is a session of its own
    turns: dict[int, int] = {}
    last_prompt: dict[int, tuple[Segment, ...]] = {}
    seeds: dict[object, int] = {}
    fresh = [1 << 40]  # seeds of invented (fresh) segments, apart from hash seeds

    def new_segment(n: int) -> Segment:
        fresh[0] += 1
        return (fresh[0], n)

    trie = PrefixTrie()
    out: list[TraceRequest] = []
    for i, line in enumerate(lines):
        if line.session is None or line.session not in sessions:
            session, count = count, count + 1
            if line.session is not None:
                sessions[line.session] = session
        else:
            session = sessions[line.session]
        turn = turns[session] = turns.get(session, -1) + 1
        segments: tuple[Segment, ...] | None
        if line.hashes is not None:
            segments = _hash_segments(line, line.hashes, seeds, block_size)
        elif line.cached is not None:
            segments = None
        elif session in last_prompt:
            before = last_prompt[session]
            grown = line.prompt - sum(n for _, n in before)
            segments = (*before, new_segment(grown)) if grown > 0 else (new_segment(line.prompt),)
        else:
            segments = (new_segment(line.prompt),)
        if segments is None:
            cached = line.cached or 0
        else:
            cached = min(trie.match(segments), line.prompt)
            trie.insert(segments)
            last_prompt[session] = segments
        singular = line.singular
        if singular is None:
            singular = is_singular_like(line.prompt, cached, line.output)
        arrival = 0.0 if line.arrival_s is None else round(line.arrival_s - start, 6)
        out.append(
            TraceRequest(
                id=i,
                session=session,
                turn=turn,
                arrival_s=arrival,
                prompt_tokens=line.prompt,
                cached_tokens=cached,
                output_tokens=line.output,
                singular=singular,
                segments=segments,
            )
        )
    return out
