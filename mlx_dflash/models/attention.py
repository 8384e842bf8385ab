"""Standard and gated attention under verification (llama, qwen2/3, qwen3_moe; the full-attention
layers of Qwen3.5 / Qwen3-Next; Muse Glimmer's), through mlx-lm's own projections, norms and rope.

One function per attention family: this one for multi-head attention with GQA; Gated DeltaNet
is gated_deltanet.py; MLA (DeepSeek-V3 / Kimi) is mla.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from ..kernels.cpu_attention import cpu_attention, use_cpu_attention
from ..kernels.tree_attention import ancestor_mask, tree_attention, tree_mask
from .arena import SlotCache, plan_forward, step_attention
from .cache import KVCache, QuantizedKVCache, RotatingKVCache, rotating_mask
from .padding import pad_rows


@dataclass(frozen=True)
class AttentionSpec:
    """What the standard-attention families do differently before RoPE; everything after it
    (per-token positions, cache, causal / tree / window masks, sinks, gate, o_proj) is shared."""

    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3; GLM if use_qk_norm)
    gated: bool = False  # q_proj also yields a per-head output gate (Qwen3.5 / Qwen3-Next)
    # Muse Glimmer: weightless RMSNorm on q and k, q times the module's qk_scale_factor, and an
    # output gate from a gate_proj of the layer input. Its RoPE-less layers (layer_rope_theta 0)
    # and sliding windows are per layer, read from mlx-lm's module (use_rope, is_sliding).
    scaleless_qk: bool = False
    gate_proj: bool = False
    # A family whose projections differ altogether (Gemma 4, MiniMax): a function
    # (attn, x) -> q (1, T, heads, D), k (1, T, kv, D), v (1, T, kv, Dv), gate or None.
    project: Callable | None = None


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
    real: int | None = None,
) -> mx.array:
    """mlx-lm's attention module `attn` over x (1, T, H): per-token positions (`positions`,
    else start..start+T-1) and causal or tree attention (`parents`); K/V appended to `cache`.
    `masks` is shared by the layers of one verify, so a tree's mask is built once.
    `window`: a sliding-window layer's width (a query sees the `window` newest positions).
    `real`: how many of x's rows are tokens; the rest are row padding (models/padding.py), which
    the projections run over and nothing else sees."""
    q, k, v, gate = _qkv(attn, spec, x, start, positions, real)
    out = attend_cached(attn, q, k, v, cache, start, positions, parents, masks, window)
    return _output(attn, out, gate, x.shape[1])


def packed_attention(attn, spec: AttentionSpec, x, positions, rows, window=None) -> mx.array:
    """Several sequences' tokens packed along x (1, sum T, H) (models/forward.py): the
    projections run once over all of them (and any row padding after them, models/padding.py),
    then each row `(a, b, cache, start, positions, parents, masks)` (its tokens a:b) attends
    over its own cache. `positions`: every packed token's position."""
    real = rows[-1][1]
    q, k, v, gate = _qkv(attn, spec, x, 0, positions, real)
    if any(isinstance(r[2], SlotCache) for r in rows):
        return _output(attn, _arena_attention(attn, q, k, v, rows, window), gate, x.shape[1])
    outs = [
        attend_cached(attn, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], c, s, p, par, m, window)
        for a, b, c, s, p, par, m in rows
    ]
    return _output(attn, mx.concatenate(outs, axis=2), gate, x.shape[1])


def _arena_attention(attn, q, k, v, rows, window) -> mx.array:
    """packed_attention over rows whose caches share a KV arena (models/arena.py): one
    scatter writes every arena row's keys, the one-token causal steps attend together in one
    batched attention, trees and blocks each over a view of their slot, and a row that left
    the arena over its own cache."""
    caches = [r[2] for r in rows]
    arena, layer = next((c.arena, c.layer) for c in caches if isinstance(c, SlotCache))
    together = _sinks(attn) is None and k.shape[-1] == v.shape[-1] and window is None
    plans = rows[0][6].setdefault("arena", {})  # the same for every layer of this forward
    if together not in plans:
        spans = [(r[0], r[1], r[5] is None) for r in rows]
        plans[together] = plan_forward(spans, caches, together)
    plan = plans[together]
    new_k, new_v = (k, v) if plan.tokens is None else (k[:, :, plan.tokens], v[:, :, plan.tokens])
    arena.write(layer, plan.slots, plan.at, new_k, new_v, plan.top, plan.need)
    for c, r in zip(caches, rows, strict=True):
        if isinstance(c, SlotCache):
            c.offset += r[1] - r[0]
    pieces = []
    if plan.steps:
        assert plan.bias is not None and plan.q_at is not None
        width = plan.bias.shape[-1]
        keys = arena.keys[layer][plan.lo : plan.hi, :, :width]
        values = arena.values[layer][plan.lo : plan.hi, :, :width]
        qs = q[0][:, plan.q_at].transpose(1, 0, 2)[:, :, None, :]
        out = step_attention(qs, keys, values, plan.bias, facts(attn).scale)
        pieces.append(out[:, :, 0].transpose(1, 0, 2)[None])
    for j, (a, b, c, s, p, par, m) in enumerate(rows):
        if j in plan.steps:
            continue
        if not isinstance(c, SlotCache):  # a row too long for the arena: its own cache
            pieces.append(
                attend_cached(
                    attn, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], c, s, p, par, m, window
                )
            )
            continue
        keys, values = c.held(0)
        pieces.append(_attend(attn, q[:, :, a:b], keys, values, s, p, par, m, window, 0))
    out = mx.concatenate(pieces, axis=2) if len(pieces) > 1 else pieces[0]
    return out if plan.order is None else mx.take(out, plan.order, axis=2)


