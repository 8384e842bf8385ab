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

from .grammar import Grammar
from .sampling import SamplingParams, device_probs
from .tree import Tree, best_first, build_tree, marginal_child, top_candidates

GRAMMAR_CANDIDATES = 8  # per depth, for a chain under a grammar (drafts it forbids are skipped)


@dataclass
class Marginals:
    logits: mx.array  # (n, V) for the n positions after the last token

    def chain(self, sampling: SamplingParams, key: mx.array | None):
        if key is None:
            return mx.argmax(self.logits, axis=-1).astype(mx.int32), None
        q = device_probs(self.logits, sampling)
        return mx.random.categorical(mx.log(q), key=key).astype(mx.int32), q

    def tree(self, root: int, budget: int, branching: int, temperature: float) -> Tree:
        cand_tok, cand_lp = top_candidates(self.logits, branching)
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
        k = min(max(min(branching or budget, budget), GRAMMAR_CANDIDATES), budget)
        cand_tok, cand_lp = top_candidates(self.logits, k)
        depth, width = cand_lp.shape
        child = marginal_child(cand_tok, cand_lp)
        tree, pruned = best_first(
            root, child, depth, width, budget, grammar, tokens_left, branching
        )
        return cut(tree), pruned
