"""One packed forward of B one-token rows (batched plain decoding), three ways side by side:
rows with their own KV caches, rows in the shared KV arena (models/arena.py), and mlx-lm's
own batched forward (left-padded BatchKVCache, what `mlx_lm.server` runs). Median ms each.

    .venv/bin/python scripts/packed_forward.py -m models/smollm2-135m-instruct-f32 --rows 4 8
"""

from __future__ import annotations

import argparse
import time

import mlx_dflash  # noqa: F401  (first: OpenBLAS must load before mlx)

# isort: split
import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache

from mlx_dflash.engine.contract import Pass
from mlx_dflash.models.target import load_target


def prompt(r: int, n: int) -> list[int]:
    return [(7 * r + i) % 1000 + 5 for i in range(n)]


def our_rows(target, rows: int, context: int) -> list[list]:
    caches = []
    for r in range(rows):
        cache = target.make_cache()
        target.forward(
            [Pass(mx.array(prompt(r, context + 7 * r)), cache, 0, logits="none", taps=False)]
        )[0]
        mx.eval([a for c in cache for a in c.state_arrays])
        caches.append(cache)
    return caches


def our_step(target, caches: list[list], token: int) -> float:
    passes = [Pass(mx.array([token]), c, c[0].offset, None, "last", False, False) for c in caches]
    t0 = time.perf_counter()
    out = target.forward(passes)
    mx.eval([logits for logits, _ in out])
    dt = time.perf_counter() - t0
    for cache in caches:  # back to the context: every repeat measures the same step
        for c in cache:
            c.trim(c.offset - 1)
    return dt


def their_step(model, caches: list, rows: int, token: int) -> float:
    t0 = time.perf_counter()
    mx.eval(model(mx.array([[token]] * rows), cache=caches))
    dt = time.perf_counter() - t0
    for c in caches:
        c.trim(1)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=25)
    args = ap.parse_args()
    target = load_target(args.model)
    model, _ = load(args.model)
    for rows in args.rows:
        own = our_rows(target, rows, args.context)
        shared = our_rows(target, rows, args.context)
        arena = target.new_arena()
        for cache in shared:
            arena.adopt(cache)
        lengths = [args.context + 7 * r for r in range(rows)]
        pad = [max(lengths) - n for n in lengths]
        theirs = [BatchKVCache(pad) for _ in model.layers]
        tokens = [[5] * p + prompt(r, n) for r, (p, n) in enumerate(zip(pad, lengths, strict=True))]
        mx.eval(model(mx.array(tokens), cache=theirs))

        times: dict[str, list[float]] = {"own caches": [], "KV arena": [], "mlx-lm": []}
        for i in range(args.repeats):  # interleaved, so drift in the machine's speed is shared
            times["own caches"].append(our_step(target, own, 11 + i))
            times["KV arena"].append(our_step(target, shared, 11 + i))
            times["mlx-lm"].append(their_step(model, theirs, rows, 11 + i))
        cells = ", ".join(f"{k} {np.median(v) * 1e3:.1f} ms" for k, v in times.items())
        print(f"{rows} rows of one token, {args.context}+ tokens of context: {cells}")


if __name__ == "__main__":
    main()
