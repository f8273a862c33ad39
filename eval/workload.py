"""Agentic request streams whose prefix-hit distribution is a knob, as trace requests.

Why: PDD stands or falls with the prefix hit rate of agentic traffic (DESIGN.md, "The problem"):
in production ~90% on average, 70-80% of requests above 95%, a small low-hit tail, and ~3-4%
"singular" requests (long uncached input, a few output tokens). The simulator and the live
harness need request streams of that shape, and knobs to move it.

How a stream is built. Agent sessions occupy `sessions` slots; requests arrive as a Poisson
process and each goes to a slot that has been quiet for `turn_gap_s` (the answer and the tool
take time), or is a singular request. Each request draws a target hit from a mixture of bands
(above 95%, 50-95%, the low tail) and is built to meet it:
- a session's next turn is its previous prompt + the model's previous answer + a tool output
  sized so that cached / prompt hits the target (a short tool output: > 95%; a long fresh
  document: the tail);
- a session start is a shared system prompt + a fresh task sized for the target; sessions end
  at random (mean `mean_turns` turns) or when the next turn would outgrow `max_context`;
- a singular request is the head of a system prompt + a long fresh document, 1-4 output tokens.
`cached_tokens` is then measured, not assumed: the longest prefix the prompt shares with any
earlier prompt of the trace, the hit of an ideal prefix cache that keeps every prompt. Answers
count as uncached because in a live run the model's own answers replace the trace's synthetic
ones, so only the earlier prompt itself is reusable.

Answers are agentic: a tool call or a short reply, lognormal (median ~180 tokens), at most 512;
the decoded length (`output_tokens`) is never trimmed. In the next prompt the answer takes
`answer_prompt_scale` x its decoded length, and at most what keeps the next turn at its target
hit (agent frameworks drop reasoning from the history); a > 95% turn thus stays above 95%.

Scaling (`scaled`): a small machine prefills far slower than a GPU, so prompt-side lengths scale
down; but a decode step of a small model on it takes about as long as a large model's step on a
GPU, so decoded lengths stay production-sized: an answer ends after the KV would have crossed,
as in production. Only the answer's share of the next prompt scales (`answer_prompt_scale`),
which keeps the hit-rate shape.

Prompts are recipes: segments (seed, length), a segment being the first `length` tokens of the
random stream `seed`. `materialize` turns a recipe into token ids for a vocabulary; equal
segments give equal ids, so prefix sharing survives without storing ids in a trace.
"""

from __future__ import annotations

import math
import random
import statistics
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

from pdd.eval.prompts import FIRST_ID

Segment = tuple[int, int]  # (seed, length): the first `length` tokens of stream `seed`

