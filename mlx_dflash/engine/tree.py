"""Draft trees from one drafter pass (docs/ddtree.md): the best-first heap and the walk.

The drafter's per-slot distributions are treated as independent; the best tree of B nodes under
that factorised distribution is the set of the B most probable prefixes, which a best-first
heap over (depth, rank) produces in non-increasing probability. Because the B-node tree is the
first B pops of any larger run, one heap run also gives the expected acceptance of every
smaller budget, which is what `--budget auto` trades against measured verify cost.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .device import on_cpu
from .sampling import draw, token_probs


@dataclass
class Tree:
    """Nodes in creation order; index 0 is the root (the last verified token)."""

    tokens: np.ndarray  # (T,) int
    parents: np.ndarray  # (T,) int, parents[0] = -1
    depths: np.ndarray  # (T,) int, root 0
    log_probs: np.ndarray  # (T,) path log-probability under the drafter, root 0
    # (T,) bool: grammar drafts (engine/grammar.py), accepted whenever their parent is; None:
    # no such node. Their log_probs are their parent's.
    certain: np.ndarray | None = None

    @classmethod
    def of(cls, tokens, parents, depths, log_probs, certain=None) -> Tree:
        """A tree from parallel lists (certain: None, or per node, kept only if any is)."""
        sure = None if certain is None or not any(certain) else np.array(certain, dtype=bool)
        return cls(np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64),
                   np.array(depths, dtype=np.int64), np.array(log_probs, dtype=np.float64),
                   sure)  # fmt: skip

    def is_certain(self) -> np.ndarray:
        if self.certain is None:
            return np.zeros(len(self.tokens), dtype=bool)
        return self.certain

    def prefix(self, n: int) -> Tree:
        """The first n nodes (parents come first, so this is a tree)."""
        c = None if self.certain is None else self.certain[:n]
        return Tree(self.tokens[:n], self.parents[:n], self.depths[:n], self.log_probs[:n], c)

    def children(self) -> list[dict[int, int]]:
        """Per node: token -> child index (siblings carry distinct tokens)."""
        kids: list[dict[int, int]] = [{} for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            kids[self.parents[i]][int(self.tokens[i])] = i
        return kids


def graft(
    tree: Tree, chains: list[list[int]], log_prob: float = 0.0, certain: bool = False
) -> Tree:
    """`tree` plus token chains from its root; where a chain follows existing nodes it shares
    them, new nodes go after all others (so parents still come first). New nodes get path
    log-probability `log_prob` per token (they are not the drafter's), and are marked
    `certain` (grammar drafts) or not."""
    kids = tree.children()
    tokens, parents = list(tree.tokens), list(tree.parents)
    depths, lps = list(tree.depths), list(tree.log_probs)
    sure = list(tree.is_certain())
    for chain in chains:
        node = 0
        for tok in chain:
            nxt = kids[node].get(int(tok))
            if nxt is None:
                nxt = len(tokens)
                tokens.append(int(tok))
                parents.append(node)
                depths.append(depths[node] + 1)
                lps.append(lps[node] + log_prob)
                sure.append(certain)
                kids[node][int(tok)] = nxt
                kids.append({})
            node = nxt
    return Tree.of(tokens, parents, depths, lps, sure)


def root_only(root: int) -> Tree:
    """A tree of just the last decided token (lookup branches are grafted onto it)."""
    z = np.zeros(1, dtype=np.int64)
    return Tree(np.array([root], dtype=np.int64), np.array([-1]), z, np.zeros(1))


def top_candidates(
    logits: mx.array, k: int, on_host: bool | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Per depth, the k most likely tokens and their log-probabilities, best first.

    Only the k winners and each row's log-normaliser are needed, never the full log-softmax.
    `on_host` (default: on the CPU backend, engine/device.py) computes them in numpy: MLX's CPU backend
    evaluates exp about 13x slower than numpy, and this runs every round over the whole
    vocabulary (15 x 49K rows: 16 ms in MLX, 1.2 ms in numpy on a 2-core x86).
    """
    if on_host is None:
        on_host = on_cpu()
    k = min(k, logits.shape[-1])
    if on_host:
        return _top_on_host(np.array(logits.astype(mx.float32)), k)
    return _top_on_device(logits.astype(mx.float32), k)


def _top_on_host(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    top = x.max(axis=-1, keepdims=True)
    lse = top + np.log(np.exp(x - top).sum(axis=-1, keepdims=True))
    if k < x.shape[-1]:
        idx = np.argpartition(-x, k - 1, axis=-1)[:, :k]
    else:
        idx = np.broadcast_to(np.arange(x.shape[-1]), x.shape)
    vals = np.take_along_axis(x, idx, axis=-1) - lse
    order = np.argsort(-vals, axis=-1, kind="stable")
    return np.take_along_axis(idx, order, axis=-1), np.take_along_axis(vals, order, axis=-1).astype(
        np.float64
    )


def _top_on_device(logits: mx.array, k: int) -> tuple[np.ndarray, np.ndarray]:
    lse = mx.logsumexp(logits, axis=-1, keepdims=True)
    if k < logits.shape[-1]:
        idx = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k]
    else:
        idx = mx.broadcast_to(mx.arange(logits.shape[-1]), logits.shape)
    vals = mx.take_along_axis(logits, idx, axis=-1) - lse
    order = mx.argsort(-vals, axis=-1)
    return np.array(mx.take_along_axis(idx, order, axis=-1)), np.array(
        mx.take_along_axis(vals, order, axis=-1), dtype=np.float64
    )


def build_tree(root: int, tokens: np.ndarray, lp: np.ndarray, budget: int) -> Tree:
    """Best-first heap over ranks: the `budget` most probable prefixes, parents first.

    tokens/lp: (depth, K) candidate tokens and log-probs per depth, sorted best first.
    """
    depth_max, k = lp.shape
    out_tok, out_par, out_dep, out_lp = [root], [-1], [0], [0.0]
    heap = [(-lp[0, 0], 0, 0, 0)] if depth_max and budget > 0 else []  # (-score, d, r, parent)
    while heap and len(out_tok) <= budget:
        neg, d, r, parent = heapq.heappop(heap)
        node = len(out_tok)
        out_tok.append(int(tokens[d, r]))
        out_par.append(parent)
        out_dep.append(d + 1)
        out_lp.append(-neg)
        if r + 1 < k:
            heapq.heappush(heap, (neg + lp[d, r] - lp[d, r + 1], d, r + 1, parent))
        if d + 1 < depth_max:
            heapq.heappush(heap, (neg - lp[d + 1, 0], d + 1, 0, node))
    return Tree.of(out_tok, out_par, out_dep, out_lp)


def expected_tokens(tree: Tree, calibration: float = 1.0) -> np.ndarray:
    """E[tokens emitted] for budgets 0..len-1 under the drafter: 1 + sum of path probabilities,
    the drafter's scaled by `calibration` (how many it has really been getting); a grammar
    draft counts at its real acceptance, certain once its parent is reached."""
    p = np.exp(tree.log_probs[1:])
    p = np.where(tree.is_certain()[1:], p, calibration * p)
    return 1.0 + np.concatenate([[0.0], np.cumsum(p)])


def walk(tree: Tree, logits: mx.array, sampling, rng) -> tuple[list[int], int]:
    """Follow the target through the tree; return (accepted node path incl. root, bonus token).

    Greedy follows the argmax. Sampling draws one token from the target at each visited node
    and moves to the child holding it: every emitted token is a target sample (lossless).
    """
    kids = tree.children()
    path = [0]
    if sampling.greedy:
        choice = np.array(mx.argmax(logits, axis=-1))
        while True:
            nxt = kids[path[-1]].get(int(choice[path[-1]]))
            if nxt is None:
                return path, int(choice[path[-1]])
            path.append(nxt)
    while True:
        cur = path[-1]
        # Transform only the rows the walk visits.
        x = draw(token_probs(logits[cur : cur + 1], sampling)[0], rng)
        nxt = kids[cur].get(x)
        if nxt is None:
            return path, x
        path.append(nxt)
