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
from mlx_dflash.engine.lattice import LatticeDrafts
from mlx_dflash.engine.marginals import Marginals


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
        self.corpus_file = None

    def reset(self, length: int = 0) -> None:
        self.context_len = min(self.context_len, length)

    def add_context(self, taps: mx.array) -> None:
        self.context_len += taps.shape[0]

    def propose_together(self, asks) -> list[Proposal]:
        """Batched rows: each row's own pass (an oracle has no packed one)."""
        return [a.drafter.propose(a.last_token, a.start, a.n) for a in asks]

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
        return Marginals(mx.array(logits))


class LatticeOracle(OracleDrafter):
    """A DFlash 2-shaped oracle: each slot's best logit is a wrong token and the true one comes
    second, but the lattice's pairwise term lifts the true token after the true predecessor.

    So the selector's chain (and a tree that follows the pairwise term) finds the truth, while
    the argmax of the logits (or a tree over independent marginals) finds almost none of it:
    a test sees which one the engine used. `corrupt` breaks the true edge at random slots.
    """

    def __init__(self, *a, k: int = 4, bonus: float = 3.0, **kw):
        super().__init__(*a, **kw)
        self.k, self.bonus = k, bonus

    def propose(self, last_token: int, start: int, n: int) -> Proposal:
        from mlx_dflash.engine.lattice import Lattice

        assert start == self.context_len, "engine fed the drafter out of sync"
        logits = np.zeros((n, self.vocab_size), dtype=np.float32)
        cand = np.zeros((n, self.k), dtype=np.int32)
        unary = np.zeros((n, self.k), dtype=np.float32)
        for t in range(n):
            pos = start + 1 + t
            rng = np.random.default_rng([self.seed, start, pos])
            true = self.truth[pos] if pos < len(self.truth) else int(rng.integers(self.vocab_size))
            others = [int(x) for x in rng.permutation(self.vocab_size) if x != true][: self.k - 1]
            cand[t] = [others[0], true, *others[1:]]
            unary[t] = [5.0, 4.0, *rng.normal(0, 0.3, self.k - 2)]
            logits[t] = rng.normal(0, 0.1, self.vocab_size) - 5.0
            logits[t, cand[t]] = unary[t]
        truth = [self.truth[p] if p < len(self.truth) else -1 for p in range(start, start + n + 1)]
        broken = np.random.default_rng([self.seed, start]).random(n) < self.corrupt
        first = unary[0] + self.bonus * (cand[0] == truth[1]) * (last_token == truth[0])
        if broken[0]:
            first = unary[0].copy()
        pairs = np.repeat(unary[1:, None, :], self.k, axis=1)
        for t in range(1, n):
            if not broken[t]:
                i, j = cand[t - 1] == truth[t], cand[t] == truth[t + 1]
                pairs[t - 1][np.ix_(i, j)] += self.bonus
        lattice = Lattice(mx.array(cand), mx.array(first), mx.array(pairs))
        return LatticeDrafts(mx.array(logits), lattice)


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