HIGH = 0.95  # "above 95%": the head of the distribution
LOW = 0.5  # "below 50%": the tail
_HIGH_ROOM = 0.955  # an answer's prompt segment is capped so > 95% turns stay above, a margin
_CALIBRATION_ROUNDS = 4


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace; `cached_tokens` is the prefix shared with earlier requests."""

    id: int
    session: int
    turn: int
    arrival_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    singular: bool = False
    segments: tuple[Segment, ...] | None = None  # None: numbers only, no token recipe

    @property
    def hit(self) -> float:
        return self.cached_tokens / self.prompt_tokens


@dataclass(frozen=True)
class WorkloadConfig:
    """The shape of a generated stream. Shares are of all requests; token counts are tokens."""

    seed: int = 0
    requests: int = 2000
    sessions: int = 32  # agent sessions active at once
    rate: float = 1.0  # mean requests per second (Poisson arrivals)
    turn_gap_s: float = 5.0  # a session's turns are at least this far apart
    mean_hit: float | None = 0.90  # met by shaping the 50-95% band; None: that band is uniform
    above_95: float = 0.75
    low_share: float = 0.04  # requests aimed below 50%, singular ones not counted
    singular_share: float = 0.035
    high_miss: tuple[float, float] = (0.002, 0.05)  # 1 - hit above 95%, log-uniform
    low_hit: tuple[float, float] = (0.1, 0.5)  # uniform
    singular_hit: tuple[float, float] = (0.0, 0.2)  # uniform
    system_prompts: int = 4
    system_tokens: tuple[int, int] = (2000, 12000)
    max_context: int = 128_000
    mean_turns: float = 40.0  # ends after a turn with chance 1/mean_turns, or when outgrown
    min_insert_tokens: int = 16  # the shortest tool output or task
    output_median: int = 180  # decoded tokens, lognormal: agentic answers and tool calls
    output_sigma: float = 0.6
    output_range: tuple[int, int] = (8, 512)
    answer_prompt_scale: float = 1.0  # an answer's length in the next prompt / its decoded length
    singular_tokens: tuple[int, int] = (16_000, 64_000)
    singular_output: tuple[int, int] = (1, 4)
    warm: bool = False  # the system prompts are cached before the first request (steady state)

    def __post_init__(self) -> None:
        if self.seed < 0 or self.requests < 1 or self.sessions < 1 or self.system_prompts < 1:
            raise ValueError("seed must be >= 0; requests, sessions, system_prompts >= 1")
        if self.rate <= 0 or self.turn_gap_s < 0 or self.mean_turns < 1:
            raise ValueError("rate must be > 0, turn_gap_s >= 0, mean_turns >= 1")
        if self.min_insert_tokens < 1 or self.output_median < 1 or self.output_sigma < 0:
            raise ValueError("min_insert_tokens, output_median must be >= 1, output_sigma >= 0")
        if self.answer_prompt_scale <= 0:
            raise ValueError(f"answer_prompt_scale {self.answer_prompt_scale} must be > 0")
        shares = (self.above_95, self.low_share, self.singular_share)
        if min(shares) < 0 or sum(shares) > 1 or self.singular_share >= 1:
            raise ValueError(
                f"shares above_95, low_share, singular_share {shares} must be >= 0 "
                "and sum to at most 1"
            )
        _check_range("high_miss", self.high_miss, 0, 1 - HIGH, open_low=True)
        _check_range("low_hit", self.low_hit, 0, LOW)
        _check_range("singular_hit", self.singular_hit, 0, LOW)
        for name in ("system_tokens", "output_range", "singular_tokens", "singular_output"):
            _check_range(name, getattr(self, name), 1, math.inf)
        if self.system_tokens[1] + self.min_insert_tokens > self.max_context:
            raise ValueError("max_context must hold the longest system prompt and a task")
        self.mid_mean()  # fails early when mean_hit cannot be met

    @property
    def mid_share(self) -> float:
        return 1 - self.above_95 - self.low_share - self.singular_share

    def band_means(self) -> dict[str, float]:
        """The mean hit each band's sampling aims at (before lengths are rounded or capped)."""
        a, b = self.high_miss
        miss = a if a == b else (b - a) / math.log(b / a)
        return {
            "high": 1 - miss,
            "low": sum(self.low_hit) / 2,
            "singular": sum(self.singular_hit) / 2,
        }

    def mid_mean(self) -> float:
        """The 50-95% band's mean hit that meets mean_hit, if every band met its aim."""
        if self.mean_hit is None:
            return (LOW + HIGH) / 2
        mid = self.mid_share
        means = self.band_means()
        rest = (
            self.above_95 * means["high"]
            + self.low_share * means["low"]
            + self.singular_share * means["singular"]
        )
        if mid <= 1e-9:
            raise ValueError(
                f"mean_hit is met by shaping the 50-95% band, which is empty here; the bands "
                f"give a mean of {rest:.3f}: set mean_hit=None"
            )
        need = (self.mean_hit - rest) / mid
        if not LOW + 0.01 <= need <= HIGH - 0.01:
            raise ValueError(
                f"mean_hit {self.mean_hit} is out of reach: with these shares the 50-95% band "
                f"would need a mean hit of {need:.3f}, outside [{LOW + 0.01}, {HIGH - 0.01}]"
            )
        return need

    def scaled(self, factor: float) -> WorkloadConfig:
        """The same hit shape with every prompt-side length times `factor`; decoded lengths
        (outputs, singular outputs) unchanged, answers in later prompts times `factor` too."""
        if factor <= 0:
            raise ValueError(f"scale factor {factor} must be > 0")

        def pair(p: tuple[int, int]) -> tuple[int, int]:
            return (max(1, round(p[0] * factor)), max(1, round(p[1] * factor)))

        return replace(
            self,
            system_tokens=pair(self.system_tokens),
            max_context=max(2, round(self.max_context * factor)),
            min_insert_tokens=max(1, round(self.min_insert_tokens * factor)),
            singular_tokens=pair(self.singular_tokens),
            answer_prompt_scale=self.answer_prompt_scale * factor,
        )

    def as_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def draw_output(cfg: WorkloadConfig, rng: random.Random) -> int:
    """A decoded length: lognormal around cfg.output_median, within cfg.output_range."""
    n = round(cfg.output_median * math.exp(cfg.output_sigma * rng.gauss(0, 1)))
    return min(max(n, cfg.output_range[0]), cfg.output_range[1])


