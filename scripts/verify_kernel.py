"""What a verify of M rows costs a quantized target on this machine, stock MLX against the
small-M verify kernel (issue 48), as multiples of a one-row step: the numbers a Mac user can
send us. Prints a table and writes JSON.

    .venv/bin/python scripts/verify_kernel.py mlx-community/Qwen3-8B-4bit --json qmm.json

For each row count M of models/quantized.py's ROW_COUNTS it times a whole target forward of M
tokens (every layer, attention included, after 256 cached tokens) with every quantized layer on
stock `mx.quantized_matmul`, then with every one on the kernel, and the per-shape calibration
the engine would cache. Without a Metal GPU the kernel cannot run: the stock column alone is
printed, with a line saying so. Please paste the output into an issue.
"""

# isort: skip_file
from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import mlx_dflash  # noqa: F401  (first: OpenBLAS before mlx)
import mlx.core as mx
import numpy as np

from mlx_dflash.checkpoints.resolve import resolve_model
from mlx_dflash.engine.device import device_class
from mlx_dflash.models import quantized as q
from mlx_dflash.models.target import load_target
from mlx_dflash.engine.contract import Pass


def forced(path: str, layers) -> q.Calibration:
    """A calibration sending every layer's every row count down `path`."""
    shapes = {q.layer_shape(x) for x in layers}
    timing = (1.0, 0.0) if path == "kernel" else (0.0, 1.0)
    return q.Calibration("forced", path == "kernel", path,
                         {s: {m: timing for m in q.ROW_COUNTS} for s in shapes})  # fmt: skip


def forward_time(target, m: int, context: int = 256, repeats: int = 5) -> float:
    cache = target.make_cache()
    ids = mx.array(np.arange(context + m) % (target.vocab_size - 1), dtype=mx.int32)
    logits, _ = target.forward([Pass(ids[:context], cache, 0, logits="last", taps=False,
                               rewindable=False)])[0]  # fmt: skip
    mx.eval(logits, [c.state_arrays for c in cache])
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        logits, _ = target.forward([Pass(ids[context:], cache, context, taps=False)])[0]
        mx.eval(logits)
        best = min(best, time.perf_counter() - t0)
        for c in cache:
            c.trim(context)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--json", default=None, help="write the numbers here too")
    args = ap.parse_args()
    target = load_target(resolve_model(args.model, "target"))
    layers = [m for _, m in q.quantized_layers(target.model)] + q._tied(target)
    if not layers:
        sys.exit(f"{args.model} has no quantized linear layers the kernel takes.")
    metal = device_class() == "metal"
    report = {"model": args.model, "device": q.MetalDevice().name if metal else device_class(),
              "mlx": mx.__version__, "machine": platform.machine(), "rows": []}  # fmt: skip
    paths = ("stock", "kernel") if metal else ("stock",)
    step = {}
    for path in paths:
        q.install(target, forced(path, layers))
        step[path] = forward_time(target, 1)
    print(f"{'rows':>5} {'stock (steps)':>14} {'kernel (steps)':>15}")
    for m in q.ROW_COUNTS:
        row = {"rows": m}
        for path in paths:
            q.install(target, forced(path, layers))
            row[path] = forward_time(target, m) / step["stock"]
        report["rows"].append(row)
        kernel = f"{row['kernel']:>15.2f}" if "kernel" in row else f"{'-':>15}"
        print(f"{m:>5} {row['stock']:>14.2f} {kernel}", flush=True)
    if metal:
        cal = q.calibrate(layers, q.MetalDevice())
        report["calibration"] = cal.to_json()
        print(f"kernel self-check: {cal.reason}")
    else:
        print("No Metal GPU here: the kernel runs on Apple GPUs only; stock MLX alone measured.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
