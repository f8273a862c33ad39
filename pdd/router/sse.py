"""Server-sent events as SGLang's `/generate` streams them: `data: <json>` events, then
`data: [DONE]`. Pure, incremental, and with no line-length limit (a cumulative chunk of a long
output can exceed any line buffer)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

DONE = "[DONE]"
_LINE_END = re.compile(r"\r\n|\r|\n")
MAX_EVENT_BYTES = 64 << 20


class SSEError(ValueError):
    pass


@dataclass
class SSEParser:
    """Feed raw bytes; get back each complete event's data: a dict, or DONE."""

    buffer: bytearray = field(default_factory=bytearray)

    def feed(self, data: bytes) -> list[dict | str]:
        self.buffer += data
        out: list[dict | str] = []
        while True:
            # Events end with a blank line; accept CRLF too.
            end, sep = self._find_end()
            if end < 0:
                if len(self.buffer) > MAX_EVENT_BYTES:
                    raise SSEError(f"event larger than {MAX_EVENT_BYTES} bytes")
                return out
            raw = bytes(self.buffer[:end])
            del self.buffer[: end + sep]
            event = self._parse(raw)
            if event is not None:
                out.append(event)

    def _find_end(self) -> tuple[int, int]:
        lf = self.buffer.find(b"\n\n")
        crlf = self.buffer.find(b"\r\n\r\n")
        if crlf >= 0 and (lf < 0 or crlf < lf):
            return crlf, 4
        return lf, 2

    @staticmethod
    def _parse(raw: bytes) -> dict | str | None:
        # SSE lines end only at CR, LF or CRLF; str.splitlines would also split at U+2028,
        # U+0085 and the like, which JSON writers (orjson) leave raw inside strings.
        lines = _LINE_END.split(raw.decode("utf-8", errors="replace"))
        data = [ln[5:].lstrip(" ") for ln in lines if ln.startswith("data:")]
        if not data:
            return None  # comments and keep-alives
        text = "\n".join(data)
        if text.strip() == DONE:
            return DONE
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            raise SSEError(f"event is not JSON: {err}") from err
        if not isinstance(value, dict):
            raise SSEError(f"event is not a JSON object: {text[:80]!r}")
        return value


def encode_event(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()
