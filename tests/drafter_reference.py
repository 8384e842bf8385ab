"""An independent NumPy reference of the DFlash drafter's forward pass (float64), read from a raw
published config.json and the tensors under their published names: what
tests/test_drafter_variants.py holds our MLX drafter to.

Written from the sources each variant cites, not from mlx_dflash: ../shared/docs/algorithm.md §1
(z-lab's layout and forward); vLLM's qwen3_dflash (`_resolve_layer_attention` for
`dflash_config.use_swa` / `swa_window_size` and causality, sink logits, the value scale on
context and block values, Muse Glimmer's `encoder.*` tensor names); mlx-lm's mimo_v2_flash and
gpt_oss (a sink is one more softmax column per head, with no value); Hugging Face's
`_compute_yarn_parameters` (YaRN frequencies and attention factor) and partial RoPE (the first
`head_dim * partial_rotary_factor` dimensions rotate, neox-style).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

SLIDING = "sliding_attention"
RENAMES = (("encoder.fc.", "fc."), ("encoder.output_norm_enc.", "hidden_norm."))


def zlab_name(name: str) -> str:
    """A published tensor name as z-lab's layout spells it: no `model.`, Muse's mapped."""
    name = name.removeprefix("model.")
    for alias, zlab in RENAMES:
        if name.startswith(alias):
            return zlab + name[len(alias) :]
    return name


def published_tensors(weights: dict[str, Any]) -> dict[str, np.ndarray]:
    """float64 copies under z-lab's names."""
    return {zlab_name(k): np.asarray(w, dtype=np.float64) for k, w in weights.items()}


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def layer_attention(cfg: dict, i: int) -> tuple[int | None, bool]:
    """(sliding window or None, causal) of drafter layer i, as vLLM resolves them."""
    d = cfg.get("dflash_config") or {}
    types = cfg.get("layer_types")
    use_swa = bool(d.get("use_swa", False))
    any_sliding = types is not None and SLIDING in types
    forced = types is None or (use_swa and not any_sliding)
    sliding = use_swa if forced else types[i] == SLIDING
    window = d.get("swa_window_size", cfg.get("sliding_window")) if sliding else None
    explicit = cfg.get("is_causal", d.get("is_causal", d.get("causal")))
    causal = (not forced and types[i] == SLIDING) if explicit is None else bool(explicit)
    return (None if window is None else int(window)), causal


def _yarn(rope: dict, theta: float, dim: int) -> tuple[np.ndarray, float]:
    """Hugging Face's YaRN: blended inverse frequencies and the attention factor."""
    factor = float(rope["factor"])
    orig = float(rope["original_max_position_embeddings"])
    beta_fast, beta_slow = float(rope.get("beta_fast", 32)), float(rope.get("beta_slow", 1))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.get("mscale") and rope.get("mscale_all_dim"):
        attention = mscale(factor, rope["mscale"]) / mscale(factor, rope["mscale_all_dim"])
    else:
        attention = mscale(factor)

    def correction(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction(beta_fast)), 0)
    high = min(math.ceil(correction(beta_slow)), dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / max(high - low, 0.001), 0, 1)
    extrapolation = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    return extrapolation / factor * (1 - keep) + extrapolation * keep, attention


def rope_frequencies(cfg: dict) -> tuple[np.ndarray, int, float]:
    """(inverse frequencies, rotated dimensions, attention factor) for the drafter's heads."""
    rope = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    factor = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    dim = int(head_dim * float(factor))
    scaling = cfg.get("rope_scaling") or (
        rope if rope.get("rope_type") not in (None, "default") else None
    )
    if scaling is None:
        return 1.0 / theta ** (np.arange(0, dim, 2) / dim), dim, 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    assert kind == "yarn", f"the reference knows default and yarn rope, not {kind}"
    inv, attention = _yarn(scaling, theta, dim)
    return inv, dim, attention


