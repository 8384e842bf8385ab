"""Gemma 4 under verification, through mlx-lm's gemma4_text modules and weights.

What differs from the common layer (models/target.py calls these):
- q and k get a per-head RMSNorm with weights, v a weightless one; global layers of the 26B and
  31B models have no v_proj (`attention_k_eq_v`: the values are the unnormed keys); the scale
  is 1 (the norms do the work). Sliding and global layers differ in head size and RoPE (global:
  `proportional`, a quarter of the dims rotated), which the modules carry.
- A sandwich block: norms after attention and after the feed-forward, a dense MLP plus, in the
  MoE models, a routed expert branch with norms of its own; then a learned layer scalar.
"""

from __future__ import annotations


def gemma4_project(attn, x):
    """q, k, v (1, T, heads, D) before RoPE, as mlx-lm's Attention computes them."""
    T = x.shape[1]
    q = attn.q_norm(attn.q_proj(x).reshape(1, T, attn.n_heads, attn.head_dim))
    k = attn.k_proj(x).reshape(1, T, attn.n_kv_heads, attn.head_dim)
    v = k if attn.use_k_eq_v else attn.v_proj(x).reshape(1, T, attn.n_kv_heads, attn.head_dim)
    return q, attn.k_norm(k), attn.v_norm(v), None


def gemma4_block(layer, h, mix, ffn):
    """One decoder layer around its attention `mix` and dense MLP `ffn` (mlx-lm's DecoderLayer,
    minus the per-layer inputs and shared K/V of the small models, which models/target.py
    refuses)."""
    h = h + layer.post_attention_layernorm(mix(layer.input_layernorm(h)))
    ff = ffn(layer.pre_feedforward_layernorm(h))
    if layer.enable_moe:
        ff = layer.post_feedforward_layernorm_1(ff)
        experts, weights = layer.router(h)
        routed = layer.experts(layer.pre_feedforward_layernorm_2(h), experts, weights)
        ff = ff + layer.post_feedforward_layernorm_2(routed)
    h = h + layer.post_feedforward_layernorm(ff)
    return h if layer.layer_scalar is None else h * layer.layer_scalar
