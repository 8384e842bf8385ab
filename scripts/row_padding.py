"""A forward of n tokens with and without row padding (models/padding.py), interleaved so that the
machine's drift is shared: median ms each, and the padded row count the table chose.

    .venv/bin/python scripts/row_padding.py -m models/smollm2-135m-instruct-f32
"""

from __future__ import annotations

import argparse
import time

import mlx_dflash  # noqa: F401  (first: OpenBLAS must load before mlx)

# isort: split
import mlx.core as mx
import numpy as np

from mlx_dflash.engine.contract import Pass
from mlx_dflash.models.target import load_target


def timed(target, cache, context: int, n: int) -> float:
    t0 = time.perf_counter()
    logits, _ = target.forward([Pass(mx.array([7] * n), cache, context, logits="all")])[0]
    mx.eval(logits)
    dt = time.perf_counter() - t0
    for c in cache:
        c.trim(context)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8, 10, 12, 14, 16, 20, 24, 32])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    target = load_target(args.model)
    padding = target.padding
    if padding is None:
        raise SystemExit("No row padding here (Metal, or DFLASH_MLX_ROW_PADDING=0).")
    cache = target.make_cache()
    prompt = [5 + i % 900 for i in range(args.context)]
    target.forward([Pass(mx.array(prompt), cache, 0, logits="none", taps=False)])[0]
    times: dict[tuple[int, bool], list[float]] = {}
    for _ in range(args.repeats):
        for n in args.sizes:
            for padded in (False, True):
                target.padding = padding if padded else None
                times.setdefault((n, padded), []).append(timed(target, cache, args.context, n))
    print(f"{'tokens':>6} {'rows':>5} {'unpadded ms':>12} {'padded ms':>10} {'ratio':>6}")
    for n in args.sizes:
        plain, padded = (1000 * np.median(times[(n, p)]) for p in (False, True))
        print(f"{n:6d} {padding(n):5d} {plain:12.1f} {padded:10.1f} {padded / plain:6.2f}")


if __name__ == "__main__":
    main()
