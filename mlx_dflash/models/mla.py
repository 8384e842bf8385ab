"""Multi-head latent attention (DeepSeek-V3, Kimi-K2 / K2.5) under verification, through
mlx-lm's own DeepseekV3Attention projections, norms and (yarn) rope.

The cache holds what mlx-lm's does: per position the normalised KV latent (kv_lora_rank wide)
as "keys" and the rope'd shared key part (qk_rope_head_dim) as "values", one head each, so a
tree's rejected nodes are trimmed and the accepted path compacted like any KVCache row. What
verification adds is per-token positions (tree nodes at one depth share a position) and an
arbitrary boolean mask (causal block or ancestor tree) over that latent cache, applied to the
rope part of the scores exactly where mlx-lm applies its causal mask.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention

from ..kernels.tree_attention import ancestor_mask
from .attention import rope_at
from .cache import KVCache


def is_mla(attn) -> bool:
    return hasattr(attn, "kv_a_proj_with_mqa")


def mla_attention(
    attn, x: mx.array, cache: KVCache, start: int, positions, parents, masks: dict
) -> mx.array:
    """mlx-lm's DeepseekV3Attention over x (1, T, H), with per-token `positions` (else
    start..start+T-1) and causal or tree (`parents`) attention; latents appended to `cache`."""
    _, T, _ = x.shape
    H = attn.num_heads
    if attn.q_lora_rank is None:
        q = attn.q_proj(x)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    q = q.reshape(1, T, H, attn.q_head_dim).transpose(0, 2, 1, 3)
    q_nope, q_pe = mx.split(q, [attn.qk_nope_head_dim], axis=-1)
    compressed, k_pe = mx.split(attn.kv_a_proj_with_mqa(x), [attn.kv_lora_rank], axis=-1)
    k_pe = k_pe.reshape(1, T, 1, attn.qk_rope_head_dim).transpose(0, 2, 1, 3)
    latent = mx.expand_dims(attn.kv_a_layernorm(compressed), axis=1)
    at = start if positions is None else positions
    q_pe = rope_at(attn.rope, q_pe, at)
    k_pe = rope_at(attn.rope, k_pe, at)
    latent, k_pe = cache.append(latent, k_pe)
    S = latent.shape[2]

    pe_scores = (q_pe * attn.scale) @ k_pe.swapaxes(-1, -2)
    mask = None
    if parents is not None:
        key = ("mla", S - T)
        mask = masks.get(key)
        if mask is None:
            mask = masks[key] = ancestor_mask(parents, S - T)
    elif T > 1:
        mask = mx.arange(S)[None, :] <= (mx.arange(T) + (S - T))[:, None]
    if mask is not None:
        floor = mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype)
        pe_scores = mx.where(mask, pe_scores, floor)

    if T == 1:  # as mlx-lm decodes: the query absorbed into the latent space
        q_nope = attn.embed_q(q_nope)
        k = v = latent
    else:
        k = attn.embed_q(latent, transpose=False)
        v = attn.unembed_out(latent)
    out = scaled_dot_product_attention(q_nope, k, v, cache=None, scale=attn.scale, mask=pe_scores)
    if T == 1:
        out = attn.unembed_out(out)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(1, T, -1))
