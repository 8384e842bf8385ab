"""A DFlash 2 drafter's proposal: a lattice of k candidates per block position whose scores
depend on the previous position's token (../shared/docs/dflash2.md §2.4).

The drafts are a walk through it: greedy takes each position's best candidate given the one
before (exactly z-lab's selector), sampling draws from softmax(score / T) over the k candidates,
and that sparse q is what the acceptance rule divides by. DDTree expands the lattice best-first:
a node's children are the next position's candidates scored with the node's own token as the
predecessor, so the tree follows the pairwise term instead of independent marginals.

The tree's path probabilities keep the drafter's mass off the candidates: a child's
probability is exp(score) over its candidates' exp(score) *plus* the logits' mass on every
other token (those keep their own logit: the pairwise term scores candidates only). The
selector's softmax over its k candidates alone would claim they hold all the mass, so where the
drafter is unsure the heap would trust deep paths it should not, and `--budget auto` would buy
them. Measured on the SmolLM2 DFlash 2 drafter (training/README.md): +0.07 to +0.13 tau on
HumanEval and mixed at 4-16 nodes, -0.03 to -0.08 on GSM8K, the drafter's home set.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .device import on_cpu
from .grammar import Grammar, prune_tree, with_certain_run
from .sampling import SamplingParams
from .tree import Tree


@dataclass
class Lattice:
    """Scores of every edge, left on the device: `first[j]` is candidate j at position 0 after
    the anchor; `pairs[t - 1, i, j]` is candidate j at position t after candidate i at t - 1."""

    cand: mx.array  # (n, k) token ids
    first: mx.array  # (k,)
    pairs: mx.array  # (n - 1, k, k)
    # (n, V): the drafter's logits, for the mass off the candidates (None: the candidates'
    # softmax alone, as the selector draws drafts)
    logits: mx.array | None = None

    @property
    def depth(self) -> int:
        return self.cand.shape[0]

    def off_candidates(self, temperature: float = 1.0, on_host: bool | None = None) -> np.ndarray:
        """(n,) per position, the log of exp(logit / T) summed over the tokens that are not its
        candidates (-inf where the candidates hold it all). `on_host` (default: without Metal)
        sums in numpy (on the CPU backend), whose exp is ~13x MLX's on a CPU (tree.top_candidates)."""
        assert self.logits is not None
        if on_host is None:
            on_host = on_cpu()
        if on_host:
            z = np.array(self.logits.astype(mx.float32)) / np.float32(temperature)
            top = z.max(axis=-1, keepdims=True)
            e = np.exp(z - top)
            total = e.sum(axis=-1, dtype=np.float64)
            c = np.array(self.cand).astype(np.int64)
            inside = np.take_along_axis(e, c, axis=-1).sum(axis=-1, dtype=np.float64)
        else:
            z = self.logits.astype(mx.float32) / temperature
            top = mx.max(z, axis=-1, keepdims=True)
            ez = mx.exp(z - top)
            t, i = mx.sum(ez, axis=-1), mx.sum(mx.take_along_axis(ez, self.cand, axis=-1), axis=-1)
            top, total, inside = np.array(top), np.array(t, np.float64), np.array(i, np.float64)
        with np.errstate(divide="ignore"):
            return np.log(np.maximum(total - inside, 0.0)) + top[:, 0]

    def _rows(self, chosen: list[mx.array]):
        """The score row of the next position, given the candidate indices chosen so far."""
        if not chosen:
            return self.first
        return mx.take(self.pairs[len(chosen) - 1], chosen[-1], axis=0)

    def _tokens(self, chosen: list[mx.array]) -> mx.array:
        idx = mx.stack(chosen)
        return mx.take_along_axis(self.cand, idx[:, None], axis=-1)[:, 0].astype(mx.int32)

    def greedy(self) -> mx.array:
        """The selector's greedy chain (n,), as lazy device ops: no host sync."""
        chosen: list[mx.array] = []
        for _ in range(self.depth):
            chosen.append(mx.argmax(self._rows(chosen), axis=-1))
        return self._tokens(chosen)

    def sample(self, temperature: float, key: mx.array, vocab_size: int):
        """(drafts (n,), q (n, V)): a chain drawn from softmax(score / T) position by position,
        and each position's sparse q scattered onto the vocabulary (zero off the candidates)."""
        chosen: list[mx.array] = []
        q_rows = []
        for key_t in mx.random.split(key, self.depth):
            q = mx.softmax(self._rows(chosen).astype(mx.float32) / temperature, axis=-1)
            chosen.append(mx.random.categorical(mx.log(q), key=key_t))
            q_rows.append(q)
        q_sparse = mx.stack(q_rows)
        dense = mx.zeros((self.depth, vocab_size), dtype=mx.float32)
        dense = mx.put_along_axis(dense, self.cand.astype(mx.int32), q_sparse, axis=-1)
        return self._tokens(chosen), dense


