"""Verify cost against a plain step as the context grows (issue: flat cost at long context).

For a target folder, times (best of a few) one-token steps and 16-token causal verifies (DFlash)
and 4-node tree verifies (DDTree) after 0.1K / 1K / 4K / 16K cached tokens, with the CPU
attention path (grouped matmuls, base-2 softmax) and with MLX's fused attention, and prints the
verify / step ratios. Usage:

    .venv/bin/python scripts/verify_cost.py models/smollm2-135m-instruct-f32
"""

# isort: skip_file
from __future__ import annotations

import argparse
import time

import mlx_dflash  # noqa: F401  (first: OpenBLAS must load before mlx)
import mlx.core as mx
import numpy as np

from mlx_dflash.kernels import cpu_attention
from mlx_dflash.kernels import tree_attention as tree_mod
from mlx_dflash.models import attention as attention_mod
from mlx_dflash.models.target import load_target
from mlx_dflash.engine.contract import Pass


def best_time(fn, repeats: int, warmup: bool = False) -> float:
    """The fastest of `repeats` calls of fn (after one untimed call with `warmup`)."""
    if warmup:
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(target, context: int, repeats: int) -> dict[str, float]:
    cache = target.make_cache()
    ids = mx.array(np.arange(context) % (target.vocab_size - 1), dtype=mx.int32)
    for i in range(0, context, 1024):
        logits, _ = target.forward(
            [Pass(ids[i : i + 1024], cache, i, logits="last", taps=False, rewindable=False)]
        )[0]
        mx.eval(logits, [c.state_arrays for c in cache])
    for c in cache:
        c.snapshot()

    def run(n, parents=None):
        def go():
            logits, _ = target.forward(
                [Pass(ids[:n], cache, context, parents=parents, taps=False)]
            )[0]
            mx.eval(logits)
            for c in cache:
                c.trim(context)

        return best_time(go, repeats)

    return {
        "step": run(1),
        "verify16": run(16),
        "tree4": run(5, np.array([-1, 0, 0, 1, 2])),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--contexts", default="100,1000,4000,16000")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    target = load_target(args.model)
    print(
        f"{'context':>8} {'attention':>10} {'step ms':>8} {'verify16 ms':>11} {'ratio':>6} {'tree4 ms':>9} {'ratio':>6}"
    )
    for ctx in (int(c) for c in args.contexts.split(",")):
        for name, cpu in (("cpu-exp2", True), ("mlx-sdpa", False)):
            attention_mod.use_cpu_attention = tree_mod.use_cpu_attention = (
                cpu_attention.use_cpu_attention if cpu else (lambda: False)
            )
            m = measure(target, ctx, args.repeats)
            print(
                f"{ctx:>8} {name:>10} {1e3 * m['step']:>8.1f} {1e3 * m['verify16']:>11.1f} "
                f"{m['verify16'] / m['step']:>6.2f} {1e3 * m['tree4']:>9.1f} {m['tree4'] / m['step']:>6.2f}"
            )


if __name__ == "__main__":
    main()