def rotate(x: np.ndarray, positions: np.ndarray, rope: tuple) -> np.ndarray:
    """x (n, heads, d) at `positions`: the first `dim` dimensions rotated (halves split)."""
    inv, dim, attention = rope
    angles = positions[:, None] * inv[None]  # (n, dim/2)
    cos, sin = np.cos(angles)[:, None] * attention, np.sin(angles)[:, None] * attention
    a, b, rest = x[..., : dim // 2], x[..., dim // 2 : dim], x[..., dim:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin, rest], axis=-1)


def _project(x, w, prefix, name, heads, eps=None, norm=None):
    y = x @ w[f"{prefix}{name}_proj.weight"].T
    if f"{prefix}{name}_proj.bias" in w:
        y = y + w[f"{prefix}{name}_proj.bias"]
    y = y.reshape(len(x), heads, -1)
    return y if norm is None else rms_norm(y, w[prefix + norm], eps)


def attention(cfg, w, i, x, ctx, start) -> np.ndarray:
    """Layer i's attention for the block x (L, H) at start.. over the context c (S, H) at 0.."""
    p, eps = f"layers.{i}.self_attn.", float(cfg.get("rms_norm_eps", 1e-6))
    nh, nkv = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    rope, (L, S) = rope_frequencies(cfg), (len(x), len(ctx))
    scale = (cfg.get("dflash_config") or {}).get("attention_value_scale", 1.0)
    q_pos, c_pos = np.arange(start, start + L), np.arange(S)
    q = rotate(_project(x, w, p, "q", nh, eps, "q_norm.weight"), q_pos, rope)
    keys = [rotate(_project(y, w, p, "k", nkv, eps, "k_norm.weight"), pos, rope)
            for y, pos in ((ctx, c_pos), (x, q_pos))]  # fmt: skip
    k = np.concatenate(keys)
    v = np.concatenate([_project(ctx, w, p, "v", nkv), _project(x, w, p, "v", nkv)]) * scale
    k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    window, causal = layer_attention(cfg, i)
    gap = q_pos[:, None] - np.concatenate([c_pos, q_pos])[None]
    seen = np.ones_like(gap, dtype=bool)
    if window is not None:
        seen &= np.abs(gap) <= window - 1
    if causal:
        seen &= gap >= 0
    scores = np.where(seen[None], scores, -np.inf)
    if p + "attention_sink_bias" in w:
        sink = np.broadcast_to(w[p + "attention_sink_bias"][:, None, None], (nh, L, 1))
        scores = np.concatenate([scores, sink], axis=-1)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs = (probs / probs.sum(-1, keepdims=True))[..., : S + L]
    out = np.einsum("hqk,khd->qhd", probs, v).reshape(L, -1)
    return _project(out, w, p, "o", 1).reshape(L, -1)


def hidden_states(cfg: dict, w: dict, embeds: np.ndarray, taps: np.ndarray, start: int):
    """The drafter's final-normed hidden states (L, H) for a block at start.., given the
    block's input embeddings (L, H) and the taps (start, n_taps * H) of positions 0..start-1."""
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    ctx = rms_norm(taps @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    h = embeds * (cfg.get("dflash_config") or {}).get("input_embedding_scale", 1.0)
    for i in range(int(cfg["num_hidden_layers"])):
        p = f"layers.{i}."
        h = h + attention(cfg, w, i, rms_norm(h, w[p + "input_layernorm.weight"], eps), ctx, start)
        x = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms_norm(h, w["norm.weight"], eps)


def logits(cfg: dict, h: np.ndarray, head: np.ndarray) -> np.ndarray:
    """The target's LM head over h, then the drafter's multiplier and soft cap."""
    d = cfg.get("dflash_config") or {}
    out = h @ head.T * d.get("output_multiplier", cfg.get("output_multiplier", 1.0))
    cap = d.get("final_logit_softcapping", cfg.get("final_logit_softcapping"))
    return out if not cap else np.tanh(out / cap) * cap
