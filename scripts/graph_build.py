"""Milliseconds of Python to build one verify's MLX graph (issue 50): our target's forward
against mlx-lm's own model call on the same weights, interleaved, graphs evaluated outside
the timing. On a Mac a verify's graph is built while the drafter computes, so this is host
time every round pays.

    python scripts/graph_build.py [TARGET_FOLDER] [--tokens 16] [--fused-attention] [--compiled]
                                  [--one-node-fast-ops] [--as-metal]

TARGET_FOLDER defaults to the planted case's target (scripts/overhead_case.py build). The CPU
tricks (numpy exponentials, row padding, queueing layer by layer) are off, as on a Mac;
--fused-attention also takes MLX's fused attention instead of the CPU attention path
(DFLASH_MLX_CPU_ATTENTION=0, kernels/cpu_attention.py), as a Mac does; --compiled runs our
layers' halves through mx.compile (models/compiled.py), as a GPU that measured them faster.

The CPU backend builds mx.fast.rms_norm, rope and scaled_dot_product_attention as their fallback
graphs (about 15, 31 and 26 operations) where Metal builds one node each: --one-node-fast-ops
stands each in by one elementwise node of the same shape (the values are wrong, the graph's size
is a Mac's), to show how much of the build is that expansion (both sides alike). --as-metal
reports the device class as Metal and casts the target to bfloat16, so our forward takes the
branches it takes on an Apple GPU with a quantized model's activations (no Metal kernel is
reached by a causal verify of an unquantized target; the graphs still evaluate on the CPU).
"ours / mlx-lm" is the ratio of the medians, "paired" the median of each rep's own ratio.
"""

# isort: skip_file
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("DFLASH_MLX_NUMPY_MATH", "0")
os.environ.setdefault("DFLASH_MLX_ROW_PADDING", "0")

import mlx_dflash  # (loads OpenBLAS before mlx on Linux)

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from mlx_dflash.engine.contract import Pass
from mlx_dflash.models.target import load_target


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target", nargs="?", default="models/overhead-case/target")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--fused-attention", action="store_true")
    ap.add_argument(
        "--compiled",
        action="store_true",
        help="our layers' halves through mx.compile, as a GPU that measured them faster "
        "(models/compiled.py)",
    )
    ap.add_argument(
        "--one-node-fast-ops",
        action="store_true",
        help="each mx.fast op one node, as Metal builds it (wrong values, a Mac's graph size)",
    )
    ap.add_argument(
        "--as-metal",
        action="store_true",
        help="the branches an Apple GPU's forward takes: the device class reported as Metal (no "
        "Metal kernel is reached by a causal verify of an unquantized target) and the target in "
        "bfloat16, as a quantized model's activations are; implies --fused-attention",
    )
    args = ap.parse_args()
    if args.as_metal:
        from mlx_dflash.engine import device

        device.device_class = lambda: "metal"  # on_cpu / on_metal read it at each call
        args.fused_attention = True
    if args.one_node_fast_ops:
        mx.fast.rms_norm = lambda x, *a, **k: mx.abs(x)
        mx.fast.rope = lambda x, *a, **k: mx.abs(x)
        mx.fast.scaled_dot_product_attention = lambda q, *a, **k: mx.abs(q)
    if args.fused_attention:
        mlx_dflash.SETTINGS.cpu_attention = "0"  # DFLASH_MLX_CPU_ATTENTION=0 (docs/settings.md)
    target = load_target(args.target)
    if args.as_metal:
        target.model.set_dtype(mx.bfloat16)
    target.queue_layers = False  # no evaluation inside the timed build
    target.compiled = args.compiled  # (traced in the warm-up reps, left out of the medians)
    ours_cache, ref_cache = target.make_cache(), make_prompt_cache(target.model)
    ctx = args.context
    prompt = mx.array(np.arange(ctx) % (target.vocab_size - 3) + 3, dtype=mx.int32)
    logits, _ = target.forward([Pass(prompt, ours_cache, 0, taps=True)])[0]
    mx.eval(logits, [c.state_arrays for c in ours_cache])
    mx.eval(target.model(prompt[None], cache=ref_cache), [c.state for c in ref_cache])
    tokens = mx.array(np.arange(args.tokens) % (target.vocab_size - 5) + 5, dtype=mx.int32)

    def ours():
        out = target.forward([Pass(tokens, ours_cache, ctx, taps=True)])[0]
        return out, lambda: [c.trim(ctx) for c in ours_cache]

    def mlx_lm():
        return target.model(tokens[None], cache=ref_cache), lambda: [
            c.trim(args.tokens) for c in ref_cache
        ]

    times: dict[str, list[float]] = {"dflash-mlx": [], "mlx-lm": []}
    for _ in range(args.reps):
        for name, build in (("dflash-mlx", ours), ("mlx-lm", mlx_lm)):
            t0 = time.perf_counter()
            out, rewind = build()
            times[name].append(time.perf_counter() - t0)
            mx.eval(out)
            rewind()
    warm = args.reps // 6
    med = {k: float(np.median(v[warm:])) for k, v in times.items()}
    attn = "MLX's fused attention" if args.fused_attention else "this backend's attention path"
    how = ", layer halves compiled" if args.compiled else ""
    how += ", one node per mx.fast op" if args.one_node_fast_ops else ""
    how += ", as on Metal in bfloat16" if args.as_metal else ""
    print(f"{args.tokens}-token verify graph, {target.num_layers} layers, {attn}{how}:")
    for k, v in times.items():
        print(f"  {k}: median {1e3 * med[k]:.3f} ms, min {1e3 * min(v):.3f} ms")
    paired = np.median(np.array(times["dflash-mlx"][warm:]) / np.array(times["mlx-lm"][warm:]))
    print(f"  dflash-mlx / mlx-lm: {med['dflash-mlx'] / med['mlx-lm']:.2f} (paired {paired:.2f})")


if __name__ == "__main__":
    main()