def _check_range(
    name: str, pair: tuple[float, float], lo: float, hi: float, open_low: bool = False
) -> None:
    a, b = pair
    if not (lo < a if open_low else lo <= a) or not a <= b <= hi:
        raise ValueError(f"{name} {pair} must be an ordered pair within [{lo}, {hi}]")


class PrefixTrie:
    """The segment-level prefixes of every prompt seen so far, to measure cached tokens.

    Segment semantics make partial matches exact: (s, 300) and (s, 100) share 100 tokens and
    nothing after, since token 100 of stream s differs from whatever follows (s, 100).
    """

    def __init__(self) -> None:
        self.root: dict[int, dict[int, dict]] = {}

    def match(self, segments: Sequence[Segment]) -> int:
        node, total = self.root, 0
        for seed, n in segments:
            by_len = node.get(seed)
            if not by_len:
                break
            child = by_len.get(n)
            if child is None:
                return total + max(min(n, m) for m in by_len)
            total += n
            node = child
        return total

    def insert(self, segments: Sequence[Segment]) -> None:
        node = self.root
        for seed, n in segments:
            node = node.setdefault(seed, {}).setdefault(n, {})


def fresh_for(cached: int, hit: float) -> int:
    """Uncached tokens to append to `cached` ones so that the hit is `hit`."""
    return max(0, round(cached * (1 - hit) / hit)) if hit > 0 else 1 << 62


@dataclass
class _Session:
    id: int
    segments: list[Segment]
    turn: int
    answer: int  # its latest answer's length in the next prompt, which it opens
    target: float  # the hit its next request is built for
    ended: bool = False


class _Deck:
    """Labels drawn without replacement from shuffled decks of exact proportions.

    Shares then meet their targets within every deck of `size` draws instead of drifting by
    sampling noise (+-0.4 points for 3.5% of 2000 requests if drawn independently).
    """

    def __init__(self, rng: random.Random, weights: dict[str, float], size: int = 1000) -> None:
        total = sum(weights.values())
        exact = {k: size * w / total for k, w in weights.items()}
        counts = {k: math.floor(v) for k, v in exact.items()}
        by_remainder = sorted(exact, key=lambda k: counts[k] - exact[k])
        for k in by_remainder[: size - sum(counts.values())]:  # largest remainders round up
            counts[k] += 1
        self.rng = rng
        self.cards = [k for k, c in counts.items() for _ in range(c)]
        self.left: list[str] = []

    def draw(self) -> str:
        if not self.left:
            self.left = list(self.cards)
            self.rng.shuffle(self.left)
        return self.left.pop()


