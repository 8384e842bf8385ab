"""The speculative decoding loop: draft, verify, accept, commit (docs/dflash.md, docs/ddtree.md).

State between rounds is small: the target's KV cache holds every position < `start`, the
drafter's cache holds the same positions' context, and `last` is the newest decided token
(not yet run through the target). A round drafts a block (DFlash) or a tree (DDTree) after
`last`, verifies it in one target forward, emits the accepted tokens plus one bonus token
from the target, and rewinds both caches to the accepted path.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import mlx.core as mx
import numpy as np

from ..errors import DFlashError
from .ddtree import DDTree
from .rounds import _pick, dflash_round, plain_round, prefill
from .session import GenerationConfig, Round, Session


def generate_rounds(session: Session, prompt: list[int], cfg: GenerationConfig) -> Iterator[Round]:
    """Yield one Round per decoding step; the tokens across rounds are the output."""
    if not prompt:
        raise DFlashError("The prompt is empty.")
    if cfg.mode in ("dflash", "ddtree") and session.drafter is None:
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
    last = session.agree([_pick(logits, cfg.sampling, rng)])[0]
    first.tokens, first.accepted, first.t_other = [last], 1, time.perf_counter() - t0
    emitted = 1
    if last in cfg.stop_ids:
        first.finished = "stop"
    elif emitted >= cfg.max_tokens:
        first.finished = "length"
    yield first
    if first.finished:
        return
    tree = DDTree(session, cfg) if cfg.mode in ("ddtree", "lookup") else None
    while True:
        room = cfg.max_tokens - emitted - 1  # drafts allowed: never verify past max_tokens
        n = min(bs - 1, room)
        if cfg.mode == "ar" or room == 0:
            rnd = plain_round(session, last, cfg.sampling, rng)
        elif tree is not None:
            rnd = tree.round(last, n, rng, room)
        else:
            rnd = dflash_round(session, last, n, cfg.sampling, rng, cfg.profile)
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
    if session.drafter is None or cfg.mode in ("ar", "lookup"):
        return 1
    native = session.drafter.block_size
    bs = cfg.block_size or native
    if bs < 2 or bs > native:
        raise DFlashError(f"Block size must be between 2 and the drafter's {native}, not {bs}.")
    return bs
