"""Mean tau of DFlash greedy decoding (the real engine) for a drafter on held-out prompts.

    .venv/bin/python training/eval_tau.py [--drafter DIR] [--prompts FILE.jsonl --last N]
        [--max-tokens 96]

Without --prompts: a fixed list of story openings (for the embedded stories260K pair). With
--prompts: the last N prompts of a `dflash-mlx train` prompts.jsonl (the held-out split).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx_dflash  # noqa: F401  (OpenBLAS before mlx)
from mlx_dflash.models.drafter import load_drafter
from mlx_dflash.models.target import load_target
from mlx_dflash.paths import DEFAULT_DRAFTER, DEFAULT_TARGET
from mlx_dflash.training.data import encode
from mlx_dflash.training.trainer import eval_tau

OPENINGS = [
    "Once upon a time, there was a little dog",
    "One day, Tim went to the park",
    "Lily wanted to bake a cake for her mom",
    "The sun was shining and the birds",
    "Ben had a red ball. He",
    "There was a big tree in the garden",
    "Sara and her friend went to the beach",
    "Max was a happy cat who liked",
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_TARGET))
    ap.add_argument("--drafter", action="append", help="repeatable (default: embedded)")
    ap.add_argument("--prompts", type=Path)
    ap.add_argument("--last", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    target = load_target(args.model)
    if args.prompts:
        lines = args.prompts.read_text().splitlines()[-args.last :]
        prompts = [json.loads(line)["prompt"] for line in lines]
    else:
        prompts = OPENINGS
    ids = [encode(target.tokenizer, p) for p in prompts]
    for d in args.drafter or [str(DEFAULT_DRAFTER)]:
        drafter = load_drafter(d, num_target_layers=target.num_layers)
        ev = eval_tau(drafter, target, ids, args.max_tokens)
        hist = " ".join(f"{k}:{v}" for k, v in ev["histogram"].items())
        print(
            f"{d}: tau {ev['tau']:.2f} (mean per response {ev['tau_per_response']:.2f}) "
            f"over {len(ids)} prompts, {ev['rounds']} rounds [{hist}]"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
