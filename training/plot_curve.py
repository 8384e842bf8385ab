"""Tau against training tokens, per evaluation set, from the curve `dflash-mlx train --eval-set`
writes (OUT/curve.jsonl): a table on stdout and a PNG.

    .venv/bin/python training/plot_curve.py runs/mix/curve.jsonl --out docs/img/tau-curve.png

Several curve files are joined in order; the i-th `--offset N` adds N tokens to the i-th
file's points (a run that started from another run's weights with --init counts from 0).
With `--compare`, each file is a run of its own (one lever each, named by `--label`): one panel
per set, one line per run, so levers measured one at a time are seen side by side; there the
i-th `--offset` places the i-th run (one that continued another's weights) where that one ended.

    .venv/bin/python training/plot_curve.py runs/mix/curve.jsonl runs/mix-kl/curve.jsonl \
        --compare --label "CE" --label "CE + KL 0.5" --out docs/img/levers.png
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


def eval_sets(points: list[dict]) -> list[str]:
    return [k for k in points[0] if k not in ("step", "seen_tokens")]


def print_table(points: list[dict], sets: list[str]) -> None:
    print(f"{'step':>6} {'tokens':>9} " + " ".join(f"{s:>10}" for s in sets))
    for p in points:
        row = " ".join(f"{p.get(s, float('nan')):>10.2f}" for s in sets)
        print(f"{p['step']:>6} {p['seen_tokens']:>9} {row}")


def plot_line(ax, points: list[dict], s: str, label: str) -> None:
    """Set s's tau against tokens (millions); points without s are skipped."""
    xs = [p["seen_tokens"] / 1e6 for p in points if s in p]
    ax.plot(xs, [p[s] for p in points if s in p], marker="o", label=label)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, out: Path, dpi: int) -> None:
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("curves", nargs="+", type=Path)
    ap.add_argument("--offset", type=int, action="append", default=[])
    ap.add_argument("--out", type=Path, help="PNG to write (needs matplotlib).")
    ap.add_argument("--title", default="DFlash tau against training tokens")
    ap.add_argument("--compare", action="store_true", help="Each file is a run of its own.")
    ap.add_argument("--label", action="append", default=[], help="Run names for --compare.")
    args = ap.parse_args()
    if args.compare:
        compare(args)
        return
    points = read(args.curves, args.offset)
    sets = eval_sets(points)
    print_table(points, sets)
    if args.out is None:
        return
    fig, ax = pyplot().subplots(figsize=(7, 4))
    for s in sets:
        plot_line(ax, points, s, s)
    ax.set_xlabel("response tokens trained on (millions, with repeats)")
    ax.set_ylabel("mean tau (DFlash, greedy)")
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, args.out, dpi=120)


def compare(args) -> None:
    labels = args.label + [p.parent.name for p in args.curves[len(args.label) :]]
    runs = {
        label: read([path], args.offset[i : i + 1])
        for i, (label, path) in enumerate(zip(labels, args.curves, strict=True))
    }
    sets = eval_sets(next(iter(runs.values())))
    for label, points in runs.items():
        print(f"{label}:")
        print_table(points, sets)
    if args.out is None:
        return
    fig, axes = pyplot().subplots(
        1, len(sets), figsize=(3.2 * len(sets), 3.6), sharex=True, squeeze=False
    )
    for ax, s in zip(axes[0], sets, strict=True):
        for label, points in runs.items():
            plot_line(ax, points, s, label)
        ax.set_title(s)
        ax.set_xlabel("tokens trained on (M)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean tau (DFlash, greedy)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(args.title)
    save(fig, args.out, dpi=110)


if __name__ == "__main__":
    main()
