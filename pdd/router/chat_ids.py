"""A chat's earlier answers as the ids the model generated, not as their text tokenized again.

A chat client sends the whole conversation every turn; the router renders it through the chat
template and tokenizes it. Its assistant messages are answers the model generated, but their
text tokenized afresh need not give the ids the model produced: one text has many token
sequences and a model does not always emit the one the tokenizer would pick. MD's decode radix
cache (and P's) hold the generated ids, so from the first token that differs the cache misses,
and the rest of the conversation (the answer and everything after it) crosses the WAN again.

So the router remembers, for each chat answer it served, the rendered prompt's text and ids and
the answer's ids; a later request whose rendered text starts with that prompt followed by that
answer gets those ids, and only the text after them is tokenized. The model then reads its own
tokens, as it did when it wrote them, and MD's cached prefix covers the previous turn whole. The
ids are used only if they decode to exactly the answer's text. Bounded: least recently used
entries go first.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

MAX_TOKENS = 4_000_000  # ids held in all (8 bytes each)
MAX_ENTRIES = 20_000


class ChatTokenizer(Protocol):
    def render_chat(self, messages: list[dict[str, Any]]) -> str: ...
    def encode_rendered(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    @property
    def special_ids(self) -> frozenset[int]: ...


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


@dataclass(frozen=True)
class _Entry:
    ids: array  # the rendered prompt's ids, then the answer's
    prompt_tokens: int
    answer: bytes  # digest of the answer's text
    chars: int  # length of prompt text + answer text


@dataclass
class ChatIdsStats:
    remembered: int = 0
    reused: int = 0  # requests that got an earlier answer's generated ids
    mismatched: int = 0  # remembered ids that did not decode to the answer's text


class ChatIds:
    def __init__(self, max_tokens: int = MAX_TOKENS, max_entries: int = MAX_ENTRIES) -> None:
        self.max_tokens = max_tokens
        self.max_entries = max_entries
        self.tokens = 0
        self.stats = ChatIdsStats()
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # digest(prompt + answer)
        # digest(answer) -> where entries with that answer end -> how many do
        self._ends: dict[bytes, dict[int, int]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def encode(
        self, tokenizer: ChatTokenizer, messages: list[dict[str, Any]]
    ) -> tuple[str, list[int]]:
        """The rendered conversation and its ids, with the latest remembered answer's own ids."""
        text = tokenizer.render_chat(messages)
        answers = [m.get("content") for m in messages if m.get("role") == "assistant"]
        for answer in reversed(answers):
            if isinstance(answer, str) and answer:
                head = self._generated(tokenizer, text, answer)
                if head is not None:
                    ids, chars = head
                    return text, ids + tokenizer.encode_rendered(text[chars:])
        return text, tokenizer.encode_rendered(text)

    def _generated(
        self, tokenizer: ChatTokenizer, text: str, answer: str
    ) -> tuple[list[int], int] | None:
        """The remembered ids of the longest head of `text` that ends with `answer`."""
        with self._lock:
            ends = sorted(self._ends.get(_digest(answer), ()), reverse=True)
        for end in ends:
            if end > len(text) or text[end - len(answer) : end] != answer:
                continue
            key = _digest(text[:end])
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None:
                    self._entries.move_to_end(key)
            if entry is None:
                continue
            ids = entry.ids.tolist()
            generated = _answer_ids(tokenizer, ids[entry.prompt_tokens :], answer)
            if generated is None:
                self.stats.mismatched += 1
                continue
            self.stats.reused += 1
            return ids[: entry.prompt_tokens] + generated, end
        return None

    def remember(
        self, prompt_text: str, prompt_ids: Sequence[int], answer: str, output_ids: object
    ) -> None:
        """Keeps a served chat answer's ids (called with the text the client got)."""
        if not answer or not isinstance(output_ids, list) or not output_ids:
            return
        if not all(isinstance(t, int) for t in output_ids):
            return
        ids = array("q", prompt_ids)
        ids.extend(output_ids)
        entry = _Entry(ids, len(prompt_ids), _digest(answer), len(prompt_text) + len(answer))
        if len(ids) > self.max_tokens:
            return
        key = _digest(prompt_text + answer)
        with self._lock:
            self._drop(key)
            self._entries[key] = entry
            ends = self._ends.setdefault(entry.answer, {})
            ends[entry.chars] = ends.get(entry.chars, 0) + 1
            self.tokens += len(ids)
            self.stats.remembered += 1
            while self.tokens > self.max_tokens or len(self._entries) > self.max_entries:
                self._drop(next(iter(self._entries)))

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self.tokens -= len(entry.ids)
        ends = self._ends[entry.answer]
        ends[entry.chars] -= 1
        if not ends[entry.chars]:
            del ends[entry.chars]
        if not ends:
            del self._ends[entry.answer]


def _answer_ids(tokenizer: ChatTokenizer, ids: list[int], answer: str) -> list[int] | None:
    """The generated ids less any trailing special tokens (an EOS: the template writes its own
    end of turn after the answer), if they decode to exactly `answer`; else None."""
    special = tokenizer.special_ids
    while ids and ids[-1] in special:
        ids.pop()
    return ids if ids and tokenizer.decode(ids) == answer else None
