"""A DFlash 2 drafter's proposal: a lattice of k candidates per block position whose scores
depend on the previous position's token (../shared/docs/dflash2.md §2.4). How greedy, sampled
and DDTree drafts walk it: docs/dflash.md.

The tree's path probabilities keep the drafter's mass off the candidates: a child's
probability is exp(score) over its candidates' exp(score) *plus* the logits' mass on every
other token (those keep their own logit: the pairwise term scores candidates only). The
selector's softmax over its k candidates alone would claim they hold all the mass, so where the
drafter is unsure the heap would trust deep paths it should not, and `--budget auto` would buy
them. Measured on the SmolLM2 DFlash 2 drafter (training/README.md): +0.07 to +0.13 tau on
HumanEval and mixed at 4-16 nodes, -0.03 to -0.08 on GSM8K, the drafter's home set.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .device import on_cpu, read
from .grammar import Grammar, with_certain_run
from .sampling import SamplingParams
from .tree import Tree, best_first


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
        candidates (-inf where the candidates hold it all). `on_host` (default: on the CPU
        backend) sums in numpy, whose exp is ~13x MLX's on a CPU (tree.top_candidates)."""
        on_host = on_cpu() if on_host is None else on_host
        return self.off_from(read(*self.off_parts(temperature, on_host)), temperature)

    def off_parts(self, temperature: float, on_host: bool) -> list[mx.array]:
        """What off_candidates reads from the device (a caller reads them with its own arrays,
        in one wait): the logits to sum on the host, or the device's sums."""
        assert self.logits is not None
        if on_host:
            return [self.logits.astype(mx.float32), self.cand]
        z = self.logits.astype(mx.float32) / temperature
        top = mx.max(z, axis=-1, keepdims=True)
        ez = mx.exp(z - top)
        inside = mx.sum(mx.take_along_axis(ez, self.cand, axis=-1), axis=-1)
        return [top, mx.sum(ez, axis=-1), inside]

    @staticmethod
    def off_from(parts: list[np.ndarray], temperature: float) -> np.ndarray:
        """off_candidates from off_parts read on the host."""
        if len(parts) == 2:  # the logits and the candidates: summed here
            z = parts[0] / np.float32(temperature)
            top = z.max(axis=-1, keepdims=True)
            e = np.exp(z - top)
            total = e.sum(axis=-1, dtype=np.float64)
            c = parts[1].astype(np.int64)
            inside = np.take_along_axis(e, c, axis=-1).sum(axis=-1, dtype=np.float64)
        else:
            top, total, inside = parts[0], parts[1].astype(np.float64), parts[2].astype(np.float64)
        with np.errstate(divide="ignore"):
            return np.log(np.maximum(total - inside, 0.0)) + top[:, 0]

    def greedy(self) -> mx.array:
        """The selector's greedy chain (n,), as lazy device ops: no host sync."""
        return _greedy_chain(self.cand, self.first, self.pairs)

    def sample(self, temperature: float, key: mx.array, vocab_size: int):
        """(drafts (n,), q (n, V)): a chain drawn from softmax(score / T) position by position,
        and each position's sparse q scattered onto the vocabulary (zero off the candidates)."""
        # Every edge's q at once (a softmax is row by row: each row's bits are what it would
        # get alone), so the chain only picks rows: three calls a position instead of seven.
        n, k = self.cand.shape
        scores = mx.concatenate([self.first[None], self.pairs.reshape(-1, k)])
        q_all = mx.softmax(scores.astype(mx.float32) / temperature, axis=-1)
        q_first, q_pairs = q_all[0], q_all[1:].reshape(n - 1, k, k)
        log_first, log_pairs = mx.log(q_first), mx.log(q_pairs)
        chosen: list[mx.array] = []
        for t, key_t in enumerate(mx.random.split(key, n)):
            row = log_first if t == 0 else mx.take(log_pairs[t - 1], chosen[-1], axis=0)
            chosen.append(mx.random.categorical(row, key=key_t))
        q_sparse = q_first[None]
        if n > 1:  # each later position's q after the candidate drawn before it
            after = q_pairs[mx.arange(n - 1), mx.stack(chosen[:-1])]
            q_sparse = mx.concatenate([q_sparse, after])
        dense = mx.zeros((n, vocab_size), dtype=mx.float32)
        dense = mx.put_along_axis(dense, self.cand.astype(mx.int32), q_sparse, axis=-1)
        return _picked(self.cand, chosen), dense


@mx.compile
def _greedy_chain(cand: mx.array, first: mx.array, pairs: mx.array) -> mx.array:
    """Lattice.greedy: each position's best candidate after the one chosen before it. Compiled
    (traced once a block size): its 2n gathers and argmaxes are one call for the host, about
    a third of their cost built one by one; no arithmetic, so bit for bit the same (a CPU or
    a GPU)."""
    chosen = [mx.argmax(first, axis=-1)]
    for t in range(pairs.shape[0]):
        chosen.append(mx.argmax(mx.take(pairs[t], chosen[-1], axis=0), axis=-1))
    return _picked(cand, chosen)


