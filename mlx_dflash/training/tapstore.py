"""The tap store: the target's taps (and soft targets) of answered records, kept on disk so
training never runs the target twice over the same answer (docs/training.md)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..atomic import atomic_file
from .checkpoint import TAPS_DIR

# Soft targets kept per answer token (the target's top-k log-probabilities), stored beside
# each record's taps under these key suffixes.
SOFT_TOP_K = 8
SOFT_IDS, SOFT_LOGP = ".top_ids", ".top_logp"


class TapStore:
    """The target's taps of answered records, on disk: float16 safetensors shards in
    `OUT/cache/taps/`, each tagged with the tapped layers and keyed by record key.

    Shards are only ever added (by the answerer, batch by batch, and by `cache_all_taps` for
    records answered without taps), so an interrupted run loses at most the shard it was
    writing, and a record's taps are found wherever they were made.
    """

    def __init__(self, out: Path, tap_ids):
        self.dir = Path(out) / TAPS_DIR
        self.tag = ",".join(map(str, tap_ids))

    def add(self, arrays: dict) -> None:
        if not arrays:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        # Named by time and process: two jobs (answering, a tap pass) may add at once, and
        # a later shard (a record re-answered) wins when names are read in order.
        path = self.dir / f"{time.time_ns()}-{os.getpid()}.safetensors"
        data = {k: mx.array(v) if isinstance(v, np.ndarray) else v for k, v in arrays.items()}
        atomic_file(path, lambda p: mx.save_safetensors(p, data, metadata={"taps": self.tag}))

    def load(self) -> dict:
        """Every stored record's taps for these tapped layers (damaged shards are skipped)."""
        out = {}
        for path in sorted(self.dir.glob("*.safetensors")) if self.dir.is_dir() else []:
            try:
                arrays, meta = mx.load(str(path), return_metadata=True)
            except (RuntimeError, ValueError):
                continue  # recomputed
            if meta.get("taps") == self.tag:
                out.update(arrays)
        return out


def record_key(rec: dict) -> str:
    """How a record is named in the tap store: its id, prefixed by its source when it comes
    from another run's answers (ids restart at 0 in every shard)."""
    return rec.get("key") or str(rec["id"])


def soft_targets(recs: list[dict], out: Path, tap_ids) -> list[tuple | None]:
    """Each record's soft targets from the tap store (kept while answering), else None:
    (top ids (answer_len, k), their log-probs) as numpy arrays."""
    saved = TapStore(out, tap_ids).load()
    found = []
    for r in recs:
        key = record_key(r)
        ids, logp = saved.get(key + SOFT_IDS), saved.get(key + SOFT_LOGP)
        ok = ids is not None and logp is not None
        found.append((np.array(ids), np.array(logp.astype(mx.float32))) if ok else None)
    return found
