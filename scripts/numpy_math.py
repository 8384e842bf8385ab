"""Forward cost with and without numpy's exponentials (kernels/cpu_math.py), interleaved.

For a target folder, after `--context` cached tokens, times forwards of each size in
`--sizes` (causal blocks) and a 16-node tree, alternating DFLASH_MLX_NUMPY_MATH=0 and auto
in every repeat (so that the machine's drift falls on both), and prints the fastest and the
median of each. Usage:

    .venv/bin/python scripts/numpy_math.py -m models/smollm2-135m-instruct-f32 --repeats 12
"""

# isort: skip_file
from __future__ import annotations

import argparse
import os
import time

import mlx_dflash  # noqa: F401  (first: OpenBLAS must load before mlx)
import mlx.core as mx
import numpy as np

from mlx_dflash.models.target import load_target
from mlx_dflash.engine.contract import Pass

TREE = np.array([-1, 0, 0, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])  # 16 nodes, depth 12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=12)
    args = ap.parse_args()
    target = load_target(args.model)
    ids = mx.array(np.arange(args.context) % 1000, dtype=mx.int32)
    cache = target.make_cache()
    logits, _ = target.forward([Pass(ids, cache, 0, logits="last", taps=False, rewindable=False)])[
        0
    ]
    mx.eval(logits, [c.state_arrays for c in cache])
    for c in cache:
        c.snapshot()

    def once(n: int, parents) -> float:
        t0 = time.perf_counter()
        out, _ = target.forward([Pass(ids[:n], cache, args.context, parents=parents)])[0]
        mx.eval(out)
        for c in cache:
            c.trim(args.context)
        return time.perf_counter() - t0

    cases = [(f"{n} tokens", n, None) for n in args.sizes] + [("16-node tree", 16, TREE)]
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(args.repeats):
        for name, n, parents in cases:
            for setting in ("0", "auto") if r % 2 else ("auto", "0"):
                os.environ["DFLASH_MLX_NUMPY_MATH"] = setting
                times.setdefault((name, setting), []).append(once(n, parents))
    print(f"{'forward':>14} {'MLX ms (min/median)':>20} {'numpy ms':>16} {'ratio':>6}")
    for name, _, _ in cases:
        a, b = times[(name, "0")], times[(name, "auto")]
        print(
            f"{name:>14} {1e3 * min(a):>9.1f} /{1e3 * np.median(a):>7.1f} "
            f"{1e3 * min(b):>7.1f} /{1e3 * np.median(b):>7.1f} {min(b) / min(a):>6.2f}"
        )


if __name__ == "__main__":
    main()
