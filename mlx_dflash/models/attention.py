"""Standard and gated attention under verification (llama, qwen2/3, qwen3_moe; the full-attention
layers of Qwen3.5 / Qwen3-Next), through mlx-lm's own projections, norms and rope.

One function per attention family: this one for multi-head attention with GQA; Gated DeltaNet
is gated_deltanet.py; MLA (DeepSeek-V3 / Kimi) is mla.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..kernels.cpu_attention import cpu_attention, use_cpu_attention
from ..kernels.tree_attention import tree_attention
from .cache import KVCache


@dataclass(frozen=True)
class AttentionSpec:
    """What the standard-attention families do differently."""

    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    gated: bool = False  # q_proj also yields a per-head output gate (Qwen3.5 / Qwen3-Next)


def attention(
    attn, spec: AttentionSpec, x, cache: KVCache, start: int, positions, parents, masks: dict
) -> mx.array:
    """mlx-lm's attention module `attn` over x (1, T, H): per-token positions (`positions`,
    else start..start+T-1) and causal or tree attention (`parents`); K/V appended to `cache`.
    `masks` is shared by the layers of one verify, so a tree's mask is built once."""
    T = x.shape[1]
    n_heads = getattr(attn, "n_heads", None) or attn.num_attention_heads
    n_kv = getattr(attn, "n_kv_heads", None) or attn.num_key_value_heads
    q = attn.q_proj(x).reshape(1, T, n_heads, -1)
    gate = None
    if spec.gated:
        q, gate = mx.split(q, 2, axis=-1)
        gate = gate.reshape(1, T, -1)
    k = attn.k_proj(x).reshape(1, T, n_kv, -1)
    v = attn.v_proj(x).reshape(1, T, n_kv, -1).transpose(0, 2, 1, 3)
    if spec.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    if positions is None:
        q = attn.rope(q.transpose(0, 2, 1, 3), offset=start)
        k = attn.rope(k.transpose(0, 2, 1, 3), offset=start)
    else:
        # mx.fast.rope takes one offset per batch row: put the tokens on the batch axis.
        q = attn.rope(q.transpose(1, 2, 0, 3), offset=positions).transpose(2, 1, 0, 3)
        k = attn.rope(k.transpose(1, 2, 0, 3), offset=positions).transpose(2, 1, 0, 3)
    keys, values = cache.append(k, v)
    if parents is None:
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
