"""The steps of a generation: prefill, one DFlash round, one plain decoding step.

A DFlash round drafts a block in one drafter pass, verifies it in one target pass and commits
the accepted prefix (docs/dflash.md); DDTree's round is in ddtree.py.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from .sampling import (
    SamplingParams,
    accept_greedy,
    device_probs,
    draw,
    speculative_on_device,
    token_probs,
)
from .session import GenerationConfig, Round, Session


def _sync(x) -> None:
    mx.eval(x)


def to_host(x: mx.array) -> np.ndarray:
    """A greedy DFlash round's one device -> host read (tests count the calls)."""
    return np.array(x)


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
        if session.world is not None:
            session.world.beat()  # a long prefill is progress too (the watchdog's view)
    for c in session.cache:
        c.snapshot()
    dt = time.perf_counter() - t0
    return logits, Round([], 0, 0, prefill=True, prefill_tokens=len(new), t_prefill=dt)


def _pick(logits: mx.array, sampling: SamplingParams, rng) -> int:
    if sampling.greedy:
        return int(mx.argmax(logits[-1]).item())
    return draw(token_probs(logits[-1:], sampling)[0], rng)


def dflash_round(session: Session, last: int, n: int, sampling, rng, profile=False) -> Round:
    """Draft n tokens in one drafter pass, verify n+1 in one target pass, commit the accepted.

    One host sync a round: the drafts stay on the device, and one transfer brings back the
    drafts with the target's choices (greedy), or with the accepted count and the next token
    (sampling: drafts drawn on the device, the acceptance rule run as MLX ops by
    speculative_on_device, with MLX keys taken from the seeded generator, so a seed still fixes
    the output). `profile` also syncs after drafting, so that the time split (Round.t_draft /
    t_verify / t_build) is the device's.
    """
    target, drafter = session.target, session.drafter
    start = len(session.tokens)
    if not sampling.greedy:
        key_d, key_a = mx.random.split(mx.random.key(int(rng.integers(2**31))))
    t0 = time.perf_counter()
    q_logits = drafter.propose(last, start, n)
    if sampling.greedy:
        drafts = mx.argmax(q_logits, axis=-1).astype(mx.int32)
    else:
        q = device_probs(q_logits, sampling)
        drafts = mx.random.categorical(mx.log(q), key=key_d).astype(mx.int32)
    t_build = time.perf_counter() - t0
    if profile:
        mx.eval(drafts)
    t1 = time.perf_counter()
    tokens = mx.concatenate([mx.array([last], dtype=mx.int32), drafts])
    logits, taps = target.forward(tokens, session.cache, start)
    if sampling.greedy:
        decided = mx.argmax(logits, axis=-1).astype(mx.int32)
    else:
        a, bonus = speculative_on_device(drafts, device_probs(logits, sampling), q, key_a)
        decided = mx.stack([a, bonus]).astype(mx.int32)
    result = mx.concatenate([drafts, decided])
    if session.world is not None:  # every rank follows rank 0's drafts and decisions
        result = session.world.agree_device(result)
    t_build += time.perf_counter() - t1
    host = to_host(result)  # the round's one sync
    t2 = time.perf_counter()
    if sampling.greedy:
        a, bonus = accept_greedy(host[:n], host[n:])
    else:
        a, bonus = int(host[n]), int(host[n + 1])
    accepted = host[:a].tolist()
    for c in session.cache:
        c.trim(start + a + 1)
    session.tokens.extend([last, *accepted])
    drafter.add_context(taps[: a + 1])
    return Round(
        [*accepted, bonus],
        a + 1,
        n,
        t_draft=t1 - t0,
        t_verify=t2 - t1,
        t_other=time.perf_counter() - t2,
        t_build=t_build,
    )


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
    tok = session.agree([_pick(logits, sampling, rng)])[0]
    session.tokens.append(last)
    return Round([tok], 1, 0, t_verify=time.perf_counter() - t0)