@dataclass
class LatticeDrafts:
    """A DFlash 2 drafter's proposal (engine/contract.py Proposal): its logits and its
    selector's lattice, whose chain the drafts follow (greedy: z-lab's selector; sampling:
    drawn from the lattice, with its sparse q) and whose paths the tree expands."""

    logits: mx.array  # (n, V)
    lattice: Lattice

    def chain(self, sampling: SamplingParams, key: mx.array | None):
        if key is None:
            return self.lattice.greedy(), None
        return self.lattice.sample(sampling.temperature, key, self.logits.shape[-1])

    def tree(self, root: int, budget: int, branching: int, temperature: float) -> Tree:
        return lattice_tree(root, self.lattice, budget, branching, temperature)

    def constrained_tree(
        self,
        root: int,
        budget: int,
        branching: int | None,
        temperature: float,
        grammar: Grammar,
        room: int,
        cut: Callable[[Tree], Tree],
    ) -> tuple[Tree, int]:
        """The lattice's tree with what the grammar forbids pruned, cut, and its forced run at
        the root."""
        k = min(branching or budget, budget)
        tree, pruned = prune_tree(self.tree(root, budget, k, temperature), grammar)
        return with_certain_run(cut(tree), grammar, min(room, budget)), pruned


def lattice_tree(
    root: int, lattice: Lattice, budget: int, branching: int | None = None, temperature: float = 1.0
) -> Tree:
    """Best-first over the lattice's paths: the `budget` most probable prefixes under the
    selector's chain distribution (log softmax(score / T) along the path, normalised with the
    logits' mass off the candidates when the lattice has its logits), parents first, at most
    `branching` children a node.

    Each node remembers its candidate index; its children are the next position's candidates
    in the order of `pairs[depth][index]`. As in tree.build_tree, every pop is a node and
    pushes its next sibling and its best child, so the heap stays small.
    """
    cand = np.array(lattice.cand)
    n, k = cand.shape
    k = min(k, branching or k)
    first = np.array(lattice.first.astype(mx.float32), dtype=np.float64) / temperature
    pairs = np.array(lattice.pairs.astype(mx.float32), dtype=np.float64) / temperature
    off = lattice.off_candidates(temperature) if lattice.logits is not None else np.full(n, -np.inf)
    first_lp = _log_softmax(first, off[0])
    pairs_lp = _log_softmax(pairs, off[1:, None, None]) if n > 1 else pairs
    first_order = np.argsort(-first_lp, kind="stable")
    pairs_order = np.argsort(-pairs_lp, axis=-1, kind="stable")

    def child(depth: int, parent_idx: int, rank: int) -> tuple[int, float]:
        """(candidate index, log-prob) of the rank-th best child at `depth` of a parent that
        holds candidate `parent_idx` at depth - 1 (the anchor for depth 0)."""
        if depth == 0:
            j = int(first_order[rank])
            return j, float(first_lp[j])
        j = int(pairs_order[depth - 1, parent_idx, rank])
        return j, float(pairs_lp[depth - 1, parent_idx, j])

    out_tok, out_par, out_dep, out_lp, out_idx = [root], [-1], [0], [0.0], [-1]
    heap: list[tuple[float, int, int, int]] = []  # (-path log-prob, depth, rank, parent node)
    if n and budget > 0:
        heap.append((-child(0, -1, 0)[1], 0, 0, 0))
    while heap and len(out_tok) <= budget:
        neg, d, r, parent = heapq.heappop(heap)
        j, lp = child(d, out_idx[parent], r)
        node = len(out_tok)
        out_tok.append(int(cand[d, j]))
        out_par.append(parent)
        out_dep.append(d + 1)
        out_lp.append(-neg)
        out_idx.append(j)
        if r + 1 < k:
            heapq.heappush(heap, (neg + lp - child(d, out_idx[parent], r + 1)[1], d, r + 1, parent))
        if d + 1 < n:
            heapq.heappush(heap, (neg - child(d + 1, j, 0)[1], d + 1, 0, node))
    return Tree.of(out_tok, out_par, out_dep, out_lp)


def _log_softmax(x: np.ndarray, off) -> np.ndarray:
    """log softmax over the last axis with `off` (log of more mass, broadcast) in the sum."""
    top = np.maximum(x.max(axis=-1, keepdims=True), off)
    return x - (top + np.log(np.exp(x - top).sum(axis=-1, keepdims=True) + np.exp(off - top)))
