"""Training batches: right-padded sequences with random anchors, the target's taps (computed
per batch, or once and kept on disk), the loss vocabulary and the tap preconditioning."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from ..progress import progress
from .checkpoint import atomic_write
from .forward import target_taps

if TYPE_CHECKING:
    from .trainer import TrainConfig


def make_batch(
    recs: list[dict], rng: np.random.Generator, cfg: TrainConfig, target, taps=None
) -> dict:
    """Right-padded sequences, their taps, and `anchors` random anchors inside each response.

    `taps`: the records' cached taps (each (len, n*H)), else computed here.
    """
    seqs = [r["tokens"][: cfg.max_len] for r in recs]
    T = max(len(s) for s in seqs)
    T = int(math.ceil(T / 32) * 32)  # few distinct shapes
    tokens = np.zeros((len(seqs), T), dtype=np.int32)
    anchors = np.zeros((len(seqs), cfg.anchors), dtype=np.int32)
    for i, (s, r) in enumerate(zip(seqs, recs, strict=True)):
        tokens[i, : len(s)] = s
        lo, hi = r["prompt_len"], len(s) - 2  # slot 1 must have a label
        anchors[i] = rng.integers(lo, max(lo, hi) + 1, size=cfg.anchors)
    tok = mx.array(tokens)
    if taps is None:
        taps = target_taps(target, tok)
    else:
        taps = mx.stack([mx.pad(x, [(0, T - x.shape[0]), (0, 0)]) for x in taps])
        taps = taps.astype(mx.float32)
    return {
        "tokens": tok,
        "anchors": mx.array(anchors),
        "lengths": mx.array([len(s) for s in seqs], dtype=mx.int32),
        "taps": taps,
    }


def cache_all_taps(
    target, recs: list[dict], max_len: int, group: int = 16, path: Path | None = None
) -> list[mx.array]:
    """Every record's taps, once: groups of similar length share a pass.

    With `path` they are also kept on disk (float16, keyed by record id, tapped layers and
    max_len), so a second run or a resumed one skips the target's forward passes entirely.
    """
    key = {"taps": ",".join(map(str, target.tap_ids)), "max_len": str(max_len)}
    saved = _load_taps(path, key) if path is not None else {}
    out: list[mx.array | None] = [saved.get(str(r["id"])) for r in recs]
    for i, x in enumerate(out):
        if x is not None and x.shape[0] != min(len(recs[i]["tokens"]), max_len):
            out[i] = None  # a record that changed since the cache was written
    todo = sorted((i for i, x in enumerate(out) if x is None), key=lambda i: len(recs[i]["tokens"]))
    if not todo:
        return out
    with progress(info=True, show=path is not None, transient=False) as bar:
        task = bar.add_task("target taps", total=len(todo), info="")
        for g in range(0, len(todo), group):
            idx = todo[g : g + group]
            seqs = [recs[i]["tokens"][:max_len] for i in idx]
            T = max(len(s) for s in seqs)
            rows = np.zeros((len(seqs), T), dtype=np.int32)
            for j, s in enumerate(seqs):
                rows[j, : len(s)] = s
            taps = target_taps(target, mx.array(rows)).astype(mx.float16)
            mx.eval(taps)
            for j, i in enumerate(idx):
                out[i] = taps[j, : len(seqs[j])]
            bar.advance(task, len(idx))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {str(r["id"]): x for r, x in zip(recs, out, strict=True)}
        atomic_write(path, lambda p: mx.save_safetensors(p, arrays, metadata=key))
    return out


def _load_taps(path: Path, key: dict) -> dict:
    """A tap cache written for the same tapped layers and max_len, else nothing."""
    if not path.exists():
        return {}
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError):
        return {}  # damaged: recomputed
    return arrays if all(meta.get(k) == v for k, v in key.items()) else {}


def tap_scale(taps: list[mx.array]) -> mx.array:
    """1 / mean |x| of each tap feature, from (a sample of) the training taps.

    Target residual streams carry a few features hundreds of times larger than the rest
    (SmolLM2: mean |x| 340 against ~10, peaks of 25000). Fed raw to `fc`, under Adam's
    per-weight step those columns move the output hundreds of times more per step than the
    others. fc has no bias, so training `fc' = fc * diag(1/scale)` on `taps * scale` and saving
    `fc' * scale` is the same drafter at inference, with every feature on the same footing.
    """
    total, count = None, 0
    for x in taps[:256]:
        a = mx.abs(x.astype(mx.float32)).sum(axis=0)
        total = a if total is None else total + a
        count += x.shape[0]
    return 1.0 / mx.maximum(total / count, 1e-3)


def loss_vocabulary(recs: list[dict], max_len: int) -> np.ndarray:
    """Every token that is ever a label (response tokens), sorted."""
    seen: set[int] = set()
    for r in recs:
        seen.update(r["tokens"][r["prompt_len"] + 1 : max_len])
    return np.array(sorted(seen), dtype=np.int32)


def usable(recs: list[dict], max_len: int) -> list[dict]:
    """Records with at least two response tokens inside max_len."""
    return [r for r in recs if min(len(r["tokens"]), max_len) - r["prompt_len"] >= 2]
