"""Tau against training tokens, per evaluation set, from the curve `dflash-mlx train --eval-set`
writes (OUT/curve.jsonl): a table on stdout and a PNG.

    .venv/bin/python training/plot_curve.py runs/mix/curve.jsonl --out docs/img/tau-curve.png

Several curve files are joined in order; the i-th `--offset N` adds N tokens to the i-th
file's points (a run that started from another run's weights with --init counts from 0).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read(paths: list[Path], offsets: list[int]) -> list[dict]:
    points = []
    for i, path in enumerate(paths):
        extra = offsets[i] if i < len(offsets) else 0
        for line in path.read_text().splitlines():
            if line.strip():
                p = json.loads(line)
                p["seen_tokens"] += extra
                points.append(p)
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("curves", nargs="+", type=Path)
    ap.add_argument("--offset", type=int, action="append", default=[])
    ap.add_argument("--out", type=Path, help="PNG to write (needs matplotlib).")
    ap.add_argument("--title", default="DFlash tau against training tokens")
    args = ap.parse_args()
    points = read(args.curves, args.offset)
    sets = [k for k in points[0] if k not in ("step", "seen_tokens")]
    print(f"{'step':>6} {'tokens':>9} " + " ".join(f"{s:>10}" for s in sets))
    for p in points:
        row = " ".join(f"{p.get(s, float('nan')):>10.2f}" for s in sets)
        print(f"{p['step']:>6} {p['seen_tokens']:>9} {row}")
    if args.out is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for s in sets:
        xs = [p["seen_tokens"] / 1e6 for p in points if s in p]
        ax.plot(xs, [p[s] for p in points if s in p], marker="o", label=s)
    ax.set_xlabel("response tokens trained on (millions, with repeats)")
    ax.set_ylabel("mean tau (DFlash, greedy)")
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