def _qkv(attn, spec: AttentionSpec, x, start: int, positions, real: int | None = None):
    """q (1, heads, T, D) and k (1, kv, T, D) rotated at their positions, v (1, kv, T, Dv), and
    the output gate or None: of x's first `real` rows (the projections run over all of them)."""
    q, k, v, gate = _project(attn, spec, x) if spec.project is None else spec.project(attn, x)
    if real is not None and real < x.shape[1]:
        q, k, v = q[:, :real], k[:, :real], v[:, :real]
        gate = None if gate is None else gate[:, :real]
    q, k = _rotate(attn, q, k, start, positions)
    return q, k, v.transpose(0, 2, 1, 3), gate


def attend_cached(attn, q, k, v, cache, start, positions, parents, masks, window):
    """Append k, v to the cache and attend q over every key it holds."""
    keys, values = cache.append(k, v)
    if isinstance(cache, QuantizedKVCache):
        return _attend_quantized(attn, q, keys, values, cache, start, positions, parents, masks)
    if isinstance(cache, RotatingKVCache):
        if "rotating" not in masks:  # the same for every layer of this forward
            verify = masks.get("verify", True)
            masks["rotating"] = rotating_mask(cache, start, q.shape[2], positions, parents, verify)
        return mx.fast.scaled_dot_product_attention(
            q, keys, values, scale=facts(attn).scale, mask=masks["rotating"]
        )
    held_from = getattr(cache, "dropped", 0)  # a windowed cache's first held position
    return _attend(attn, q, keys, values, start, positions, parents, masks, window, held_from)


def _output(attn, out, gate, rows: int | None = None) -> mx.array:
    """(1, heads, T, Dv) attention output, gated, through o_proj (at `rows` rows, zero rows of
    padding after the T real ones: models/padding.py)."""
    T = out.shape[2]
    out = out.transpose(0, 2, 1, 3).reshape(1, T, -1)
    if gate is not None:
        out = out * mx.sigmoid(gate)
    return attn.o_proj(pad_rows(out, rows or T))


def _project(attn, spec: AttentionSpec, x):
    """q, k, v (token-major, per head) and the output gate of the standard families."""
    T, fixed = x.shape[1], facts(attn)
    # (head counts read each time: mlx-lm's `shard` divides them among tensor-parallel ranks)
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
    v = attn.v_proj(x).reshape(1, T, n_kv, -1)
    if spec.scaleless_qk:
        q = mx.fast.rms_norm(q, None, attn.eps) * attn.qk_scale_factor
        k = mx.fast.rms_norm(k, None, attn.eps)
    elif spec.qk_norm and fixed.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    if fixed.value_scale is not None:  # MiMo's attention_value_scale
        v = v * fixed.value_scale
    return q, k, v, gate


@dataclass(frozen=True)
class Facts:
    """What an attention module of mlx-lm's says once and for all, read at its first forward
    (`facts`) rather than looked up in every one (module_attr: what a lookup costs). Its
    weights and head counts may change, when it is sharded: those are read from the module
    each time; the sink logits by `sinks`, their attribute's name."""

    qk_norm: bool  # use_qk_norm (GLM's may be off)
    value_scale: float | None
    rope: bool  # use_rope (Muse Glimmer's full-attention layers have none)
    scale: float  # gpt-oss names it sm_scale
    sinks: str | None  # gpt-oss `sinks`, MiMo `attention_sink_bias`


def facts(attn) -> Facts:
    fixed = attn.__dict__.get("_dflash_facts")
    if fixed is None:
        scale = module_attr(attn, "scale")
        fixed = attn.__dict__["_dflash_facts"] = Facts(
            qk_norm=bool(module_attr(attn, "use_qk_norm", True)),
            value_scale=module_attr(attn, "value_scale"),
            rope=bool(module_attr(attn, "use_rope", True)),
            scale=float(module_attr(attn, "sm_scale") if scale is None else scale),
            sinks=next((n for n in ("sinks", "attention_sink_bias") if n in attn), None),
        )
    return fixed


def module_attr(module, name: str, default=None):
    """getattr(module, name, default) for an mlx `nn.Module`, without its cost when the
    attribute is missing: Module.__getattr__ raises (~1.6 us, several times a layer of every
    forward), where these lookups do not. A module keeps plain values in its __dict__ and
    arrays and submodules as its dict's items; anything its class defines takes getattr."""
    if name in module.__dict__:
        return module.__dict__[name]
    if name in module:
        return module[name]
    return getattr(module, name) if hasattr(type(module), name) else default


