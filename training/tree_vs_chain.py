"""Decoded tau of DDTree trees against chains of the same verify size, per drafter and prompt set.

    .venv/bin/python training/tree_vs_chain.py -m TARGET --drafter DIR [--drafter DIR2] \
        [--sets gsm8k,humaneval,mt-bench,mixed] [--limit 4] [--max-tokens 96] [--budgets 4,8,16]

Greedy decoding with the real engine: `ddtree:N` verifies N drafted nodes as a best-first tree
(over a DFlash 2 drafter's lattice, or a DFlash drafter's per-position top-k), the chain of
the same size is the same round with one child per node (`branching=1`: the greedy chain, the
selector's for DFlash 2), capped by the drafter's block. The output is the target's either way;
what differs is how many tokens each verify accepts (tau), the lever on this CPU, where any
5-16 token verify costs about the same.
"""

from __future__ import annotations

import argparse
import sys

import mlx_dflash  # noqa: F401  (OpenBLAS before mlx)
from mlx_dflash.benchmark.datasets import load_prompts
from mlx_dflash.engine import GenerationConfig, Session, generate_rounds
from mlx_dflash.models.drafter import DrafterRunner, load_drafter
from mlx_dflash.models.target import load_target
from mlx_dflash.prompts import encode_prompt, stop_ids


def tau(target, runner, prompts, max_tokens: int, budget: int, branching: int | None):
    """(mean tau over all drafted rounds, rounds) for greedy decoding of `prompts`."""
    total = rounds = 0
    for ids in prompts:
        cfg = GenerationConfig(max_tokens=max_tokens, mode="ddtree", budget=budget,
                               branching=branching, stop_ids=stop_ids(target.tokenizer))  # fmt: skip
        for r in generate_rounds(Session(target, runner), ids, cfg):
            if not r.prefill and r.drafted:
                total, rounds = total + r.accepted, rounds + 1
    return total / max(rounds, 1), rounds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--drafter", action="append", required=True)
    ap.add_argument("--sets", default="gsm8k,humaneval,mt-bench,mixed")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--budgets", default="4,8,16")
    a = ap.parse_args(argv)
    target = load_target(a.model)
    budgets = [int(b) for b in a.budgets.split(",")]
    print("| drafter | set | " + " | ".join(f"chain {b} | tree {b}" for b in budgets) + " |")
    print("|---|---|" + "---|---|" * len(budgets))
    for path in a.drafter:
        drafter = load_drafter(path, num_target_layers=target.num_layers)
        target.set_taps(drafter.cfg.target_layer_ids)
        for name in a.sets.split(","):
            prompts = [
                encode_prompt(target.tokenizer, p) for p in load_prompts(name, None, a.limit)
            ]
            cells = []
            for b in budgets:
                for branching in (1, None):
                    runner = DrafterRunner(drafter, target)
                    t, n = tau(target, runner, prompts, a.max_tokens, b, branching)
                    cells.append(f"{t:.2f} ({n})")
            print(f"| {path} | {name} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
