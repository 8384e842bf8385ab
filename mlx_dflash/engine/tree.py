"""Draft trees from one drafter pass (docs/ddtree.md): the best-first heap and the walk.

The drafter's per-slot distributions are treated as independent; the best tree of B nodes under
that factorised distribution is the set of the B most probable prefixes, which a best-first
heap over (depth, rank) produces in non-increasing probability. Because the B-node tree is the
first B pops of any larger run, one heap run also gives the expected acceptance of every
smaller budget, which is what `--budget auto` trades against measured verify cost.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from .device import on_cpu, read
from .sampling import SamplingParams, draw, token_probs

if TYPE_CHECKING:
    from .grammar import Grammar


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
        parents, tokens = self.parents.tolist(), self.tokens.tolist()  # (not numpy scalars)
        for i in range(1, len(tokens)):
            kids[parents[i]][tokens[i]] = i
        return kids


def graft(
    tree: Tree, chains: list[list[int]], log_prob: float = 0.0, certain: bool = False
) -> Tree:
    """`tree` plus token chains from its root; where a chain follows existing nodes it shares
    them, new nodes go after all others (so parents still come first). New nodes get path
    log-probability `log_prob` per token (they are not the drafter's), and are marked
    `certain` (grammar drafts) or not."""
    kids = tree.children()
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    depths, lps = tree.depths.tolist(), tree.log_probs.tolist()
    sure = tree.is_certain().tolist()
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


def graft_sizes(tree: Tree, chains: list[list[int]]) -> np.ndarray:
    """sizes[L]: how many nodes graft(tree, [c[:L] for c in chains]) has, for every L up to the
    longest chain, in one walk (the budget prices each cut length of lookup branches). A new
    node at depth d of a chain is new at that depth for every chain that reaches it."""
    longest = max((len(c) for c in chains), default=0)
    new_at = np.zeros(longest + 1, dtype=np.int64)
    kids = tree.children()
    for chain in chains:
        node = 0
        for depth, tok in enumerate(chain, 1):
            nxt = kids[node].get(int(tok))
            if nxt is None:
                nxt = len(kids)
                kids[node][int(tok)] = nxt
                kids.append({})
                new_at[depth] += 1
            node = nxt
    return len(tree.tokens) + np.cumsum(new_at)


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
        return _top_on_host(read(logits.astype(mx.float32))[0], k)
    return read_top(device_top(logits, k))


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


def device_top(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """top_candidates as lazy device arrays (tokens, log-probs), for a caller that queues them
    (engine/marginals.py Marginals.queue) before read_top reads them."""
    logits = logits.astype(mx.float32)
    k = min(k, logits.shape[-1])
    lse = mx.logsumexp(logits, axis=-1, keepdims=True)
    if k < logits.shape[-1]:
        idx = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k]
    else:
        idx = mx.broadcast_to(mx.arange(logits.shape[-1]), logits.shape)
    vals = mx.take_along_axis(logits, idx, axis=-1) - lse
    order = mx.argsort(-vals, axis=-1)
    return mx.take_along_axis(idx, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)


def read_top(top: tuple[mx.array, mx.array]) -> tuple[np.ndarray, np.ndarray]:
    """device_top's arrays on the host, after one wait."""
    tokens, lps = read(*top)
    return tokens, lps.astype(np.float64)


Child = Callable[[int, Any, int], tuple[int, float, Any]]


def best_first(
    root: int,
    child: Child,
    depth: int,
    width: int,
    budget: int,
    grammar: Grammar | None = None,
    tokens_left: int | None = None,
    branching: int | None = None,
    runs: bool = True,
) -> tuple[Tree, int]:
    """The one best-first heap every draft tree grows by: the `budget` most probable prefixes,
    parents first; every pop is a node and pushes its next sibling and its best child.

    child(d, state, r): the r-th best candidate (r < width) at depth d under a parent holding
    candidate `state` (None at the root and after a forced token): (token, log-prob, state).
    grammar, an allow-filter: a candidate it refuses on its path is skipped and counted; its
    forced runs follow at once as certain nodes at their parent's log-prob (`runs`), nothing
    follows the answer's end. branching: drafted children a node at most; tokens_left: the deepest
    node. Returns (tree, candidates refused); the grammar is left at the emitted tokens.
    """
    tokens_left = budget if tokens_left is None else tokens_left
    limit = min(depth, tokens_left)
    nodes = _Nodes(root, paths=grammar is not None)
    # (-path log-prob, depth, rank, parent, the candidate): (depth, rank, parent) is unique, so
    # the candidate is carried, never compared, and each is asked for once
    heap: list[tuple[float, int, int, int, tuple]] = []
    refused = 0

    def open_(node: int) -> None:
        """Add the grammar's forced run after `node`, then push its best child."""
        dep, lps = nodes.dep, nodes.lps
        if grammar is not None:
            run = grammar.run_after(
                nodes.paths[node], min(budget + 1 - len(dep), tokens_left - dep[node])
            )
            if run is None:
                return
            for t in run if runs else ():
                node = nodes.add(t, node, lps[node], None, True)
        if dep[node] < limit and budget > 0:
            c = child(dep[node], nodes.state[node], 0)
            heapq.heappush(heap, (-lps[node] - c[1], dep[node], 0, node, c))

    open_(0)
    while heap and len(nodes.dep) <= budget:
        neg, d, r, parent, (t, lp, st) = heapq.heappop(heap)
        if r + 1 < width:
            c = child(d, nodes.state[parent], r + 1)
            heapq.heappush(heap, (neg + lp - c[1], d, r + 1, parent, c))
        if branching is not None and nodes.kids[parent] >= branching:
            continue
        if grammar is not None and not grammar.allowed(nodes.paths[parent], t):
            refused += 1
            continue
        open_(nodes.add(t, parent, -neg, st, False))
    if grammar is not None:
        grammar.goto([])
    tree = Tree.of(nodes.tok, nodes.par, nodes.dep, nodes.lps, nodes.sure if grammar else None)
    return tree.prefix(min(len(nodes.tok), budget + 1)), refused


class _Nodes:
    """best_first's nodes as parallel lists, in creation order (index 0: the root)."""

    def __init__(self, root: int, paths: bool):
        self.tok, self.par, self.dep, self.lps = [root], [-1], [0], [0.0]
        self.state: list[Any] = [None]
        self.sure, self.kids = [False], [0]
        self.paths: list[list[int]] = [[]]  # each node's tokens from the root (for a grammar)
        self.keep_paths = paths

    def add(self, t: int, parent: int, score: float, state: Any, certain: bool) -> int:
        self.tok.append(t)
        self.par.append(parent)
        self.dep.append(self.dep[parent] + 1)
        self.lps.append(score)
        self.state.append(state)
        self.sure.append(certain)
        self.kids.append(0)
        self.kids[parent] += 1
        if self.keep_paths:
            self.paths.append([*self.paths[parent], t])
        return len(self.tok) - 1


def build_tree(root: int, tokens: np.ndarray, lp: np.ndarray, budget: int) -> Tree:
    """DDTree's tree over independent marginals: tokens/lp (depth, K) candidate tokens and
    log-probs per depth, sorted best first."""
    return best_first(root, marginal_child(tokens, lp), lp.shape[0], lp.shape[1], budget)[0]


def marginal_child(tokens: np.ndarray, lp: np.ndarray) -> Child:
    """best_first's candidates from per-depth marginals (the parent's state does not matter)."""
    toks, lps = tokens.tolist(), lp.tolist()
    return lambda d, _state, r: (toks[d][r], lps[d][r], None)


def expected_tokens(tree: Tree, calibration: float = 1.0) -> np.ndarray:
    """E[tokens emitted] for budgets 0..len-1 under the drafter: 1 + sum of path probabilities,
    the drafter's scaled by `calibration` (how many it has really been getting); a grammar
    draft counts at its real acceptance, certain once its parent is reached."""
    p = np.exp(tree.log_probs[1:])
    p = np.where(tree.is_certain()[1:], p, calibration * p)
    return 1.0 + np.concatenate([[0.0], np.cumsum(p)])


def walk(
    tree: Tree,
    logits: mx.array,
    sampling: SamplingParams,
    rng,
    grammar: Grammar | None = None,
    masks: list | None = None,
    choice: np.ndarray | None = None,
) -> tuple[list[int], int]:
    """Follow the target through the tree; return (accepted node path incl. root, bonus token).

    Greedy follows the argmax. Sampling draws one token from the target at each visited node
    and moves to the child holding it: every emitted token is a target sample (lossless).
    Under a grammar the target's row is masked at every node visited (the only rows whose
    choice matters): greedy reads the rows' unmasked argmax in one transfer and a row itself
    only where the mask refuses it; the answer's end is always the bonus token. The grammar is
    left at the emitted tokens. `masks`, when given, receives each visited node's mask.
    `choice`: greedy, the rows' argmax when the caller read it with the verify.
    """
    kids = tree.children()
    chosen = None
    if sampling.greedy:
        chosen = read(mx.argmax(logits, axis=-1))[0] if choice is None else choice
    path = [0]
    while True:
        cur = path[-1]
        if grammar is not None:
            mask = grammar.mask()
            if masks is not None:
                masks.append(mask)
            argmax = None if chosen is None else int(chosen[cur])
            x = grammar.pick(logits[cur], argmax, sampling, rng, mask)
        elif chosen is not None:
            x = int(chosen[cur])
        else:  # transform only the rows the walk visits
            x = draw(token_probs(logits[cur : cur + 1], sampling)[0], rng)
        nxt = kids[cur].get(x)
        if nxt is None or (grammar is not None and x in grammar.stops):
            if grammar is not None:
                grammar.goto([])
            return path, x
        if grammar is not None:
            grammar.push(x)
        path.append(nxt)
