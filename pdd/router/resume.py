"""Resume: the decode tier feeding the client (MD after the handoff or on P->MD, RLD on P->RLD)
failed, and the other tier finishes the request instead.

The client keeps what it has. P prefills the prompt followed by the tokens the client already
got (its radix cache holds the prompt, so that costs about the output's length) and the other
tier decodes the rest, as a new request whose output the stitcher appends. With greedy sampling
the tokens are those the failed side would have produced (the same recompute an Extend-Decode
handoff does). A stop string split across the resume point is not seen (the new request's text
starts after it). Pure.
"""

from __future__ import annotations

from typing import Any

from pdd.policy.path import handoff_blockers
from pdd.router.planner import max_new_tokens, prompt_ids


def resume_body(body: dict[str, Any], emitted: list[int]) -> dict[str, Any] | None:
    """The client's body continued after `emitted`; None when it cannot be: a text prompt (the
    router has no ids to extend), nothing left to generate, or what a handoff would break too
    (penalties, grammars, logprobs...: the new request's sampler would not see `emitted`)."""
    ids = prompt_ids(body)
    left = max_new_tokens(body) - len(emitted)
    if ids is None or left <= 0 or handoff_blockers(body):
        return None
    params = {**(body.get("sampling_params") or {}), "max_new_tokens": left}
    return {**body, "input_ids": [*ids, *emitted], "sampling_params": params}
