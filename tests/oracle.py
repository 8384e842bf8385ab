"""Draft sources with known behaviour, so tests can force full, partial and zero acceptance.

A random drafter accepts almost nothing; these propose the target's true greedy continuation
(known in advance) with controlled corruption. They implement the same interface as
`mlx_dflash.drafter.DrafterRunner`: block_size, context_len, reset, add_context, propose.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import mlx.core as mx
import numpy as np

from mlx_dflash.engine.contract import Proposal


class OracleDrafter:
    """Proposes truth[start + k] at slot k; with probability `corrupt` a wrong token wins.

    The true token always keeps the second-highest logit, so a draft tree with two or more
    children per node still contains it (DDTree tests rely on this).
    """

    def __init__(self, truth, vocab_size, block_size=8, corrupt=0.0, seed=0, margin=2.0):
        self.truth = list(truth)
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.corrupt = corrupt
        self.seed = seed
        self.margin = margin
        self.context_len = 0

    def reset(self, length: int = 0) -> None:
        self.context_len = min(self.context_len, length)

    def add_context(self, taps: mx.array) -> None:
        self.context_len += taps.shape[0]

    def propose(self, last_token: int, start: int, n: int) -> Proposal:
        assert start == self.context_len, "engine fed the drafter out of sync"
        # Each slot's draws depend only on (seed, round start, position), not on how many
        # slots the engine asks for: a DDTree that drafts only as deep as its budget sees
        # the same distributions as one that drafts the whole block.
        logits = np.zeros((n, self.vocab_size), dtype=np.float32)
        for k in range(n):
            pos = start + 1 + k
            rng = np.random.default_rng([self.seed, start, pos])
            logits[k] = rng.normal(0, 0.1, size=self.vocab_size)
            true = self.truth[pos] if pos < len(self.truth) else int(rng.integers(self.vocab_size))
            wrong = int(rng.integers(self.vocab_size - 1))
            wrong += wrong >= true
            top, second = (wrong, true) if rng.random() < self.corrupt else (true, wrong)
            # Two clear candidates over a flat rest: p(top) ~ 0.88, p(second) ~ 0.12 at margin 2.
            logits[k, top] += 12.0
            logits[k, second] += 12.0 - self.margin
        return Proposal(mx.array(logits))


def diversify(model, gain: float = 3.0, seed: int = 0) -> None:
    """Re-initialise a tiny random target so its greedy continuation does not collapse into
    repeating one token (std-0.1 random models do), which would make exactness tests weak."""
    from mlx.utils import tree_flatten, tree_unflatten

    mx.random.seed(seed)
    new = []
    params = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    for k, v in params:
        if v.ndim == 1:
            new.append(
                (k, 0.1 * mx.random.normal(v.shape) if k.endswith("bias") else mx.ones_like(v))
            )
        elif "embed" in k:
            new.append((k, mx.random.normal(v.shape).astype(v.dtype)))
        elif v.dtype in (mx.float32, mx.float16, mx.bfloat16):
            new.append((k, (mx.random.normal(v.shape) * gain / v.shape[-1] ** 0.5).astype(v.dtype)))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())


# mypy checks OracleDrafter against the engine's Drafter protocol
if TYPE_CHECKING:
    from mlx_dflash.engine.contract import Drafter

    _conforms_oracle: type[Drafter] = OracleDrafter
