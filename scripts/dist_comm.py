"""Per-round communication of a sharded target, measured: run under mlx.launch.

    mlx.launch --backend ring -n 2 -- python scripts/dist_comm.py [HIDDEN LAYERS]

A tensor-parallel forward all-reduces the hidden states twice per layer (after attention and
after the MLP); a DFlash round verifies a 16-token block, a plain step one token, and the
host's decisions add one small broadcast. This times MLX's all_sum for those sizes on the
current transport (loopback here, Thunderbolt between Macs) and prints bytes and time per
round. Defaults: SmolLM2-135M's width (576) and depth (30); Kimi-K2.5 is 7168 and 61.
"""

# isort: skip_file
from __future__ import annotations

import sys
import time

import mlx_dflash  # noqa: F401  (OpenBLAS before mlx)

import mlx.core as mx


def timed_all_sum(group, shape, dtype, repeats: int = 100) -> float:
    """Median seconds of one all_sum (after warm-up): loopback on a shared 2-core machine has
    scheduling jitter of milliseconds, which a mean would report as transport time."""
    x = mx.ones(shape, dtype=dtype)
    for _ in range(10):
        x = mx.distributed.all_sum(x, group=group) * 0.5
        mx.eval(x)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x = mx.distributed.all_sum(x, group=group) * 0.5
        mx.eval(x)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    hidden = int(sys.argv[1]) if len(sys.argv) > 1 else 576
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    group = mx.distributed.init()
    rows = []
    for label, tokens in (("plain step", 1), ("DFlash round (16-token verify)", 16)):
        per = timed_all_sum(group, (1, tokens, hidden), mx.bfloat16)
        n = 2 * layers
        rows.append((label, n, n * tokens * hidden * 2, n * per))
    decision = timed_all_sum(group, (17,), mx.int32)
    if group.rank() == 0:
        print(f"{group.size()} ranks, hidden {hidden}, {layers} layers, bf16 activations")
        for label, n, nbytes, secs in rows:
            print(
                f"{label}: {n} all-reduces, {nbytes / 1024:.0f} KiB per rank, "
                f"{1000 * secs:.2f} ms ({1e6 * secs / n:.0f} us each)"
            )
        print(f"host decision broadcast (17 ints): {1e6 * decision:.0f} us")


if __name__ == "__main__":
    main()
