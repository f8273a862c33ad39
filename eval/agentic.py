"""A synthetic agentic workload as token ids, for benchmarks and the simulator.

Live sessions share a system prompt; each turn's prompt is the session's context so far (the
previous prompt, the model's answer, then a tool's output), so consecutive turns share long
prefixes. Which session speaks next is skewed (Zipf over session slots): hot sessions stay in
the caches, cold ones get evicted. Now and then a tool returns a long fresh document, and
sessions that outgrow `max_context` end and give their slot to a fresh one: the low-hit tail.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pdd.eval.prompts import random_ids


@dataclass(frozen=True)
class AgenticConfig:
    vocab: int
    seed: int = 0
    sessions: int = 8
    system_tokens: int = 300
    task_tokens: tuple[int, int] = (100, 300)
    tool_tokens: tuple[int, int] = (20, 120)
    long_tool_tokens: tuple[int, int] = (600, 1200)
    long_tool_prob: float = 0.05
    max_context: int = 2500
    zipf_s: float = 1.2


class AgenticWorkload:
    def __init__(self, cfg: AgenticConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.system = self._fresh(cfg.system_tokens)
        self.weights = [1 / (rank + 1) ** cfg.zipf_s for rank in range(cfg.sessions)]
        self.contexts = [self._new_session() for _ in range(cfg.sessions)]
        self.started = cfg.sessions

    def _fresh(self, n: int) -> list[int]:
        return random_ids(n, self.rng.randrange(1 << 62), self.cfg.vocab)

    def _new_session(self) -> list[int]:
        return self.system + self._fresh(self.rng.randint(*self.cfg.task_tokens))

    def next_prompt(self) -> tuple[int, list[int]]:
        """The session that speaks next and its prompt."""
        slot = self.rng.choices(range(self.cfg.sessions), self.weights)[0]
        return slot, list(self.contexts[slot])

    def record(self, slot: int, answer: list[int]) -> None:
        """The session's answer came back: append it and the tool's output."""
        cfg = self.cfg
        long = self.rng.random() < cfg.long_tool_prob
        tool = self._fresh(self.rng.randint(*(cfg.long_tool_tokens if long else cfg.tool_tokens)))
        context = self.contexts[slot] + answer + tool
        if len(context) > cfg.max_context:
            context = self._new_session()
            self.started += 1
        self.contexts[slot] = context
