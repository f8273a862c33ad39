"""A blocking client for SGLang-native `/generate` streams, as benchmarks and tests use it."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field


@dataclass
class Streamed:
    chunks: list[dict] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # request sent -> each chunk, seconds
    ttft_s: float | None = None  # request sent -> first chunk carrying an output token
    total_s: float = 0.0

    @property
    def final(self) -> dict:
        return self.chunks[-1]


def sse_events(lines: Iterable[bytes]) -> Iterator[dict]:
    """The JSON events of a server-sent-events body, up to `data: [DONE]`."""
    for raw in lines:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        yield json.loads(line[len("data:") :])


def stream_generate(
    url: str, payload: dict, timeout: float = 300.0, patience_s: float = 0.0
) -> Streamed:
    """POSTs `payload` with stream=true and reads the SSE chunks (cumulative, SGLang's default).
    A 503 with Retry-After (the router: over capacity, or every instance it needs down) is
    retried after it for up to `patience_s`; any other error, or one past that, raises."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            return _stream_once(url, payload, timeout)
        except urllib.error.HTTPError as err:
            retry_after = err.headers.get("Retry-After") if err.code == 503 else None
            if retry_after is None or time.monotonic() + float(retry_after) > deadline:
                raise
            time.sleep(float(retry_after))


def _stream_once(url: str, payload: dict, timeout: float) -> Streamed:
    req = urllib.request.Request(
        f"{url}/generate",
        data=json.dumps({**payload, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    out = Streamed()
    start = time.monotonic()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for chunk in sse_events(resp):
            if out.ttft_s is None and chunk.get("output_ids"):
                out.ttft_s = time.monotonic() - start
            out.chunks.append(chunk)
            out.times.append(time.monotonic() - start)
    out.total_s = time.monotonic() - start
    if not out.chunks:
        raise RuntimeError(f"{url}/generate streamed no chunk")
    return out


def flush_cache(url: str, wait_s: float = 30.0) -> None:
    """Empties a server's radix cache, waiting up to `wait_s` for it to go idle first; raises
    RuntimeError with the server's reason when it does not."""
    try:
        with urllib.request.urlopen(f"{url}/flush_cache?timeout={wait_s:g}", timeout=wait_s + 30):
            pass
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"{url} did not flush its cache: {err.read()!r}") from err


def router_status(router_url: str) -> dict:
    """The PDD router's /status: its instances, what it has learnt, its mirrors of MD's KV."""
    with urllib.request.urlopen(f"{router_url}/status", timeout=30) as resp:
        status: dict = json.loads(resp.read())
    return status


def mirrored_tokens(router_url: str) -> int:
    """Tokens of MD's KV the router mirrors, all MDs together (from their cache syncs)."""
    caches = router_status(router_url)["md_caches"]
    return sum(int(c["tokens"]) for c in caches.values())


def wait_mirrored(router_url: str, at_least: int, timeout_s: float = 30.0) -> int:
    """Waits until the router mirrors `at_least` tokens of MD's KV (MD's cache sync has reached
    it) and returns what it mirrors; TimeoutError after `timeout_s`."""
    return _wait_mirrors(router_url, lambda got: got >= at_least, timeout_s,
                         f"not the {at_least} expected")  # fmt: skip


def router_sees_flush(router_url: str, timeout_s: float = 10.0) -> None:
    """Waits until the router mirrors none of MD's KV after a flush (MD's next cache sync): a
    request sent before would be planned on KV that MD no longer holds."""
    _wait_mirrors(router_url, lambda got: got == 0, timeout_s, "after the flush")


def _wait_mirrors(router_url: str, done: Callable[[int], bool], timeout_s: float,
                  expected: str) -> int:  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while not done(got := mirrored_tokens(router_url)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router mirrors {got} tokens of MD's KV after "
                               f"{timeout_s:g}s, {expected}")  # fmt: skip
        time.sleep(0.05)
    return got
