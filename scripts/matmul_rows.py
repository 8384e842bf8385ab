"""How fast MLX streams a weight matrix through a matmul on this machine, by the number of rows
multiplied and the weights' dtype: what bounds a verify's cost against a plain step (issue 32,
item 4).

A decoding step multiplies 1 row by every weight matrix; a verify multiplies 5-16 (a tree or a
block), a batched verify more. Where the step is memory-bound, extra rows should be nearly free;
this prints, per (rows, dtype), the time of y = x @ W.T and the rate at which W's bytes go by,
and the cost against one row of float32. Shapes default to Qwen2.5-Coder-0.5B's MLP
(896 -> 4864) and its attention output (896 -> 896).

    .venv/bin/python scripts/matmul_rows.py
    .venv/bin/python scripts/matmul_rows.py --shape 1536x8960 --rows 1,5,16,64
"""

# isort: skip_file
from __future__ import annotations

import argparse

import mlx_dflash  # noqa: F401  (first: OpenBLAS must load before mlx)
import mlx.core as mx

from verify_cost import best_time  # scripts/ is on the path when a script runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", default=None, help="IN x OUT, e.g. 896x4864")
    ap.add_argument("--rows", default="1,2,5,16,32,64")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--layers", type=int, default=24, help="matmuls chained per timing")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in (args.shape or ["896x4864", "896x896"])]
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{'shape':>10} {'dtype':>9} {'rows':>5} {'ms':>8} {'GB/s':>7} {'vs 1 row f32':>13}")
    for d_in, d_out in shapes:
        base = None
        for name in args.dtypes.split(","):
            dt = getattr(mx, name)
            ws = [mx.random.normal((d_out, d_in)).astype(dt) for _ in range(args.layers)]
            mx.eval(ws)
            for n in rows:
                x = mx.random.normal((n, d_in)).astype(dt)
                mx.eval(x)

                def go(x=x, ws=ws):
                    mx.eval([x @ w.T for w in ws])

                t = best_time(go, args.repeats, warmup=True) / args.layers
                if base is None:
                    base = t
                gbs = d_in * d_out * ws[0].itemsize / t / 1e9
                print(f"{d_in}x{d_out:<5} {name:>9} {n:>5} {1e3 * t:>8.3f} {gbs:>7.2f} "
                      f"{t / base:>13.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
