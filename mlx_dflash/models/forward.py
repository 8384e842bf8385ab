"""The target's forward: one or several sequences' passes through one layer loop.

A pass (engine/contract.py Pass) is one Session's forward over its own caches: a verify block or
tree, a prefill chunk, a plain step. One pass runs as it is. Several (the batched rounds of
`serve`, engine/batch.py) are packed end to end into one (1, sum T, H) sequence, so every weight
matrix is read once for all rows (projections, MLP / MoE, the LM head), while attention, Gated
DeltaNet recurrences and MLA run row by row over each row's own cache, positions and mask. No
padding between rows: rows of 1 and of 60 tokens cost what their tokens cost (only the total
may be padded to a row count BLAS runs faster, models/padding.py).

Each packed row's result is what its pass gives alone, up to float rounding (a matmul over more
rows may sum in another order), the same tolerance speculative verification already has against
plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from ..engine.contract import Pass
from ..errors import DFlashError
from ..kernels import cpu_math
from ..kernels.tree_attention import tree_depths
from . import compiled
from .attention import attention, packed_attention
from .families import layer_ffn
from .gated_deltanet import gdn_forward
from .mla import mla_attention
from .padding import on_real_rows, pad_rows

Outputs = tuple[mx.array | None, mx.array | None]  # a pass's (logits, taps)


@dataclass
class Span:
    """A pass placed in the forward's sequence: its tokens a:b, and what its attention needs."""

    a: int
    b: int
    p: Pass
    positions: Any  # mx int32 per-token positions for a tree, None for a causal block
    parents: Any  # mx int32, None for a causal block
    masks: dict  # built once per forward, shared by its layers (a tree's ancestor mask)


def place(p: Pass, a: int = 0) -> Span:
    """Pass p at tokens a:a+T of the forward's sequence."""
    pos = par = None
    if p.parents is not None:  # a tree: token i at start + depth(i), and its parents
        pos = mx.array(p.start + tree_depths(p.parents), dtype=mx.int32)
        par = mx.array(p.parents, dtype=mx.int32)
    # whether this forward is a verify (its rows stand for steps of their own: quantized KV)
    return Span(a, a + int(p.tokens.shape[0]), p, pos, par, {"verify": p.rewindable})


def forward(target, passes: list[Pass]) -> list[Outputs]:
    """Every pass's (logits, taps): logits (T or 1, V) per its `logits` ("all", "last",
    "none"), taps (T, n*H) of the tapped layers in config order."""
    if len(passes) == 1:
        (p,) = passes
        if target.stage is not None:  # a pipeline stage: my layers only (distributed.py)
            return [target.stage.forward(target, p)]
        span = place(p)
        h = pad_rows(target.embed(p.tokens[None]), target.padded_rows(span.b))
        h, tapped = run_layers(target, h, range(target.num_layers), [span])
        taps = None
        if tapped:
            taps = mx.concatenate([tapped[t][: span.b] for t in target.tap_ids], axis=-1)
        return [(target.head(h, p.logits, real=span.b), taps)]
    if target.stage is not None:
        raise DFlashError("Batched rounds do not run on a target sharded over several machines.")
    spans, a = [], 0
    for p in passes:
        spans.append(place(p, a))
        a = spans[-1].b
    h = target.embed(mx.concatenate([p.tokens for p in passes])[None])
    h = pad_rows(h, target.padded_rows(a))  # the cheaper row count (models/padding.py)
    h, tapped = run_layers(target, h, range(target.num_layers), spans)
    return _outputs(target, h, spans, tapped)


