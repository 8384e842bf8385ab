"""Attention on MLX's CPU backend, where the exponentials, not the matmuls, are the cost.

MLX's CPU `exp` runs at ~85M values/s here, `power(2, x)` about 2.5x faster, and a 16-token
verify over a long cache computes 16x the exponentials of a one-token step. So off Metal the
target's attention (causal verify, tree verify and plain steps alike, so that they agree) uses
grouped-query matmuls (each KV head's queries in one matmul, no K/V copy per query head) and a
base-2 softmax: 2^(s * log2(e) - max) is exactly e^(s - max) up to rounding. Measured against
`mx.fast.scaled_dot_product_attention` on this CPU: 1.8-2.3x faster from 1K to 16K keys, within
1e-6 (tests/test_cpu_attention.py checks the agreement; scripts/verify_cost.py
measures verify cost). On Metal the fused kernel is used as before. From 16K scores on x86,
numpy computes the softmax's exponentials instead (kernels/cpu_math.py), ~2.5x faster again.
"""

from __future__ import annotations

import mlx.core as mx

from ..engine.device import on_cpu
from ..settings import SETTINGS
from . import cpu_math

LOG2E = 1.4426950408889634
# Prefill chunks over a long cache go key block by key block (online softmax), so a chunk's
# scores never exist whole: 512 queries x 16K keys x 9 heads was 300 MB per layer, and its
# page faults cost more than the arithmetic. Verify and decoding (few queries) are unchanged.
KEY_BLOCK = 2048
BLOCKED_MIN_QUERIES = 64


def use_cpu_attention() -> bool:
    """A CPU trick (engine/device.py): on the CPU backend only, unless DFLASH_MLX_CPU_ATTENTION
    is 0 (MLX's fused attention then, as on a GPU: scripts/host_time.py measures a Mac's
    graphs that way)."""
    return on_cpu() and SETTINGS.choice("cpu_attention", ("auto", "0")) == "auto"


def cpu_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask: str | mx.array | None = None,
    masks: dict | None = None,
) -> mx.array:
    """scaled_dot_product_attention(q, k, v, scale, mask) with a base-2 softmax (numpy's exp
    from cpu_math.MIN_VALUES scores on x86).

    q (B, Hq, T, D); k, v (B, Hkv, S, D) with Hq a multiple of Hkv; mask None, "causal" (the T
    queries are the last T positions) or a boolean (T, S) array, True where attention is allowed.
    `masks`: a forward's dict its layers share, where the causal mask is built once.
    """
    b, n_q, t, d = q.shape
    n_kv, s_len = k.shape[1], k.shape[2]
    rep = n_q // n_kv
    blocked = mask == "causal" and t >= BLOCKED_MIN_QUERIES and s_len > 2 * KEY_BLOCK
    # numpy's exponentials (kernels/cpu_math.py) take natural-base scores; MLX's base-2 ones
    on_numpy = not blocked and cpu_math.applies(b * n_q * t * s_len, q.dtype)
    qg = (q * (scale if on_numpy else scale * LOG2E)).reshape(b, n_kv, rep * t, d)
    if blocked:
        out = _blocked_causal(qg, k, v, rep, t)
        return out.reshape(b, n_q, t, v.shape[-1]).astype(q.dtype)
    s = qg @ k.swapaxes(-1, -2)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask {mask!r}")
        mask = causal_mask(t, s_len, masks)
    if on_numpy:
        out = cpu_math.softmax(s.astype(mx.float32), mask, rep) @ v
        return out.reshape(b, n_q, t, v.shape[-1]).astype(q.dtype)
    if mask is not None:
        s = mx.where(mask, s.reshape(b, n_kv, rep, t, s_len), -mx.inf).reshape(s.shape)
    p = mx.power(2.0, s - s.max(axis=-1, keepdims=True))
    out = (p @ v) / p.sum(axis=-1, keepdims=True)
    return out.reshape(b, n_q, t, v.shape[-1]).astype(q.dtype)


def causal_mask(t: int, s_len: int, masks: dict | None = None) -> mx.array | None:
    """The boolean (t, s_len) causal mask of t queries at the last t positions (None for one),
    kept in `masks` (a forward's, shared by its layers) so that it is built once a forward."""
    if t == 1:
        return None
    key = ("causal", t, s_len)
    if masks is not None and key in masks:
        return masks[key]
    mask = mx.arange(s_len)[None, :] <= (mx.arange(t) + (s_len - t))[:, None]
    if masks is not None:
        masks[key] = mask
    return mask


def _blocked_causal(qg: mx.array, k: mx.array, v: mx.array, rep: int, t: int) -> mx.array:
    """Causal base-2 attention over KEY_BLOCK keys at a time, merged with running maxima
    (the flash-attention recurrence); each block is evaluated before the next is built, which
    is what bounds the memory (a lazy graph would hold every block's scores at once)."""
    b, n_kv, s_len = k.shape[0], k.shape[1], k.shape[2]
    q_pos = (mx.arange(t) + (s_len - t))[:, None]
    m = total = o = None
    for j in range(0, s_len, KEY_BLOCK):
        kb, vb = k[:, :, j : j + KEY_BLOCK], v[:, :, j : j + KEY_BLOCK]
        s = qg @ kb.swapaxes(-1, -2)
        if j + KEY_BLOCK > s_len - t:  # the block reaches the queries' own positions
            allowed = mx.arange(j, min(j + KEY_BLOCK, s_len))[None, :] <= q_pos
            s = mx.where(allowed, s.reshape(b, n_kv, rep, t, -1), -mx.inf).reshape(s.shape)
        mb = s.max(axis=-1, keepdims=True)
        if m is None:
            m = mb
            p = mx.power(2.0, s - m)
            total, o = p.sum(axis=-1, keepdims=True), p @ vb
        else:
            new_m = mx.maximum(m, mb)
            alpha = mx.power(2.0, m - new_m)
            p = mx.power(2.0, s - new_m)
            total = total * alpha + p.sum(axis=-1, keepdims=True)
            o = o * alpha + p @ vb
            m = new_m
        mx.eval(m, total, o)
    return o / total
