"""The speculative decoding loop: draft, verify, accept, commit (algorithm.md §2-4).

State between rounds is small: the target's KV cache holds every position < `start`, the
drafter's cache holds the same positions' context, and `last` is the newest decided token
(not yet run through the target). A round drafts a block (DFlash) or a tree (DDTree) after
`last`, verifies it in one target forward, emits the accepted tokens plus one bonus token
from the target, and rewinds both caches to the accepted path.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .errors import DFlashError
from .sampling import SamplingParams, accept_greedy, accept_speculative, draw, token_probs

MODES = ("dflash", "ddtree", "ar")


@dataclass
class GenerationConfig:
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    mode: str = "dflash"
    block_size: int | None = None  # None: the drafter's
    budget: int | str = 16  # DDTree node budget, or "auto"
    branching: int | None = None  # DDTree: max children per node (None: the budget; 1: a chain)
    prefill_chunk: int = 512
    stop_ids: frozenset[int] = frozenset()


@dataclass
class Round:
    """What one round produced and where its time went."""

    tokens: list[int]
    accepted: int  # tau: drafts accepted + the bonus token
    drafted: int
    t_draft: float = 0.0
    t_verify: float = 0.0
    t_other: float = 0.0
    prefill: bool = False
    prefill_tokens: int = 0
    t_prefill: float = 0.0
    finished: str | None = None  # "stop" | "length" when this round ends generation


class Session:
    """Caches that outlive one generate call (chat reuses the prompt prefix across turns)."""

    def __init__(self, target, drafter=None):
        self.target = target
        self.drafter = drafter
        self.cache = target.make_cache()
        self.tokens: list[int] = []  # tokens whose K/V sit in the target cache

    def rewind(self, prompt: list[int]) -> list[int]:
        """Keep the longest cached prefix of `prompt` (at least one token left to run)."""
        n = 0
        limit = min(len(self.tokens), len(prompt) - 1)
        while n < limit and self.tokens[n] == prompt[n]:
            n += 1
        if self.drafter is not None:
            # The drafter can lag the target (a plain-decoding last step feeds it no taps).
            n = min(n, self.drafter.context_len)
        # Recurrent layers only rewind to a few points (see hybrid.RecurrentCache).
        n = min([n] + [c.rewind_point(n) for c in self.cache])
        for c in self.cache:
            c.trim(n)
        if self.drafter is not None:
            self.drafter.reset(n)
        self.tokens = self.tokens[:n]
        return prompt[n:]


def _sync(x) -> None:
    mx.eval(x)


def prefill(session: Session, prompt: list[int], cfg: GenerationConfig) -> tuple[mx.array, Round]:
    """Run the new part of the prompt in chunks; feed taps to the drafter as they come."""
    t0 = time.perf_counter()
    target, drafter = session.target, session.drafter
    new = session.rewind(prompt)
    logits = None
    for i in range(0, len(new), cfg.prefill_chunk):
        chunk = new[i : i + cfg.prefill_chunk]
        start = len(session.tokens)
        logits, taps = target.forward(
            mx.array(chunk),
            session.cache,
            start,
            logits="last",
            taps=drafter is not None,
            rewindable=False,
        )
        if drafter is not None:
            drafter.add_context(taps)
        _sync((logits, [c.state_arrays for c in session.cache]))
        session.tokens.extend(chunk)
    for c in session.cache:
        c.snapshot()
    dt = time.perf_counter() - t0
    return logits, Round([], 0, 0, prefill=True, prefill_tokens=len(new), t_prefill=dt)


def _pick(logits: mx.array, sampling: SamplingParams, rng) -> int:
    if sampling.greedy:
        return int(mx.argmax(logits[-1]).item())
    return draw(token_probs(logits[-1:], sampling)[0], rng)


def dflash_round(session: Session, last: int, n: int, sampling, rng) -> Round:
    """Draft n tokens in one drafter pass, verify n+1 in one target pass, commit the accepted."""
    target, drafter = session.target, session.drafter
    start = len(session.tokens)
    t0 = time.perf_counter()
    q_logits = drafter.propose(last, start, n)
    if sampling.greedy:
        drafts = np.array(mx.argmax(q_logits, axis=-1), dtype=np.int64)
    else:
        q = token_probs(q_logits, sampling)
        drafts = np.array([draw(row, rng) for row in q], dtype=np.int64)
    t1 = time.perf_counter()
    tokens = mx.array(np.concatenate([[last], drafts]).astype(np.int32))
    logits, taps = target.forward(tokens, session.cache, start)
    if sampling.greedy:
        argmax = np.array(mx.argmax(logits, axis=-1))
        t2 = time.perf_counter()
        a, bonus = accept_greedy(drafts, argmax)
    else:
        p = token_probs(logits, sampling)
        t2 = time.perf_counter()
        a, bonus = accept_speculative(drafts, p, q, rng)
    for c in session.cache:
        c.trim(start + a + 1)
    session.tokens.extend([last, *drafts[:a].tolist()])
    drafter.add_context(taps[: a + 1])
    out = [*drafts[:a].tolist(), bonus]
    return Round(out, a + 1, n, t_draft=t1 - t0, t_verify=t2 - t1, t_other=time.perf_counter() - t2)


def plain_round(session: Session, last: int, sampling, rng, feed_drafter: bool = False) -> Round:
    """Plain decoding through the same adapter: the baseline, and DDTree's pause between drafts.

    feed_drafter: also hand the drafter this position's taps, so drafting can resume next round.
    """
    t0 = time.perf_counter()
    start = len(session.tokens)
    logits, taps = session.target.forward(
        mx.array([last]), session.cache, start, taps=feed_drafter, rewindable=False
    )
    if feed_drafter:
        session.drafter.add_context(taps)
    tok = _pick(logits, sampling, rng)
    session.tokens.append(last)
    return Round([tok], 1, 0, t_verify=time.perf_counter() - t0)


def generate_rounds(session: Session, prompt: list[int], cfg: GenerationConfig) -> Iterator[Round]:
    """Yield one Round per decoding step; the tokens across rounds are the output."""
    if not prompt:
        raise DFlashError("The prompt is empty.")
    if cfg.mode not in MODES:
        raise DFlashError(f"Unknown mode '{cfg.mode}' (choose from {', '.join(MODES)}).")
    if cfg.mode != "ar" and session.drafter is None:
        raise DFlashError(f"Mode '{cfg.mode}' needs a drafter.")
    bs = _block_size(session, cfg)
    rng = np.random.default_rng(cfg.seed)
    if cfg.seed is not None:
        mx.random.seed(cfg.seed)
    logits, first = prefill(session, prompt, cfg)
    if cfg.max_tokens <= 0:
        first.finished = "length"
        yield first
        return
    t0 = time.perf_counter()
    last = _pick(logits, cfg.sampling, rng)
    first.tokens, first.accepted, first.t_other = [last], 1, time.perf_counter() - t0
    emitted = 1
    if last in cfg.stop_ids:
        first.finished = "stop"
    elif emitted >= cfg.max_tokens:
        first.finished = "length"
    yield first
    if first.finished:
        return
    tree = None
    if cfg.mode == "ddtree":
        from .ddtree import DDTree

        tree = DDTree(session, cfg)
    while True:
        remaining = cfg.max_tokens - emitted
        n = min(bs - 1, remaining - 1)  # never verify past max_tokens
        if cfg.mode == "ar" or n == 0:
            rnd = plain_round(session, last, cfg.sampling, rng)
        elif tree is not None:
            rnd = tree.round(last, n, rng)
        else:
            rnd = dflash_round(session, last, n, cfg.sampling, rng)
        for i, t in enumerate(rnd.tokens):
            if t in cfg.stop_ids:
                rnd.tokens = rnd.tokens[: i + 1]
                rnd.finished = "stop"
                break
        emitted += len(rnd.tokens)
        last = rnd.tokens[-1]
        if rnd.finished is None and emitted >= cfg.max_tokens:
            rnd.finished = "length"
        yield rnd
        if rnd.finished:
            return


def _block_size(session: Session, cfg: GenerationConfig) -> int:
    if session.drafter is None or cfg.mode == "ar":
        return 1
    native = session.drafter.block_size
    bs = cfg.block_size or native
    if bs < 2 or bs > native:
        raise DFlashError(f"Block size must be between 2 and the drafter's {native}, not {bs}.")
    return bs