def run_layers(target, h: mx.array, layers, spans: list[Span]) -> tuple[mx.array, dict]:
    """Layers `layers` over hidden states h (1, T, H) holding the passes' `spans`; the tapped
    layers' outputs by index (where some pass asks for taps)."""
    tap_set = set(target.tap_ids) if any(r.p.taps for r in spans) else set()
    positions = None
    if len(spans) > 1:  # every packed token's position, for the projections' RoPE
        every = np.concatenate([r.p.positions() for r in spans])
        positions = mx.array(every, dtype=mx.int32)
    tapped: dict[int, mx.array] = {}
    # A verify's layers are queued one by one where that measured faster (models/queueing.py)
    queue = target.queue_layers and any(r.p.rewindable for r in spans)
    compile_ = compiled.applies(target, spans, h)  # a repeating shape (models/compiled.py)
    at = compiled.traced_at(spans[0]) if compile_ else None
    numpy = cpu_math.enabled()  # whether an MLP may take numpy's exponentials (a CPU trick)
    for i in layers:
        if at is not None and compiled.layer_applies(target, i, h, numpy):
            h = compiled.layer(target, i, h, spans[0], at)
        else:
            layer = target.layers[i]
            mix = _mixer(target, i, spans, positions)
            h = target.family.block(layer, h, mix, layer_ffn(layer, numpy))
        if queue:
            mx.async_eval(h)
        if i in tap_set:
            tapped[i] = h[0]
    return h, tapped


def _mixer(target, i: int, spans: list[Span], positions: mx.array | None):
    """Layer i's token mixer over the forward's sequence, span by span where it reads a cache
    (one span: over the whole sequence's real tokens)."""
    layer, kind = target.layers[i], target.mixers[i]
    real = spans[-1].b  # the rows after it are row padding (models/padding.py)
    if kind == "attention":
        attn, spec, window = layer["self_attn"], target.family.attention, target.windows[i]
        if len(spans) == 1:
            r = spans[0]
            return lambda x: attention(
                attn, spec, x, r.p.cache[i], r.p.start, r.positions, r.parents, r.masks, window,
                real,
            )  # fmt: skip
        parts = [
            (r.a, r.b, r.p.cache[i], r.p.start, r.positions, r.parents, r.masks) for r in spans
        ]
        return lambda x: packed_attention(attn, spec, x, positions, parts, window)

    def per_span(fn):
        if len(spans) == 1:
            return lambda x: on_real_rows(lambda y: fn(y, spans[0]), x, real)
        return lambda x: on_real_rows(
            lambda y: mx.concatenate([fn(y[:, r.a : r.b], r) for r in spans], axis=1), x, real
        )

    if kind == "gated_deltanet":
        gdn = layer.linear_attn
        return per_span(
            lambda x, r: gdn_forward(gdn, x, r.p.cache[i], r.p.start, r.p.parents, r.p.rewindable)
        )
    attn = layer.self_attn  # MLA
    return per_span(
        lambda x, r: mla_attention(
            attn, x, r.p.cache[i], r.p.start, r.positions, r.parents, r.masks
        )
    )


def _outputs(target, h: mx.array, spans: list[Span], tapped: dict[int, mx.array]):
    """Each packed row's logits (all positions, the last, or none; one LM head matmul for all
    rows) and taps (the tapped layers in config order)."""
    picks, sizes = [], []
    for r in spans:
        if r.p.logits == "all":
            picks.append(h[:, r.a : r.b])
        elif r.p.logits == "last":
            picks.append(h[:, r.b - 1 : r.b])
        sizes.append({"all": r.b - r.a, "last": 1}.get(r.p.logits, 0))
    logits = None
    if picks:
        picked = mx.concatenate(picks, axis=1)
        k = picked.shape[1]
        logits = target.head(pad_rows(picked, target.padded_rows(k)), "all", real=k)
    out, at = [], 0
    for r, n in zip(spans, sizes, strict=True):
        row_logits = None if n == 0 or logits is None else logits[at : at + n]
        at += n
        taps = None
        if r.p.taps and tapped:
            taps = mx.concatenate([tapped[t][r.a : r.b] for t in target.tap_ids], axis=-1)
        out.append((row_logits, taps))
    return out
