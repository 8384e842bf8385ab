"""Several sequences' forwards as one: the batched rounds of `serve` (engine/batch.py).

Each row is one Session's pass (a verify block or tree, a prefill chunk, a plain step) over its
own caches. Their tokens are packed end to end into one (1, sum T, H) sequence, so every weight
matrix is read once for all rows (projections, MLP / MoE, the LM head), while attention, Gated
DeltaNet recurrences and MLA run row by row over each row's own cache, positions and mask. No
padding between rows: rows of 1 and of 60 tokens cost what their tokens cost (only the packed
total may be padded to a row count BLAS runs faster, models/rows.py).

Each row's result is what `Target.forward` gives it alone, up to float rounding (a matmul over
more rows may sum in another order), the same tolerance speculative verification already has
against plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from ..engine.contract import Pass
from ..errors import DFlashError
from .attention import packed_attention
from .gated_deltanet import gdn_forward
from .mla import is_mla, mla_attention
from .rows import on_real_rows, pad_rows


@dataclass
class _Row:
    """A pass placed in the packed sequence: its tokens a:b, and what its attention needs."""

    a: int
    b: int
    p: Pass
    positions: Any  # mx int32 per-token positions for a tree, None for a causal block
    parents: Any  # mx int32, None for a causal block
    masks: dict


def forward_packed(target, passes: list[Pass]) -> list[tuple[mx.array | None, mx.array | None]]:
    """Every pass's (logits, taps), as `target.forward` returns them, from one packed forward."""
    if target.stage is not None:
        raise DFlashError("Batched rounds do not run on a target sharded over several machines.")
    rows, a = [], 0
    every = [p.positions() for p in passes]
    for p, p_pos in zip(passes, every, strict=True):
        b = a + int(p.tokens.shape[0])
        pos = par = None
        if p.parents is not None:  # a tree: per-token positions and the parents
            pos = mx.array(p_pos, dtype=mx.int32)
            par = mx.array(p.parents, dtype=mx.int32)
        rows.append(_Row(a, b, p, pos, par, {"verify": p.rewindable}))
        a = b
    positions = mx.array(np.concatenate(every), dtype=mx.int32)
    h = target.embed(mx.concatenate([p.tokens for p in passes])[None])
    h = pad_rows(h, target.rows(a))  # the dense layers' cheaper row count (models/rows.py)
    tapped: dict[int, mx.array] = {}
    tap_set = set(target.tap_ids) if any(p.taps for p in passes) else set()
    for i in range(target.num_layers):
        layer = target.layers[i]
        h = target.family.block(layer, h, _mixer(target, i, rows, positions))
        if i in tap_set:
            tapped[i] = h[0]
    return _outputs(target, h, rows, tapped)


def _mixer(target, i: int, rows: list[_Row], positions: mx.array):
    """Layer i's token mixer over the packed sequence, row by row where it reads a cache."""
    layer = target.layers[i]

    real = rows[-1].b  # the rows after it are padding (models/rows.py)

    def per_row(fn):
        def mix(x):
            return on_real_rows(
                lambda y: mx.concatenate([fn(y[:, r.a : r.b], r) for r in rows], axis=1), x, real
            )

        return mix

    if getattr(layer, "is_linear", False):
        return per_row(
            lambda x, r: gdn_forward(
                layer.linear_attn, x, r.p.cache[i], r.p.start, r.p.parents, r.p.rewindable
            )
        )
    if is_mla(layer.self_attn):
        return per_row(
            lambda x, r: mla_attention(
                layer.self_attn, x, r.p.cache[i], r.p.start, r.positions, r.parents, r.masks
            )
        )
    spec, window = target.family.attention, target.windows[i]
    parts = [(r.a, r.b, r.p.cache[i], r.p.start, r.positions, r.parents, r.masks) for r in rows]
    return lambda x: packed_attention(layer.self_attn, spec, x, positions, parts, window)


def _outputs(target, h: mx.array, rows: list[_Row], tapped: dict[int, mx.array]):
    """Each row's logits (all positions, the last, or none; one LM head matmul for all rows)
    and taps (the tapped layers in config order)."""
    picks, sizes = [], []
    for r in rows:
        if r.p.logits == "all":
            picks.append(h[:, r.a : r.b])
        elif r.p.logits == "last":
            picks.append(h[:, r.b - 1 : r.b])
        sizes.append({"all": r.b - r.a, "last": 1}.get(r.p.logits, 0))
    logits = None
    if picks:
        picked = mx.concatenate(picks, axis=1)
        k = picked.shape[1]
        logits = target.head(pad_rows(picked, target.rows(k)), "all", real=k)
    out, at = [], 0
    for r, n in zip(rows, sizes, strict=True):
        row_logits = None if n == 0 or logits is None else logits[at : at + n]
        at += n
        taps = None
        if r.p.taps and tapped:
            taps = mx.concatenate([tapped[t][r.a : r.b] for t in target.tap_ids], axis=-1)
        out.append((row_logits, taps))
    return out
