"""Token distributions and lossless acceptance rules (docs/dflash.md, docs/ddtree.md).

The transform follows mlx-lm's sampler so that our output is distributed exactly like
`mlx_lm.generate` with the same settings: top-p, then top-k, select the candidate set on the
untempered distribution, then the temperature reshapes the survivors.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def token_probs(logits: mx.array, params: SamplingParams) -> np.ndarray:
    """Rows of logits (n, V) -> float64 probabilities after top-p / top-k / temperature."""
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if 0 < params.top_p < 1:
        sorted_lp = mx.sort(logprobs, axis=-1)
        sorted_p = mx.exp(sorted_lp)
        mass_above = mx.cumsum(sorted_p, axis=-1, reverse=True, inclusive=False)
        total = mass_above[..., :1] + sorted_p[..., :1]
        dropped = (mass_above >= params.top_p * total).sum(axis=-1, keepdims=True)
        threshold = mx.take_along_axis(sorted_lp, dropped, axis=-1)
        logprobs = mx.where(logprobs < threshold, -mx.inf, logprobs)
    if params.top_k > 0 and params.top_k < logprobs.shape[-1]:
        kth = mx.sort(logprobs, axis=-1)[..., -params.top_k][..., None]
        logprobs = mx.where(logprobs < kth, -mx.inf, logprobs)
    p = np.array(mx.softmax(logprobs / params.temperature, axis=-1), dtype=np.float64)
    return p / p.sum(axis=-1, keepdims=True)


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """One token from a probability vector (inverse CDF: exact, no renormalisation drift)."""
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), len(p) - 1))


def accept_greedy(drafts: np.ndarray, target_argmax: np.ndarray) -> tuple[int, int]:
    """Longest prefix of drafts equal to the target's argmax; the bonus is the next argmax."""
    n = len(drafts)
    miss = np.nonzero(drafts != target_argmax[:n])[0]
    a = int(miss[0]) if len(miss) else n
    return a, int(target_argmax[a])


def accept_speculative(
    drafts: np.ndarray, p: np.ndarray, q: np.ndarray, rng: np.random.Generator
) -> tuple[int, int]:
    """Speculative sampling: draft k ~ q[k] survives with prob min(1, p/q); on rejection the
    replacement comes from normalize(max(p - q, 0)); after a full accept, the bonus from p[n]."""
    for k, x in enumerate(drafts):
        if rng.random() * q[k, x] < p[k, x]:
            continue
        residual = np.maximum(p[k] - q[k], 0.0)
        if residual.sum() <= 0:  # p == q: rejection has probability zero; guard rounding
            residual = p[k]
        return k, draw(residual, rng)
    return len(drafts), draw(p[len(drafts)], rng)