class _Generator:
    def __init__(self, cfg: WorkloadConfig, mid_mean: float) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.base = (cfg.seed + 1) << 32  # segment seeds: unique within the trace
        self.count = 0
        m = (mid_mean - LOW) / (HIGH - LOW)
        self.mid_k = m / (1 - m)  # the 50-95% band: hit = 0.5 + 0.45 * U**(1/k), mean mid_mean
        self.kinds = _Deck(
            self.rng, {"singular": cfg.singular_share, "session": 1 - cfg.singular_share}
        )
        self.bands = _Deck(
            self.rng, {"high": cfg.above_95, "low": cfg.low_share, "mid": cfg.mid_share}
        )
        self.systems = [
            self._fresh(self.rng.randint(*cfg.system_tokens)) for _ in range(cfg.system_prompts)
        ]
        self.slots: list[_Session | None] = [None] * cfg.sessions
        self.last = [-math.inf] * cfg.sessions
        self.sessions = 0
        self.trie = PrefixTrie()
        if cfg.warm:
            for system in self.systems:
                self.trie.insert([system])

    def _fresh(self, n: int) -> Segment:
        self.count += 1
        return (self.base + self.count, max(1, n))

    def _draw_hit(self) -> float:
        """A non-singular request's target hit, from the band mixture."""
        cfg, rng = self.cfg, self.rng
        band = self.bands.draw()
        if band == "high":
            a, b = cfg.high_miss
            return 1 - a * (b / a) ** rng.random()
        if band == "low":
            return rng.uniform(*cfg.low_hit)
        return LOW + (HIGH - LOW) * rng.random() ** (1 / self.mid_k)

    def _draw_output(self) -> int:
        return draw_output(self.cfg, self.rng)

    def _new_session(self, target: float) -> _Session:
        cfg = self.cfg
        system = self.rng.choice(self.systems)
        task = max(cfg.min_insert_tokens, fresh_for(system[1], target))
        task = min(task, cfg.max_context - system[1])
        self.sessions += 1
        return _Session(self.sessions - 1, [system, self._fresh(task)], 0, 0, target)

    def _pick_slot(self, t: float) -> tuple[int, float]:
        """A slot quiet for turn_gap_s; if none, the quietest one, when it becomes ready."""
        ready = [s for s, last in enumerate(self.last) if last <= t - self.cfg.turn_gap_s]
        if ready:
            return self.rng.choice(ready), t
        slot = min(range(len(self.last)), key=self.last.__getitem__)
        return slot, self.last[slot] + self.cfg.turn_gap_s

    def _turn(self, slot: int) -> tuple[_Session, int]:
        cfg = self.cfg
        sess = self.slots[slot]
        target = sess.target if sess is not None else self._draw_hit()
        if sess is None or sess.ended:
            sess = self._new_session(target)
        else:
            context = sum(n for _, n in sess.segments)
            need = max(fresh_for(context, target), sess.answer + cfg.min_insert_tokens)
            if context + need > cfg.max_context:
                sess = self._new_session(target)  # outgrown: a fresh session takes the slot
            else:
                tool = need - sess.answer
                sess.segments = [*sess.segments, self._fresh(sess.answer), self._fresh(tool)]
                sess.turn += 1
        output = self._draw_output()
        sess.ended = self.rng.random() < 1 / cfg.mean_turns
        sess.target = self._draw_hit()
        # The answer opens the next prompt uncached: its segment there is scaled like the prompt
        # and kept small enough for that turn's target; the decoded output is never trimmed.
        prompt = sum(n for _, n in sess.segments)
        room = fresh_for(prompt, min(sess.target, _HIGH_ROOM)) - cfg.min_insert_tokens
        sess.answer = max(1, min(round(output * cfg.answer_prompt_scale), room))
        self.slots[slot] = sess
        return sess, output

    def _singular(self) -> list[Segment]:
        cfg, rng = self.cfg, self.rng
        total = rng.randint(*cfg.singular_tokens)
        seed, length = rng.choice(self.systems)
        head = min(round(total * rng.uniform(*cfg.singular_hit)), length, total - 1)
        segments = [(seed, head)] if head > 0 else []
        return [*segments, self._fresh(total - head)]

    def run(self) -> list[TraceRequest]:
        cfg, rng = self.cfg, self.rng
        out: list[TraceRequest] = []
        t = 0.0
        for i in range(cfg.requests):
            t += rng.expovariate(cfg.rate)
            if self.kinds.draw() == "singular":
                segments = self._singular()
                session, turn, output = self.sessions, 0, rng.randint(*cfg.singular_output)
                self.sessions += 1
                singular = True
            else:
                slot, t = self._pick_slot(t)
                sess, output = self._turn(slot)
                self.last[slot] = t
                segments, session, turn, singular = sess.segments, sess.id, sess.turn, False
            cached = self.trie.match(segments)
            self.trie.insert(segments)
            out.append(
                TraceRequest(
                    id=i,
                    session=session,
                    turn=turn,
                    arrival_s=round(t, 6),
                    prompt_tokens=sum(n for _, n in segments),
                    cached_tokens=cached,
                    output_tokens=output,
                    singular=singular,
                    segments=tuple(segments),
                )
            )
        return out


def generate(cfg: WorkloadConfig) -> list[TraceRequest]:
    """The request stream `cfg` describes, in arrival order; deterministic under cfg.seed.

    The 50-95% band is calibrated to meet mean_hit: turns above 95% fall short of their aim
    when the previous answer alone exceeds the aimed miss (~0.8 points on the default mean),
    so the band's mean is corrected from the achieved mean and the stream rebuilt, a few times.
    """
    target = cfg.mean_hit
    mid = cfg.mid_mean()
    best: tuple[float, list[TraceRequest]] | None = None
    for _ in range(_CALIBRATION_ROUNDS if target is not None else 1):
        requests = _Generator(cfg, mid).run()
        if target is None:
            return requests
        got = statistics.fmean(r.hit for r in requests)
        if best is None or abs(got - target) < best[0]:
            best = (abs(got - target), requests)
        if abs(got - target) < 0.001:
            break
        mid = min(max(mid + (target - got) / cfg.mid_share, LOW + 0.01), HIGH - 0.01)
    assert best is not None
    return best[1]


def system_prompts(cfg: WorkloadConfig) -> list[TraceRequest]:
    """The shared system prompts of `cfg`'s stream as requests of 1 output token: what a warm
    start (`warm`) assumes cached; send them first so that a live run starts warm too."""
    gen = _Generator(cfg, cfg.mid_mean())
    return [
        TraceRequest(-1 - i, -1 - i, 0, 0.0, n, 0, 1, segments=((seed, n),))
        for i, (seed, n) in enumerate(gen.systems)
    ]