def _sinks(attn):
    """Per-head sink logits (gpt-oss `sinks`, MiMo `attention_sink_bias`), or None."""
    name = facts(attn).sinks
    return None if name is None else attn[name]


def _attend(attn, q, keys, values, start, positions, parents, masks, window, held_from):
    """Attention of (1, heads, T, D) queries over the held keys: causal or tree, within a
    sliding window, with sink logits; MLX's fused attention unless the tree kernel or the CPU
    path applies (no sinks, equal key and value widths)."""
    T, scale, sinks = q.shape[2], facts(attn).scale, _sinks(attn)
    if window is not None and start + T > window:  # a query may be past some cached key
        if "window" not in masks:  # the same for every sliding layer of this pass
            masks["window"] = window_mask(T, start, positions, parents, window)
        lo = max(0, start - window + 1) - held_from  # keys before it are out of every window
        return mx.fast.scaled_dot_product_attention(
            q, keys[:, :, lo:], values[:, :, lo:], scale=scale, mask=masks["window"], sinks=sinks
        )
    plain = sinks is None and keys.shape[-1] == values.shape[-1]
    if parents is None:
        mask = "causal" if T > 1 else None
        if plain and use_cpu_attention():
            return cpu_attention(q, keys, values, scale, mask, masks)
        return mx.fast.scaled_dot_product_attention(
            q, keys, values, scale=scale, mask=mask, sinks=sinks
        )
    if plain:
        return tree_attention(q, keys, values, parents, scale, masks)
    mask = tree_mask(masks, parents, keys.shape[2] - T)
    return mx.fast.scaled_dot_product_attention(
        q, keys, values, scale=scale, mask=mask, sinks=sinks
    )


def _attend_quantized(attn, q, keys, values, cache, start, positions, parents, masks):
    """Attention over a QuantizedKVCache, as mlx-lm computes it one forward at a time: a
    forward that starts where the cache is quantized attends over the quantized keys (its own
    included), one before it in float. A verify's row at position p stands for mlx-lm's step at
    p, so in a verify that crosses the cache's `start` its rows from `start` on attend over
    the quantization of every key they see; a prefill chunk (masks["verify"] False) is one
    forward of mlx-lm's, in float as a whole."""
    T, quant = q.shape[2], cache.quant
    if cache.quantized:
        return _quantized_sdpa(attn, q, keys, values, quant, parents, masks)
    out = _attend(attn, q, keys, values, start, positions, parents, masks, None, 0)
    if not masks.get("verify", True) or start + T - 1 < max(quant.start, 1):
        return out  # no row at or past `start`
    mixed = _quantized_sdpa(
        attn, q, cache.quantize(keys), cache.quantize(values), quant, parents, masks
    )
    pos = start + mx.arange(T) if positions is None else positions
    late = (pos >= max(quant.start, 1))[None, None, :, None]
    return mx.where(late, mixed, out)


def _quantized_sdpa(attn, q, keys, values, quant, parents, masks) -> mx.array:
    """mlx-lm's quantized_scaled_dot_product_attention, with the causal or tree mask."""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    T = q.shape[2]
    mask: mx.array | str | None = None
    if parents is not None:
        mask = tree_mask(masks, parents, keys[0].shape[2] - T)
    elif T > 1:
        mask = "causal"
    return quantized_scaled_dot_product_attention(  # (its body takes "causal" too)
        q, keys, values, facts(attn).scale, mask,  # type: ignore[arg-type]
        group_size=quant.group_size, bits=quant.bits,
    )  # fmt: skip


def _rotate(attn, q, k, start: int, positions):
    """(1, heads, T, D) q and k, rotated at their positions unless the layer has no RoPE."""
    if not facts(attn).rope:  # Muse Glimmer's full-attention layers: NoPE
        return q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
    if positions is None:
        q = attn.rope(q.transpose(0, 2, 1, 3), offset=start)
        k = attn.rope(k.transpose(0, 2, 1, 3), offset=start)
        return q, k
    # mx.fast.rope takes one offset per batch row: put the tokens on the batch axis.
    q = attn.rope(q.transpose(1, 2, 0, 3), offset=positions).transpose(2, 1, 0, 3)
    k = attn.rope(k.transpose(1, 2, 0, 3), offset=positions).transpose(2, 1, 0, 3)
    return q, k


def rope_at(rope, x: mx.array, offset) -> mx.array:
    """x (B, heads, T, d) rotated at positions offset.. (an int or a 0-d array), or with B = 1,
    each token at its own position (offset an array of T: a tree's, packed blocks')."""
    if isinstance(offset, mx.array) and offset.ndim == 1:
        # mx.fast.rope takes one offset per batch row: put the tokens on the batch axis.
        return rope(x.transpose(2, 1, 0, 3), offset=offset).transpose(2, 1, 0, 3)
    return rope(x, offset=offset)


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
