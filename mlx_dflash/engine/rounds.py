"""The steps of a generation: prefill, the block round (DFlash), one plain decoding step.

A block round drafts in one drafter pass, verifies in one target pass and commits the accepted
prefix through Session.commit (docs/dflash.md); the tree round is in ddtree.py.
"""

from __future__ import annotations

import time
from typing import cast

import mlx.core as mx
import numpy as np

from .contract import Pass
from .device import read
from .sampling import (
    SamplingParams,
    accept_greedy,
    device_probs,
    draw,
    speculative_on_device,
    token_probs,
)
from .session import GenerationConfig, Round, Session


def to_host(x: mx.array) -> np.ndarray:
    """A greedy DFlash round's one device -> host read (tests count the calls)."""
    return np.array(x)


def prefill(session: Session, prompt: list[int], cfg: GenerationConfig) -> tuple[mx.array, Round]:
    """Run the new part of the prompt in chunks, committing each (taps feed the drafter)."""
    t0 = time.perf_counter()
    target, drafter = session.target, session.drafter
    new = session.rewind(prompt)
    logits = None
    mlx_lm_forwards = session.kv is not None or session.max_kv_size is not None
    for chunk in prefill_chunks(new, cfg.prefill_chunk, mlx_lm_forwards):
        p = Pass(mx.array(chunk), session.cache, len(session.tokens), logits="last",
                 taps=drafter is not None, rewindable=False)  # fmt: skip
        logits, taps = target.forward([p])[0]
        session.commit(chunk, taps)
        mx.eval(logits, [c.state_arrays for c in session.cache])
        session.world.heartbeat()  # a long prefill is progress too (a sharded target's watchdog)
    session.mark_prompt_end()
    dt = time.perf_counter() - t0
    assert logits is not None  # rewind leaves at least one prompt token to run
    return logits, Round([], 0, 0, prefill=True, prefill_tokens=len(new), t_prefill=dt)


def prefill_chunks(new: list[int], size: int, last_alone: bool) -> list[list[int]]:
    """The prompt's forwards: chunks of `size`; with `last_alone`, mlx-lm's: chunks of all but
    the last token, then the last one alone, which is where a quantized or rotating KV cache
    sees as mlx-lm's does (models/cache.py), so its output is mlx-lm's token for token."""
    body, tail = (new[:-1], new[-1:]) if last_alone else (new, [])
    return [body[i : i + size] for i in range(0, len(body), size)] + ([tail] if tail else [])


def token_logprobs(logits: mx.array, rows, tokens: list[int], k: int, masks=None):
    """The emitted tokens' log-probabilities under the target, from the rows of the verify's
    logits that chose them (log-softmax of the logits, as mlx-lm's generate_step reports: after
    its logits processors, so under a grammar the masked ones, `masks` (len(rows), V) bool),
    with the top k alternatives at each, best first. One sync, taken only when asked."""
    x = logits[mx.array(np.asarray(rows, dtype=np.int32))].astype(mx.float32)
    if masks is not None:
        x = mx.where(mx.array(np.asarray(masks)), x, -mx.inf)
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, mx.array(tokens, dtype=mx.int32)[:, None], axis=-1)[:, 0]
    top = mx.argsort(-lp, axis=-1)[:, :k] if k else mx.zeros((len(tokens), 0), dtype=mx.int32)
    top_lp = mx.take_along_axis(lp, top, axis=-1)
    chosen_h, top_h, top_lp_h = read(chosen, top, top_lp)
    # (a token a grammar forbids is no alternative: its -inf is dropped)
    alternatives = [
        [(a, b) for a, b in zip(t, v, strict=True) if b != -np.inf]
        for t, v in zip(top_h.tolist(), top_lp_h.tolist(), strict=True)
    ]
    return list(zip(chosen_h.tolist(), alternatives, strict=True))


def _pick(logits: mx.array | None, sampling: SamplingParams, rng, grammar=None, mask=None) -> int:
    assert logits is not None
    if grammar is not None:
        argmax = int(cast(int, mx.argmax(logits[-1]).item())) if sampling.greedy else None
        return grammar.pick(logits[-1], argmax, sampling, rng, mask)
    if sampling.greedy:
        return int(cast(int, mx.argmax(logits[-1]).item()))
    return draw(token_probs(logits[-1:], sampling)[0], rng)


