"""Standard and gated attention under verification (llama, qwen2/3, qwen3_moe; the full-attention
layers of Qwen3.5 / Qwen3-Next; Muse Glimmer's), through mlx-lm's own projections, norms and rope.

One function per attention family: this one for multi-head attention with GQA; Gated DeltaNet
is gated_deltanet.py; MLA (DeepSeek-V3 / Kimi) is mla.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..kernels.cpu_attention import cpu_attention, use_cpu_attention
from ..kernels.tree_attention import ancestor_mask, tree_attention
from .cache import KVCache


@dataclass(frozen=True)
class AttentionSpec:
    """What the standard-attention families do differently."""

    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    gated: bool = False  # q_proj also yields a per-head output gate (Qwen3.5 / Qwen3-Next)
    # Muse Glimmer: weightless RMSNorm on q and k, q times the module's qk_scale_factor, and an
    # output gate from a gate_proj of the layer input. Its RoPE-less layers (layer_rope_theta 0)
    # and sliding windows are per layer, read from mlx-lm's module (use_rope, is_sliding).
    scaleless_qk: bool = False
    gate_proj: bool = False


def attention(
    attn,
    spec: AttentionSpec,
    x,
    cache: KVCache,
    start: int,
    positions,
    parents,
    masks: dict,
    window: int | None = None,
) -> mx.array:
    """mlx-lm's attention module `attn` over x (1, T, H): per-token positions (`positions`,
    else start..start+T-1) and causal or tree attention (`parents`); K/V appended to `cache`.
    `masks` is shared by the layers of one verify, so a tree's mask is built once.
    `window`: a sliding-window layer's width (a query sees the `window` newest positions)."""
    T = x.shape[1]
    n_heads = getattr(attn, "n_heads", None) or attn.num_attention_heads
    n_kv = getattr(attn, "n_kv_heads", None) or attn.num_key_value_heads
    q = attn.q_proj(x).reshape(1, T, n_heads, -1)
    gate = None
    if spec.gated:
        q, gate = mx.split(q, 2, axis=-1)
        gate = gate.reshape(1, T, -1)
    elif spec.gate_proj:
        gate = attn.gate_proj(x)
    k = attn.k_proj(x).reshape(1, T, n_kv, -1)
    v = attn.v_proj(x).reshape(1, T, n_kv, -1).transpose(0, 2, 1, 3)
    if spec.scaleless_qk:
        q = mx.fast.rms_norm(q, None, attn.eps) * attn.qk_scale_factor
        k = mx.fast.rms_norm(k, None, attn.eps)
    elif spec.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = _rotate(attn, q, k, start, positions)
    keys, values = cache.append(k, v)
    if window is not None and start + T > window:  # a query may be past some cached key
        if "window" not in masks:  # the same for every sliding layer of this pass
            masks["window"] = window_mask(q.shape[2], start, positions, parents, window)
        lo = max(0, start - window + 1)  # keys before it are out of every query's window
        out = mx.fast.scaled_dot_product_attention(
            q, keys[:, :, lo:], values[:, :, lo:], scale=attn.scale, mask=masks["window"]
        )
    elif parents is None:
        mask = "causal" if T > 1 else None
        if use_cpu_attention():
            out = cpu_attention(q, keys, values, attn.scale, mask)
        else:
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale, mask=mask)
    else:
        out = tree_attention(q, keys, values, parents, attn.scale, masks)
    out = out.transpose(0, 2, 1, 3).reshape(1, T, -1)
    if gate is not None:
        out = out * mx.sigmoid(gate)
    return attn.o_proj(out)


def _rotate(attn, q, k, start: int, positions):
    """(1, heads, T, D) q and k, rotated at their positions unless the layer has no RoPE."""
    if not getattr(attn, "use_rope", True):  # Muse Glimmer's full-attention layers: NoPE
        return q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
    if positions is None:
        q = attn.rope(q.transpose(0, 2, 1, 3), offset=start)
        k = attn.rope(k.transpose(0, 2, 1, 3), offset=start)
        return q, k
    # mx.fast.rope takes one offset per batch row: put the tokens on the batch axis.
    q = attn.rope(q.transpose(1, 2, 0, 3), offset=positions).transpose(2, 1, 0, 3)
    k = attn.rope(k.transpose(1, 2, 0, 3), offset=positions).transpose(2, 1, 0, 3)
    return q, k


def window_mask(T: int, start: int, positions, parents, window: int) -> mx.array:
    """The boolean mask of a sliding-window layer over the keys from its window's start: a
    query at position p sees cached positions p-window+1..p only (what mlx-lm's sliding layers
    compute), within the causal or tree mask. Taken only once the context has passed the window,
    and exact, so it goes to MLX's fused attention rather than a kernel of its own; built lazily
    in MLX (no host sync), once per pass."""
    if parents is None:
        q_pos = start + mx.arange(T)
        base = mx.tril(mx.ones((T, T), dtype=mx.bool_))
    else:
        q_pos = positions
        base = ancestor_mask(parents, 0)
    lo = max(0, start - window + 1)  # the shallowest query's first visible position
    k_pos = mx.concatenate([mx.arange(lo, start), q_pos])  # this pass's keys sit at q_pos
    prefix = mx.ones((T, start - lo), dtype=mx.bool_)
    return mx.concatenate([prefix, base], axis=1) & (k_pos[None, :] > q_pos[:, None] - window)
