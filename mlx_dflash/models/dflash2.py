"""What DFlash 2 adds to the drafter (../shared/docs/dflash2.md §2): a dynamic grouped
convolution around each sublayer, and the candidate selector that scores the top-k candidates
of each block position with a pairwise term from the previous position's token.

Parameter names match z-lab's published `DFlash2DraftModel` checkpoints (the codebooks get a
`.weight` when read: see checkpoints/read.py's CODEBOOKS).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..engine.lattice import Lattice
from .compiled import compiled_once


class GroupedDynamicConv(nn.Module):
    """A causal convolution over block positions whose taps are a static per-channel kernel
    plus a per-position, per-group coefficient computed from the sublayer's input. One set of
    coefficients "prepares" the sublayer's input, the other "finishes" its output."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size))
        groups = hidden_size // group_size
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * groups, bias=False)

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(x convolved with the first kernel, the coefficients `finish` uses)."""
        groups = x.shape[-1] // self.group_size
        d = self.kernel_projection(x).reshape(*x.shape[:-1], 2, self.kernel_size, groups)
        return self._convolve(x, d[..., 0, :, :], 0), d[..., 1, :, :]

    def finish(self, y: mx.array, d: mx.array) -> mx.array:
        return self._convolve(y, d, 1)

    def _convolve(self, x: mx.array, d: mx.array, which: int) -> mx.array:
        """sum over o of (base[which][o] + d[t, o, group]) * x[t - o], zero before the block.
        The order of the additions follows z-lab's so that drafts agree to the bit."""
        b, length, h = x.shape
        groups = h // self.group_size
        blocks = x.reshape(b, length, groups, self.group_size)
        d = d.reshape(b, length, self.kernel_size, groups, 1)
        base = self.base_kernel[which]
        out = mx.zeros_like(blocks)
        for o in range(self.kernel_size):
            shifted = (
                blocks
                if o == 0
                else mx.concatenate([mx.zeros_like(blocks[:, :o]), blocks[:, :-o]], axis=1)
            )
            kernel = base[o].reshape(1, 1, groups, self.group_size).astype(x.dtype)
            out = out + kernel * shifted
            out = out + d[:, :, o] * shifted
        return out.reshape(x.shape)


class CandidateSelector(nn.Module):
    """score[t, c] = logit[t, c] + <P[prev], g[t], S[c]> over each position's top-k logits,
    where prev is the token chosen at t-1 (the anchor for t = 0) and g = hidden_projection(h)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)
        self.successor_codebook = nn.Embedding(vocab_size, rank)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def lattice(
        self, hidden: mx.array, logits: mx.array, anchor: int, compiled: bool = False
    ) -> Lattice:
        """Every edge of the lattice at once, from hidden (n, H) and logits (n, V) of the n
        draft positions: one k x k table per position, where z-lab's loop scores one row.
        `compiled`: through mx.compile, as the target's layers where they run compiled
        (models/compiled.py: on a GPU, where its fused arithmetic measured bit-exact): about
        20 operations a pass are one call for the host, traced once a block size. Its only
        arithmetic is products and sums, so nothing a fused kernel could contract."""
        fn = compiled_once(self, lambda: (self._scores,))[0] if compiled else self._scores
        cand, first, pairs = fn(hidden, logits, mx.array([anchor]))
        return Lattice(cand, first, pairs, logits)  # logits: lattice_tree's

    def _scores(self, hidden: mx.array, logits: mx.array, anchor: mx.array):
        """The lattice's candidates (n, k), first row (k,) and pairs (n - 1, k, k)."""
        # The same call as z-lab's, so candidates come in the same order (ties agree too).
        cand = mx.argpartition(logits, -self.top_k, axis=-1)[..., -self.top_k :]
        unary = mx.take_along_axis(logits, cand, axis=-1)
        g = self.hidden_projection(hidden)  # (n, r)
        succ = self.successor_codebook(cand)  # (n, k, r)
        anchor_row = self.predecessor_codebook(anchor)  # (1, r)
        # Products in z-lab's order ((P * g) * S), so the scores agree to the bit.
        first = unary[0] + mx.sum(anchor_row[:, None] * g[0, None] * succ[0][None], -1)[0]
        if cand.shape[0] == 1:  # one position: no pairs (an empty lookup breaks quantized tables)
            k = cand.shape[1]
            return cand.astype(mx.int32), first, mx.zeros((0, k, k), first.dtype)
        pred = self.predecessor_codebook(cand[:-1])  # (n-1, k, r): each previous candidate
        edges = mx.sum((pred * g[1:, None])[:, :, None] * succ[1:, None], axis=-1)
        pairs = unary[1:, None, :] + edges  # (n-1, k_prev, k)
        return cand.astype(mx.int32), first, pairs
