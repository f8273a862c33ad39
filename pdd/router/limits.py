"""What the router knows of the served model's limits, and the error a request breaking them or
any other check of its body gets (a 400 naming the field). Pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeGuard

SHOWN_CHARS = 60  # of a refused value, in the message


class BadRequest(ValueError):
    """A request the router refuses with a 400; `field` names what is wrong ("text",
    "sampling_params.top_k", "the body"), and the message starts with it."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field, self.problem = field, problem


@dataclass(frozen=True)
class Limits:
    """What the served model accepts, where the router knows it (from --tokenizer's model
    directory): token ids below vocab_size, prompt plus output within context_tokens."""

    vocab_size: int | None = None
    context_tokens: int | None = None


def is_token(t: object) -> TypeGuard[int]:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def show(value: object) -> str:
    """A refused value as the message quotes it: short, whatever the client sent."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}..."
