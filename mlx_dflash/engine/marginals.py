"""DFlash's proposal: one drafter pass's logits, each position's distribution independent of the
others' (z-lab's DFlash). A DFlash 2 drafter proposes a lattice instead (engine/lattice.py);
the engine asks both the same three things (engine/contract.py Proposal).

- chain: each position's argmax (greedy), or a draw from it with that q (sampling);
- tree: DDTree's best-first expansion over each position's top candidates (docs/ddtree.md);
- under a grammar: the same heap over a few more candidates a depth, the grammar its filter:
  only what it allows, and its forced runs as certain nodes (tree.best_first).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from .device import on_cpu
from .grammar import Grammar
from .sampling import SamplingParams, device_probs
from .tree import Tree, best_first, build_tree, device_top, marginal_child, read_top, top_candidates

GRAMMAR_CANDIDATES = 8  # per depth, for a chain under a grammar (drafts it forbids are skipped)


@dataclass
class Marginals:
    logits: mx.array  # (n, V) for the n positions after the last token
    queued: tuple[int, tuple[mx.array, mx.array]] | None = None  # (width, device_top)

    def chain(self, sampling: SamplingParams, key: mx.array | None):
        if key is None:
            return mx.argmax(self.logits, axis=-1).astype(mx.int32), None
        q = device_probs(self.logits, sampling)
        return mx.random.categorical(mx.log(q), key=key).astype(mx.int32), q

    def queue(self, budget: int, branching: int | None, temperature: float, constrained: bool):
        """On a GPU the tree's top candidates are queued with the pass, so the device computes
        them while the host looks for lookup branches and the tree waits once, for what is
        done; on the CPU numpy takes them from the logits (tree.top_candidates)."""
        if on_cpu():
            mx.async_eval(self.logits)
            return
        k = _width(budget, branching, constrained)
        self.queued = (k, device_top(self.logits, k))
        mx.async_eval(self.logits, *self.queued[1])

    def _candidates(self, k: int):
        if self.queued is not None and self.queued[0] == k:
            return read_top(self.queued[1])
        return top_candidates(self.logits, k)

    def tree(self, root: int, budget: int, branching: int | None, temperature: float) -> Tree:
        cand_tok, cand_lp = self._candidates(_width(budget, branching, False))
        return build_tree(root, cand_tok, cand_lp, budget)

    def constrained_tree(
        self,
        root: int,
        budget: int,
        branching: int | None,
        temperature: float,
        grammar: Grammar,
        tokens_left: int,
        cut: Callable[[Tree], Tree],
    ) -> tuple[Tree, int]:
        cand_tok, cand_lp = self._candidates(_width(budget, branching, True))
        depth, width = cand_lp.shape
        child = marginal_child(cand_tok, cand_lp)
        tree, pruned = best_first(
            root, child, depth, width, budget, grammar, tokens_left, branching
        )
        return cut(tree), pruned


def _width(budget: int, branching: int | None, constrained: bool) -> int:
    """Candidates a depth a tree reads: the branching (at most the budget), and under a
    grammar at least GRAMMAR_CANDIDATES, since it skips what the grammar forbids."""
    k = min(branching or budget, budget)
    return min(max(k, GRAMMAR_CANDIDATES), budget) if constrained else k
