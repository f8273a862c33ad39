"""The synthetic agentic workload: growing sessions, skewed popularity, reproducible."""

from __future__ import annotations

from collections import Counter

from pdd.eval.agentic import AgenticConfig, AgenticWorkload


def drive(seed: int, n: int = 300) -> tuple[list[int], list[list[int]]]:
    work = AgenticWorkload(AgenticConfig(vocab=1024, seed=seed, max_context=1500))
    slots, prompts = [], []
    for _ in range(n):
        slot, prompt = work.next_prompt()
        slots.append(slot)
        prompts.append(prompt)
        work.record(slot, [7] * 16)
    return slots, prompts


def test_same_seed_same_stream() -> None:
    assert drive(3) == drive(3)
    assert drive(3) != drive(4)


def test_turns_extend_the_previous_turn_of_their_session() -> None:
    slots, prompts = drive(5)
    last: dict[int, list[int]] = {}
    extended = reset = 0
    for slot, prompt in zip(slots, prompts, strict=True):
        before = last.get(slot)
        if before is not None:
            if prompt[: len(before) + 16] == [*before, *[7] * 16]:
                extended += 1
            else:
                reset += 1  # the session outgrew max_context; a fresh one took its slot
        assert len(prompt) <= 1500
        last[slot] = prompt
    assert extended > 200 and reset > 0
    system = prompts[0][:300]
    assert all(p[:300] == system for p in prompts)  # one shared system prompt


def test_popularity_is_skewed() -> None:
    counts = Counter(drive(7, 2000)[0])
    assert counts[0] > 3 * counts[7] > 0
