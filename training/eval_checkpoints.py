"""Tau of saved drafter checkpoints on bench sets, as points of a training curve.

`dflash-mlx train --eval-set` measures the sets while training; this measures them afterwards,
on checkpoints copied aside during a run (each folder a `dflash-mlx train` output: config,
weights, draft vocabulary), so a run that was started without `--eval-set` still gets its
per-set curve. Writes the lines `training/plot_curve.py` reads:

    .venv/bin/python training/eval_checkpoints.py -m models/qwen2.5-coder-0.5b-instruct-f32 \\
        --checkpoint 600:runs/coder05-step600 --checkpoint 1200:runs/coder05-step1200 \\
        --tokens-per-step 837 --eval-set humaneval:4 --eval-set mbpp:4 --out runs/coder05/sets.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx_dflash  # noqa: F401  (OpenBLAS before mlx)
from mlx_dflash.benchmark.datasets import eval_sets
from mlx_dflash.models.drafter import load_drafter
from mlx_dflash.models.target import load_target
from mlx_dflash.training.data import encode
from mlx_dflash.training.trainer import eval_tau


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--checkpoint", action="append", required=True, help="STEP:FOLDER")
    ap.add_argument("--tokens-per-step", type=float, required=True)
    ap.add_argument("--eval-set", action="append", required=True, help="NAME[:N]")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    target = load_target(args.model)
    sets = {n: [encode(target.tokenizer, p) for p in ps] for n, ps in eval_sets(args.eval_set)}
    with args.out.open("a") as f:
        for spec in args.checkpoint:
            step, folder = spec.split(":", 1)
            drafter = load_drafter(folder)
            point = {"step": int(step), "seen_tokens": int(int(step) * args.tokens_per_step)}
            for name, prompts in sets.items():
                point[name] = eval_tau(drafter, target, prompts, args.max_tokens)["tau"]
            print(json.dumps(point), flush=True)
            f.write(json.dumps(point) + "\n")
            f.flush()


if __name__ == "__main__":
    main()
