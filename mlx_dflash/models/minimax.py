"""MiniMax M2.x under verification: its q and k RMSNorms span all heads at once (one weight
of heads * head_dim), so they run before the per-head split, unlike Qwen3's per-head norms."""

from __future__ import annotations


def minimax_project(attn, x):
    """q, k, v (1, T, heads, D) before RoPE, as mlx-lm's MiniMaxAttention computes them."""
    T = x.shape[1]
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    if attn.use_qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    n_heads, n_kv = attn.num_attention_heads, attn.num_key_value_heads
    return (
        q.reshape(1, T, n_heads, -1),
        k.reshape(1, T, n_kv, -1),
        v.reshape(1, T, n_kv, -1),
        None,
    )