def segment_ids(seed: int, length: int, vocab: int) -> list[int]:
    """The first `length` tokens of stream `seed`: a shorter call gives a prefix of a longer."""
    span = vocab - FIRST_ID
    if span < 1:
        raise ValueError(f"vocab {vocab} leaves no ids at or above {FIRST_ID}")
    raw = array("I")  # 4-byte items: randbytes grows by whole 32-bit words, so prefixes agree
    raw.frombytes(random.Random(seed).randbytes(4 * length))
    return [FIRST_ID + x % span for x in raw]


def materialize(
    req: TraceRequest, vocab: int, cache: dict[tuple[int, int], list[int]] | None = None
) -> list[int]:
    """The prompt's token ids for a vocabulary of `vocab` ids; equal segments, equal ids.

    `cache` (seed, vocab) -> ids, shared across calls, saves regenerating common prefixes.
    """
    if req.segments is None:
        raise ValueError(
            f"request {req.id} has no token recipe (segments): its trace gave numbers only, "
            "e.g. cached_tokens without hash_ids, so it can be simulated but not sent"
        )
    ids: list[int] = []
    for seed, n in req.segments:
        if cache is None:
            ids += segment_ids(seed, n, vocab)
            continue
        stream = cache.get((seed, vocab))
        if stream is None or len(stream) < n:
            stream = cache[(seed, vocab)] = segment_ids(seed, n, vocab)
        ids += stream[:n]
    return ids


def is_singular_like(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> bool:
    """Singular traffic as the paper describes it: low hit and a very short output."""
    return output_tokens <= 4 and cached_tokens < LOW * prompt_tokens


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks."""
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def hit_rate_summary(requests: Sequence[TraceRequest]) -> dict[str, float]:
    """Per-request hit statistics (fractions), token totals and timing of a request stream."""
    if not requests:
        raise ValueError("no requests to summarise")
    n = len(requests)
    hits = sorted(r.hit for r in requests)
    prompts = sorted(r.prompt_tokens for r in requests)
    outputs = [r.output_tokens for r in requests]
    sessions = {r.session for r in requests if not r.singular}  # singular ones stand alone
    summary: dict[str, float] = {
        "requests": n,
        "sessions": len(sessions),
        "mean_hit": statistics.fmean(hits),
        "share_above_95": sum(h > HIGH for h in hits) / n,
        "share_below_50": sum(h < LOW for h in hits) / n,
        "singular_share": sum(r.singular for r in requests) / n,
        "token_hit": sum(r.cached_tokens for r in requests) / sum(prompts),
    }
    for q in (1, 5, 10, 25, 50, 75, 90, 99):
        summary[f"p{q}_hit"] = _quantile(hits, q / 100)
    summary.update(
        {
            "mean_prompt_tokens": statistics.fmean(prompts),
            "p50_prompt_tokens": _quantile(prompts, 0.5),
            "max_prompt_tokens": prompts[-1],
            "mean_output_tokens": statistics.fmean(outputs),
            "turns_per_session": (n - sum(r.singular for r in requests)) / max(1, len(sessions)),
            "duration_s": requests[-1].arrival_s - requests[0].arrival_s,
        }
    )
    return summary


def format_summary(summary: dict[str, float]) -> str:
    """The summary as an aligned two-column table."""

    def pct(key: str) -> str:
        return f"{100 * summary[key]:.1f}%"

    quantiles = " / ".join(pct(f"p{q}_hit") for q in (1, 5, 10, 25, 50, 75, 90, 99))
    rows = [
        ("requests", f"{summary['requests']:.0f}"),
        ("sessions", f"{summary['sessions']:.0f} ({summary['turns_per_session']:.1f} turns each)"),
        ("mean hit", pct("mean_hit")),
        ("hit > 95%", pct("share_above_95")),
        ("hit < 50%", pct("share_below_50")),
        ("singular", pct("singular_share")),
        ("token-weighted hit", pct("token_hit")),
        ("hit p1/5/10/25/50/75/90/99", quantiles),
        (
            "prompt tokens mean/p50/max",
            f"{summary['mean_prompt_tokens']:.0f} / {summary['p50_prompt_tokens']:.0f} / "
            f"{summary['max_prompt_tokens']:.0f}",
        ),
        ("output tokens mean", f"{summary['mean_output_tokens']:.0f}"),
        ("duration", f"{summary['duration_s']:.1f} s"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