def block_round(
    session: Session, last: int, n: int, sampling, rng, profile=False, logprobs=None
) -> Round:
    """DFlash: draft n tokens in one drafter pass, verify n+1 in one target pass, commit.

    One host sync a round: the drafts stay on the device, and one transfer brings back the
    drafts with the target's choices (greedy), or with the accepted count and the next token
    (sampling: drafts drawn on the device, the acceptance rule run as MLX ops by
    speculative_on_device, with MLX keys taken from the seeded generator, so a seed still fixes
    the output). `profile` also syncs after drafting, so that the time split (Round.t_draft /
    t_verify / t_build) is the device's.
    """
    start = len(session.tokens)
    t0 = time.perf_counter()
    drafts, q, key_accept = _draft_block(session.drafter, last, start, n, sampling, rng)
    # Queued: the drafter computes while the verify's graph is built (engine/device.py).
    mx.async_eval(drafts if q is None else (drafts, q))
    t_build = time.perf_counter() - t0
    if profile:
        mx.eval(drafts)
    t1 = time.perf_counter()
    tokens = mx.concatenate([mx.array([last], dtype=mx.int32), drafts])
    logits, taps = session.target.forward([Pass(tokens, session.cache, start)])[0]
    assert logits is not None
    if sampling.greedy:
        decided = mx.argmax(logits, axis=-1).astype(mx.int32)
    else:
        n_ok, next_tok = speculative_on_device(
            drafts, device_probs(logits, sampling), q, key_accept
        )
        decided = mx.stack([n_ok, next_tok]).astype(mx.int32)
    # Every rank of a sharded target follows rank 0's drafts and decisions.
    result = session.world.agree_device(mx.concatenate([drafts, decided]))
    t_build += time.perf_counter() - t1
    host = to_host(result)  # the round's one sync
    t2 = time.perf_counter()
    if sampling.greedy:
        a, bonus = accept_greedy(host[:n], host[n:])
    else:
        a, bonus = int(host[n]), int(host[n + 1])
    accepted = host[:a].tolist()
    session.commit([last, *accepted], taps)
    lps = (
        None
        if logprobs is None
        else token_logprobs(logits, range(a + 1), [*accepted, bonus], logprobs)
    )
    return Round(
        [*accepted, bonus],
        a + 1,
        n,
        t_draft=t1 - t0,
        t_verify=t2 - t1,
        t_other=time.perf_counter() - t2,
        t_build=t_build,
        logprobs=lps,
    )


def _draft_block(drafter, last: int, start: int, n: int, sampling, rng):
    """(drafts on the device, their distribution q or None, the acceptance rule's key).

    The proposal says what its chain is (engine/contract.py Proposal): DFlash's argmax or a
    draw, a DFlash 2 drafter's selector chain with its sparse q (engine/lattice.py)."""
    proposal = drafter.propose(last, start, n)
    if sampling.greedy:
        drafts, _ = proposal.chain(sampling, None)
        return drafts, None, None
    key_draft, key_accept = mx.random.split(mx.random.key(int(rng.integers(2**31))))
    drafts, q = proposal.chain(sampling, key_draft)
    return drafts, q, key_accept


def plain_round(
    session: Session,
    last: int,
    sampling,
    rng,
    feed_drafter: bool = False,
    logprobs=None,
    grammar=None,
) -> Round:
    """Plain decoding through the same adapter: the baseline, and DDTree's pause between drafts.

    feed_drafter: also hand the drafter this position's taps, so drafting can resume next round.
    grammar: the target's logits masked by it (engine/grammar.py), which then takes the token.
    """
    t0 = time.perf_counter()
    p = Pass(mx.array([last]), session.cache, len(session.tokens), taps=feed_drafter,
             rewindable=False)  # fmt: skip
    logits, taps = session.target.forward([p])[0]
    mask = grammar.mask() if grammar is not None else None
    tok = session.agree([_pick(logits, sampling, rng, grammar, mask)])[0]
    session.commit([last], taps)
    if grammar is not None:
        grammar.accept([tok])
    lps = None
    if logprobs is not None:
        assert logits is not None
        lps = token_logprobs(logits, [0], [tok], logprobs, None if mask is None else [mask])
    return Round([tok], 1, 0, t_verify=time.perf_counter() - t0, logprobs=lps)


class PipelinedSteps:
    """Plain greedy decoding with one step always in flight, as mlx-lm's `generate_step`: the
    next step's graph is built on the still-lazy token and queued (mx.async_eval) before the
    host reads this step's token, so Python's graph building overlaps the device's work (on
    this CPU too: MLX evaluates on a stream thread). The cache then runs one token ahead of
    the round's `last`, which is committed by the step that produced it; nothing is left to
    undo when generation stops (the step in flight only wrote the K/V of a committed token).

    For a target that runs alone (not a batch row, not a shard agreeing each token) with no
    per-token host work (grammar, logprobs, host sampling): the loop (loop.py) decides."""

    def __init__(self, session: Session):
        self.session = session
        self.pending: mx.array | None = None  # the next token, lazy

    def _step(self, token: mx.array) -> mx.array:
        s = self.session
        p = Pass(token, s.cache, len(s.tokens), taps=False, rewindable=False)
        logits, _ = s.target.forward([p])[0]
        assert logits is not None
        nxt = mx.argmax(logits[-1:], axis=-1).astype(mx.int32)
        mx.async_eval(nxt)
        return nxt

    def __call__(self, last: int, n: int = 0, rng=None, tokens_left: int = 0) -> Round:
        t0 = time.perf_counter()
        s = self.session
        if self.pending is None:  # the first step runs `last`, as a plain round would
            self.pending = self._step(mx.array([last], dtype=mx.int32))
            s.commit([last])
        assert s.tokens[-1] == last, "pipelined steps out of sync with the loop"
        token = self.pending
        self.pending = self._step(token)  # queued before this token reaches the host
        tok = int(cast(int, token.item()))
        s.commit([tok])
        return Round([tok], 1, 0, t_verify=time.perf_counter() - t0)
