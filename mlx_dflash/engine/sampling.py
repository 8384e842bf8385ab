"""Token distributions and lossless acceptance rules (docs/dflash.md, docs/ddtree.md).

The transform follows mlx-lm's sampler so that our output is distributed exactly like
`mlx_lm.generate` with the same settings: top-p, then min-p, then XTC, then top-k select the
candidate set on the untempered distribution, then the temperature reshapes the survivors.
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
    # min-p (mlx-lm's): drop tokens less probable than min_p times the most probable one,
    # keeping at least min_tokens_to_keep
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    # XTC (mlx-lm's): with probability xtc_probability a token's draw excludes every token
    # above xtc_threshold but the least probable of them (never the xtc_special ones); so the
    # distribution a token is drawn from is the mixture of the two, which acceptance uses.
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    xtc_special: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "xtc_special", tuple(int(t) for t in self.xtc_special))

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def token_probs(logits: mx.array, params: SamplingParams) -> np.ndarray:
    """Rows of logits (n, V) -> float64 probabilities after top-p / top-k / temperature."""
    p = np.array(device_probs(logits, params), dtype=np.float64)
    return p / p.sum(axis=-1, keepdims=True)


def device_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """The same distribution as token_probs, left on the device (float32, lazy)."""
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
    if params.min_p > 0:
        floor = logprobs.max(axis=-1, keepdims=True) + float(np.log(params.min_p))
        keep = max(1, params.min_tokens_to_keep)
        if keep > 1:  # the keep-th most probable survives whatever min-p says
            floor = mx.minimum(floor, mx.sort(logprobs, axis=-1)[..., -keep][..., None])
        logprobs = mx.where(logprobs < floor, -mx.inf, logprobs)
    if params.xtc_probability > 0:
        x = params.xtc_probability
        kept = _softmax_top_k(logprobs, params)
        excluded = _softmax_top_k(_xtc(logprobs, params), params)
        return (1 - x) * kept + x * excluded
    return _softmax_top_k(logprobs, params)


def _softmax_top_k(logprobs: mx.array, params: SamplingParams) -> mx.array:
    if params.top_k > 0 and params.top_k < logprobs.shape[-1]:
        kth = mx.sort(logprobs, axis=-1)[..., -params.top_k][..., None]
        logprobs = mx.where(logprobs < kth, -mx.inf, logprobs)
    return mx.softmax(logprobs / params.temperature, axis=-1)


def _xtc(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """XTC's exclusion (mlx-lm's apply_xtc when its coin says so): every token more probable
    than the least probable of those above the threshold goes, special tokens excepted."""
    probs = mx.softmax(logprobs, axis=-1)
    above = mx.where(probs > params.xtc_threshold, probs, mx.inf)
    drop = probs > above.min(axis=-1, keepdims=True)
    if params.xtc_special:
        special = np.zeros(logprobs.shape[-1], dtype=bool)
        special[list(params.xtc_special)] = True
        drop = drop & ~mx.array(special)
    return mx.where(drop, -mx.inf, logprobs)


def speculative_on_device(drafts, p, q, key) -> tuple[mx.array, mx.array]:
    """Speculative sampling's acceptance rule as MLX ops, so a sampled round reads back one
    small array (docs/dflash.md).

    drafts (n,) drawn from q (n, V); p (n+1, V) the target's distributions. Returns (a, bonus):
    the accepted count (first draft failing u * q < p) and the token that follows, drawn from
    normalize(max(p[a] - q[a], 0)), or from p[n] after a full accept (q[n] taken as 0).
    """
    n = drafts.shape[0]
    k_u, k_b = mx.random.split(key)
    rows = mx.arange(n)
    u = mx.random.uniform(shape=(n,), key=k_u)
    ok = u * q[rows, drafts] < p[rows, drafts]
    a = mx.cumprod(ok.astype(mx.int32)).sum()
    q_ext = mx.concatenate([q, mx.zeros((1, q.shape[-1]), q.dtype)])
    p_a, q_a = mx.take(p, a, axis=0), mx.take(q_ext, a, axis=0)
    residual = mx.maximum(p_a - q_a, 0.0)
    # p == q leaves no residual mass: rejection then had probability zero; guard rounding.
    residual = mx.where(residual.sum() > 0, residual, p_a)
    bonus = mx.random.categorical(mx.log(residual), key=k_b)
    return a, bonus


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
