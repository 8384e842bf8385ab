"""Training batches: right-padded sequences with random anchors, the target's taps (computed
per batch, or once and kept on disk), the loss vocabulary and the tap preconditioning."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from ..progress import progress
from .forward import target_taps, top_logprobs
from .tapstore import SOFT_IDS, SOFT_LOGP, SOFT_TOP_K, TapStore, record_key

if TYPE_CHECKING:
    from .trainer import TrainConfig


def make_batch(
    recs: list[dict], rng: np.random.Generator, cfg: TrainConfig, target, taps=None, soft=None
) -> dict:
    """Right-padded sequences, their taps, and `anchors` random anchors inside each response.

    `taps`: the records' cached taps (each (len, n*H)), else computed here. `soft`: per
    record, its soft targets (`soft_targets`) or None; they become "soft_ids" / "soft_logp"
    (B, T, k), position p holding the distribution token p was drawn from (-inf: none).
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
    batch = {}
    if soft is not None:
        k = next((x[0].shape[1] for x in soft if x is not None), 1)
        ids = np.zeros((len(seqs), T, k), dtype=np.int32)
        logp = np.full((len(seqs), T, k), -np.inf, dtype=np.float32)
        for i, (s, r, x) in enumerate(zip(seqs, recs, soft, strict=True)):
            if x is not None:
                lo = r["prompt_len"]
                n = min(len(s) - lo, x[0].shape[0])
                ids[i, lo : lo + n], logp[i, lo : lo + n] = x[0][:n], x[1][:n]
        batch = {"soft_ids": mx.array(ids), "soft_logp": mx.array(logp)}
    return batch | {
        "tokens": tok,
        "anchors": mx.array(anchors),
        "lengths": mx.array([len(s) for s in seqs], dtype=mx.int32),
        "response_tokens": sum(len(s) - r["prompt_len"] for s, r in zip(seqs, recs, strict=True)),
        "taps": taps,
    }


def cache_all_taps(
    target,
    recs: list[dict],
    max_len: int,
    group: int = 16,
    out: Path | None = None,
    with_soft: bool = False,
) -> list[mx.array]:
    """Every record's taps (truncated to max_len), once: groups of similar length share a pass.

    With `out` they are read from and added to its tap store (`TapStore`), so taps made while
    answering, by an earlier run or by a resumed one are never computed again. with_soft:
    records without soft targets (answered before they were kept) get them too, from a pass
    through every layer (`soft_targets` then finds them).
    """
    store = TapStore(out, target.tap_ids) if out is not None else None
    saved = store.load() if store is not None else {}
    out_taps: list[mx.array | None] = []
    for r in recs:
        x = saved.get(record_key(r))
        n = min(len(r["tokens"]), max_len)
        # None too for a record that changed since its taps were written.
        out_taps.append(x[:n] if x is not None and x.shape[0] >= n else None)
    todo = [
        i
        for i, x in enumerate(out_taps)
        if x is None or (with_soft and record_key(recs[i]) + SOFT_IDS not in saved)
    ]
    todo.sort(key=lambda i: len(recs[i]["tokens"]))
    if not todo:
        return out_taps
    label = "target taps and soft targets" if with_soft else "target taps"
    with progress(info=True, show=out is not None, transient=False) as bar:
        task = bar.add_task(label, total=len(todo), info="")
        for g in range(0, len(todo), group):
            idx = todo[g : g + group]
            seqs = [recs[i]["tokens"][:max_len] for i in idx]
            T = max(len(s) for s in seqs)
            rows = np.zeros((len(seqs), T), dtype=np.int32)
            for j, s in enumerate(seqs):
                rows[j, : len(s)] = s
            arrays = {}
            if with_soft:
                taps, h = target_taps(target, mx.array(rows), final=True)
                for j, i in enumerate(idx):
                    key, lo = record_key(recs[i]), recs[i]["prompt_len"]
                    # Position p's distribution is that of token p + 1.
                    top, logp = top_logprobs(
                        target.output_logits(h[j, lo - 1 : len(seqs[j]) - 1]), SOFT_TOP_K
                    )
                    arrays[key + SOFT_IDS], arrays[key + SOFT_LOGP] = top, logp.astype(mx.float16)
            else:
                taps = target_taps(target, mx.array(rows))
            taps = taps.astype(mx.float16)
            mx.eval(taps, arrays)
            for j, i in enumerate(idx):
                if out_taps[i] is None:  # stored taps are kept: only soft targets were missing
                    out_taps[i] = taps[j, : len(seqs[j])]
                    arrays[record_key(recs[i])] = out_taps[i]
            if store is not None:
                store.add(arrays)
            bar.advance(task, len(idx))
    return out_taps


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