def _picked(cand: mx.array, chosen: list[mx.array]) -> mx.array:
    """The chain's tokens (n,): at each position the candidate of index chosen[t]."""
    idx = mx.stack(chosen)
    return mx.take_along_axis(cand, idx[:, None], axis=-1)[:, 0].astype(mx.int32)


@dataclass
class LatticeDrafts:
    """A DFlash 2 drafter's proposal (engine/contract.py Proposal): its logits and its
    selector's lattice, whose chain the drafts follow (greedy: z-lab's selector; sampling:
    drawn from the lattice, with its sparse q) and whose paths the tree expands."""

    logits: mx.array  # (n, V)
    lattice: Lattice
    queued: tuple[float, list[mx.array]] | None = None  # (temperature, tree_inputs), queued

    def chain(self, sampling: SamplingParams, key: mx.array | None):
        if key is None:
            return self.lattice.greedy(), None
        return self.lattice.sample(sampling.temperature, key, self.logits.shape[-1])

    def queue(self, budget: int, branching: int | None, temperature: float, constrained: bool):
        """The pass queued with every score the tree reads, so the tree waits once, for what
        the device computed while the host looked for lookup branches."""
        self.queued = (temperature, tree_inputs(self.lattice, temperature))
        mx.async_eval(self.logits, *self.queued[1])

    def _inputs(self, temperature: float) -> list[mx.array] | None:
        return self.queued[1] if self.queued and self.queued[0] == temperature else None

    def tree(self, root: int, budget: int, branching: int | None, temperature: float) -> Tree:
        inputs = self._inputs(temperature)
        return lattice_tree(root, self.lattice, budget, branching, temperature, None, inputs)[0]

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
        """The lattice's tree of what the grammar allows, cut, and its forced run at the root."""
        k = min(branching or budget, budget)
        inputs = self._inputs(temperature)
        tree, pruned = lattice_tree(root, self.lattice, budget, k, temperature, grammar, inputs)
        return with_certain_run(cut(tree), grammar, min(tokens_left, budget)), pruned


def tree_inputs(lattice: Lattice, temperature: float) -> list[mx.array]:
    """What lattice_tree reads from the device, in one wait: the candidates, their scores and
    the mass off them (on the CPU, the logits that numpy sums)."""
    f32 = mx.float32
    off_parts = [] if lattice.logits is None else lattice.off_parts(temperature, on_cpu())
    return [lattice.cand, lattice.first.astype(f32), lattice.pairs.astype(f32), *off_parts]


def lattice_tree(
    root: int,
    lattice: Lattice,
    budget: int,
    branching: int | None = None,
    temperature: float = 1.0,
    grammar: Grammar | None = None,
    inputs: list[mx.array] | None = None,
) -> tuple[Tree, int]:
    """Best-first over the lattice's paths (tree.best_first): the `budget` most probable
    prefixes under the selector's chain distribution (log softmax(score / T) along the path,
    normalised with the logits' mass off the candidates when the lattice has its logits),
    parents first, at most `branching` children a node. A node's state is its candidate index;
    its children are the next position's candidates in the order of `pairs[depth][index]`.
    Under a grammar, only what it allows (its forced runs are the caller's: a forced token has
    no candidate index to continue from). `inputs`: tree_inputs, already queued. Returns (tree,
    candidates the grammar refused).
    """
    cand, first, pairs, *parts = read(*(inputs or tree_inputs(lattice, temperature)))
    n, k = cand.shape
    k = min(k, branching or k)
    first = first.astype(np.float64) / temperature
    pairs = pairs.astype(np.float64) / temperature
    off = lattice.off_from(parts, temperature) if parts else np.full(n, -np.inf)
    first_lp = _log_softmax(first, off[0])
    pairs_lp = _log_softmax(pairs, off[1:, None, None]) if n > 1 else pairs
    # As lists: the heap asks a few hundred single entries, each a numpy scalar otherwise.
    first_order = np.argsort(-first_lp, kind="stable").tolist()
    pairs_order = np.argsort(-pairs_lp, axis=-1, kind="stable").tolist()
    tokens, first_lps, pairs_lps = cand.tolist(), first_lp.tolist(), pairs_lp.tolist()

    def child(depth: int, parent_idx: int | None, rank: int) -> tuple[int, float, int]:
        """The rank-th best child at `depth` of a parent holding candidate `parent_idx` at
        depth - 1 (None: the anchor, at depth 0): (token, log-prob, its candidate index)."""
        if depth == 0:
            j = first_order[rank]
            return tokens[0][j], first_lps[j], j
        j = pairs_order[depth - 1][parent_idx][rank]
        return tokens[depth][j], pairs_lps[depth - 1][parent_idx][j], j

    return best_first(root, child, n, k, budget, grammar, runs=False)


def _log_softmax(x: np.ndarray, off) -> np.ndarray:
    """log softmax over the last axis with `off` (log of more mass, broadcast) in the sum."""
    top = np.maximum(x.max(axis=-1, keepdims=True), off)
    return x - (top + np.log(np.exp(x - top).sum(axis=-1, keepdims=True) + np.exp(off - top)))
