"""B rows' drafter passes (batched rounds): one packed pass (models/drafter.py propose_rows)
against B passes of their own, side by side; best of 5, ms each. Each row has its own context
(a random prompt of its own length through the target).

    .venv/bin/python scripts/packed_drafts.py -m models/smollm2-135m-instruct-f32 \
        --drafter mlx_dflash/assets/smollm2-135m-instruct-dflash --rows 2 4 8
"""

from __future__ import annotations

import argparse
from functools import partial

import mlx_dflash  # noqa: F401  (first: OpenBLAS must load before mlx)

# isort: split
import mlx.core as mx
import numpy as np
from verify_cost import best_time  # scripts/ is on the path when a script runs

from mlx_dflash.engine.contract import Pass
from mlx_dflash.models.drafter import DrafterRunner, load_drafter, propose_rows
from mlx_dflash.models.target import load_target


def each_alone(runners, requests) -> list:
    return [r.propose_alone(*q) for r, q in zip(runners, requests, strict=True)]


def evaluated(run):
    """`run`, its proposals evaluated (MLX is lazy: the timing must include the work)."""

    def once():
        props = run()
        mx.eval([p.logits for p in props] + [p.lattice.pairs for p in props if p.lattice])

    return once


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--context", type=int, default=200)
    a = ap.parse_args()
    target = load_target(a.model)
    drafter = load_drafter(a.drafter, num_target_layers=target.num_layers)
    target.set_taps(drafter.cfg.target_layer_ids)
    n = min(drafter.cfg.block_size - 1, 7)
    rng = np.random.default_rng(0)
    print(f"{drafter.cfg.kind} drafter, {n} positions a row")
    print("| rows | passes of their own | one packed pass |\n|---|---|---|")
    for rows in a.rows:
        runners, requests = [], []
        for r in range(rows):
            ids = rng.integers(100, 20000, a.context + 17 * r).tolist()
            _, taps = target.forward([Pass(mx.array(ids), target.make_cache(), 0)])[0]
            runner = DrafterRunner(drafter, target)
            runner.add_context(taps)
            runners.append(runner)
            requests.append((ids[-1], len(ids), n))
        alone = 1000 * best_time(evaluated(partial(each_alone, runners, requests)), 5, True)
        packed = 1000 * best_time(evaluated(partial(propose_rows, runners, requests)), 5, True)
        print(f"| {rows} | {alone:.1f} ms | {packed:.1f} ms |", flush=True)


if __name__ == "__main__":
    main()
