"""Host time per round, by round kind, on targets whose compute is almost nothing (issue 50).

On a Mac a 4-bit 8B step takes 15-25 ms, so a few milliseconds of Python, numpy and syncs per
round decide the speedup; on this CPU a real step hides them. So each round kind runs here on
the planted pairs of `scripts/overhead_case.py` (a tiny Qwen3 target and a trained drafter,
tau ~5; a DFlash and a DFlash 2 one), where a verify costs well under a millisecond, and the
table shows per round (medians over every decoding round of every prompt, after a warm-up):

- round: the whole round's wall time; its spread (median / min) beside it;
- draft / verify / host: the round's phases (Round.t_draft: drafter pass, tree and lookup;
  t_verify: the verify's graph and its one sync; t_other: walk, commit, stats);
- Python: of draft and verify, building MLX graphs (Round.t_build);
- grammar: inside llguidance;
- device: what the same verify and drafter pass cost with their graphs already built (timed
  alone, evaluation only), so host = round - device is the host's share;
- batched rows: one packed tick of 4 or 8 rows (wall per packed forward, and per row-round).

Compiled layer halves are on (models/compiled.py: a GPU keeps them where they measured exact
and faster; DFLASH_MLX_COMPILE=0 to compare). The CPU tricks are off (a Mac runs none of them),
unless --cpu-tricks: numpy exponentials, BLAS row padding, the CPU attention (grouped matmuls
and a base-2 softmax: about 14 operations a layer where a Mac builds MLX's one fused
attention), and queueing a verify layer by layer
(models/queueing.py), which overlaps graph building with evaluation here, on cores the two then
share. OpenBLAS's thread count stays as the target's load chose it (models/queueing.py): one
fewer where that leaves Python a core, as a Mac's GPU never takes one from it.

    python scripts/overhead_case.py build models/overhead-case          # once, ~3 minutes
    python scripts/overhead_case.py build-dflash2 models/overhead-case2
    python scripts/host_time.py --json runs/host-time.json

Outputs are checked against plain greedy decoding (every case is exact or the script stops).
"""

# isort: skip_file
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# The CPU tricks (numpy exponentials, BLAS row padding, the CPU attention: engine/device.py)
# never run on a Mac; the first two sync inside a forward's graph, which would blur graph
# building and evaluation here, and the third builds more operations than a Mac's graph: off,
# unless --cpu-tricks.
if "--cpu-tricks" not in sys.argv:
    os.environ.setdefault("DFLASH_MLX_NUMPY_MATH", "0")
    os.environ.setdefault("DFLASH_MLX_ROW_PADDING", "0")
    os.environ.setdefault("DFLASH_MLX_CPU_ATTENTION", "0")
    # A GPU compiles a layer's fixed-shape halves where that measured exact and faster
    # (models/compiled.py); the CPU backend does not by default: on, as on a GPU.
    os.environ.setdefault("DFLASH_MLX_COMPILE", "1")

import mlx_dflash  # noqa: F401  (loads OpenBLAS before mlx on Linux)

import mlx.core as mx
import numpy as np

from mlx_dflash import GenerationConfig, Session, generate_rounds, load_pair
from mlx_dflash.engine.batch import run_rows
from mlx_dflash.engine.grammar import GrammarSpec
from mlx_dflash.models.drafter import DrafterRunner
from mlx_dflash.engine.contract import Pass

ANY_TEXT = GrammarSpec("regex", r"(?s:.{0,2000})")  # allows everything: the matcher's cost alone

# Seconds spent waiting for the device: every wait of a greedy round goes through mx.eval,
# rounds.to_host or an item() (tests/test_syncs.py counts them), so a round's wall time minus
# its waits is its host time, measured directly (the drafter's pass is queued with
# mx.async_eval, engine/device.py; on this CPU MLX runs it mostly within that call, which is
# then counted as a wait too).
WAITED = [0.0]


def _timed(real):
    def wait(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            WAITED[0] += time.perf_counter() - t0

    return wait


def count_waits() -> None:
    from mlx_dflash.engine import rounds

    mx.eval = _timed(mx.eval)
    mx.async_eval = _timed(mx.async_eval)
    mx.array.item = _timed(mx.array.item)
    rounds.to_host = _timed(rounds.to_host)


def cases(corpus: str) -> list[tuple[str, str, dict]]:
    """(label, pair: "dflash" | "dflash2", GenerationConfig settings)."""
    return [
        ("DFlash block", "dflash", {"mode": "dflash"}),
        ("DFlash 2 chain", "dflash2", {"mode": "dflash"}),
        ("DDTree 8", "dflash", {"mode": "ddtree", "budget": 8}),
        ("DDTree 32", "dflash", {"mode": "ddtree", "budget": 32}),
        ("DDTree 64", "dflash", {"mode": "ddtree", "budget": 64}),
        ("DDTree 64 + lookup", "dflash", {"mode": "ddtree", "budget": 64, "lookup": 10}),
        ("DDTree 64 + lookup + corpus", "dflash",
         {"mode": "ddtree", "budget": 64, "lookup": 10, "lookup_corpus": corpus}),
        ("DDTree 64, grammar", "dflash", {"mode": "ddtree", "budget": 64, "grammar": ANY_TEXT}),
        ("DFlash block, grammar", "dflash", {"mode": "dflash", "grammar": ANY_TEXT}),
        ("lattice tree 32 (DFlash 2)", "dflash2", {"mode": "ddtree", "budget": 32}),
        ("default (auto + lookup)", "dflash", {}),
    ]  # fmt: skip


def greedy(target, ids, n):
    cfg = GenerationConfig(max_tokens=n, mode="ar")
    return [t for r in generate_rounds(Session(target), ids, cfg) for t in r.tokens]


def device_ms(target, drafter, ids, tree_size: int, reps: int = 5) -> float:
    """One verify of `tree_size` tokens and one drafter pass, graphs built first and timed
    while they evaluate only (best of `reps`)."""
    session = Session(target, drafter)
    for _ in generate_rounds(session, ids, GenerationConfig(max_tokens=1, mode="ar")):
        pass
    start = len(session.tokens)
    best = float("inf")
    for _ in range(reps + 1):  # the first one warms up
        toks = mx.array(ids[: max(1, tree_size)] * (tree_size // max(1, len(ids)) + 1))[:tree_size]
        logits, taps = target.forward(
            [Pass(toks, session.cache, start, parents=np.arange(-1, tree_size - 1))]
        )[0]
        props = drafter.propose(ids[-1], start, drafter.block_size - 1) if drafter else None
        arrays = [logits, taps] + ([props.logits] if props is not None else [])
        t0 = time.perf_counter()
        mx.eval(arrays)
        best = min(best, time.perf_counter() - t0)
        session.commit([])
    return 1000 * best


def measure(pair, settings: dict, prompts, n: int, reps: int, truth) -> dict:
    target, drafter = pair
    cfg = GenerationConfig(max_tokens=n, **settings)
    rounds, waited = [], []
    for rep in range(reps + 1):  # the first pass warms up (compiles, profiles, indexes)
        for ids, want in zip(prompts, truth, strict=True):
            got = []
            WAITED[0] = 0.0
            for r in generate_rounds(Session(target, drafter), ids, cfg):
                got.append((r, WAITED[0]))
                WAITED[0] = 0.0
            out = [t for r, _ in got for t in r.tokens]
            if not settings.get("grammar"):
                assert out == want, f"{settings}: not the target's greedy text"
            if rep:
                kept = [(r, w) for r, w in got if not r.prefill and r.drafted]
                rounds += [r for r, _ in kept]
                waited += [w for _, w in kept]
    if not rounds:
        return {}

    def med(f):
        return 1000 * float(np.median([f(r) for r in rounds]))

    total = [r.t_draft + r.t_verify + r.t_other for r in rounds]
    outside = [t - w for t, w in zip(total, waited, strict=True)]
    size = int(np.median([r.drafted + 1 for r in rounds]))
    dev = device_ms(target, drafter, prompts[0], size)
    round_ms = 1000 * float(np.median(total))
    return {
        "rounds": len(rounds),
        "tau": float(np.mean([r.accepted for r in rounds])),
        "verify_tokens": size,
        "round_ms": round_ms,
        "median_over_min": float(np.median(total) / np.min(total)),
        "draft_ms": med(lambda r: r.t_draft),
        "verify_ms": med(lambda r: r.t_verify),
        "host_ms_after_verify": med(lambda r: r.t_other),
        "python_graph_ms": med(lambda r: r.t_build),
        "grammar_ms": med(lambda r: r.t_grammar),
        "device_ms": dev,
        "host_ms": round_ms - dev,
        "host_outside_waits_ms": 1000 * float(np.median(outside)),
        "host_outside_waits_min_ms": 1000 * float(np.min(outside)),
    }


def batched_tick(pair, prompts, n: int, rows: int, settings: dict) -> dict:
    """`rows` generations at once (engine/batch.py): wall time per packed forward."""
    target, drafter = pair
    cfg = GenerationConfig(max_tokens=n, **settings)

    def row(i: int):
        def generate(shared) -> None:
            runner = DrafterRunner(drafter.drafter, shared)
            for _ in generate_rounds(Session(shared, runner), prompts[i % len(prompts)], cfg):
                pass

        return generate

    run_rows(target, [row(i) for i in range(rows)])  # warm-up
    t0 = time.perf_counter()
    batcher = run_rows(target, [row(i) for i in range(rows)])
    wall = time.perf_counter() - t0
    return {"rows": rows, "forwards": batcher.forwards,
            "tick_ms": 1000 * wall / batcher.forwards,
            "row_round_ms": 1000 * wall / batcher.rows}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dflash", default="models/overhead-case")
    ap.add_argument("--dflash2", default="models/overhead-case2")
    ap.add_argument("-n", "--max-tokens", type=int, default=64)
    ap.add_argument("--limit", type=int, default=4, help="prompts per pair")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--cpu-tricks",
        action="store_true",
        help="keep this CPU's numpy, padding, attention and per-layer queueing",
    )
    ap.add_argument(
        "--queue-layers",
        action="store_true",
        help="queue a verify and the drafter's pass layer by layer on any device (the CPU's "
        "default; a GPU's rounds with it, to compare with a run without)",
    )
    args = ap.parse_args()
    # Queueing layer by layer: forced on with --queue-layers (a GPU's rounds with it, on any
    # device), off without --cpu-tricks (as a GPU that measured it slower), else as loaded.
    queue = True if args.queue_layers else (None if args.cpu_tricks else False)
    count_waits()
    from rich.console import Console
    from rich.table import Table

    pairs, prompts, truth = {}, {}, {}
    for kind, folder in (("dflash", args.dflash), ("dflash2", args.dflash2)):
        case = Path(folder)
        if not (case / "target").is_dir():
            raise SystemExit(f"{case} is missing: python scripts/overhead_case.py build {case}")
        pairs[kind] = load_pair(str(case / "target"), str(case / "drafter"))
        if queue is not None:
            pairs[kind][0].queue_layers = queue
        lines = (case / "prompts.jsonl").read_text().splitlines()[: args.limit]
        prompts[kind] = [json.loads(line)["token_ids"] for line in lines]
        truth[kind] = [greedy(pairs[kind][0], ids, args.max_tokens) for ids in prompts[kind]]
    # The corpus: the DFlash pair's answers to its other prompts (as a shipped drafter's are).
    corpus = Path(tempfile.mkdtemp()) / "answers.jsonl"
    others = (Path(args.dflash) / "prompts.jsonl").read_text().splitlines()[args.limit :]
    with corpus.open("w") as f:
        for line in others:
            ids = json.loads(line)["token_ids"]
            f.write(
                json.dumps({"tokens": greedy(pairs["dflash"][0], ids, 2 * args.max_tokens)}) + "\n"
            )

    table = Table(title=f"Host time per round, ms ({args.max_tokens} tokens, medians)")
    cols = ("case", "tau", "tokens", "round", "med/min", "draft", "verify", "after",
            "Python", "grammar", "device", "host", "host (waits)")  # fmt: skip
    for c in cols:
        table.add_column(c, justify="left" if c == "case" else "right")
    results = {}
    for label, kind, settings in cases(str(corpus)):
        r = measure(pairs[kind], settings, prompts[kind], args.max_tokens, args.reps, truth[kind])
        results[label] = r
        if not r:
            continue
        table.add_row(label, f"{r['tau']:.2f}", str(r["verify_tokens"]),
                      *(f"{r[k]:.2f}" for k in ("round_ms", "median_over_min", "draft_ms",
                        "verify_ms", "host_ms_after_verify", "python_graph_ms", "grammar_ms",
                        "device_ms", "host_ms", "host_outside_waits_ms")))  # fmt: skip
    for rows in (4, 8):
        b = batched_tick(
            pairs["dflash"], prompts["dflash"], args.max_tokens, rows, {"mode": "dflash"}
        )
        results[f"batched tick, {rows} rows"] = b
        table.add_row(f"batched DFlash, {rows} rows: per tick / per row-round", "", "",
                      f"{b['tick_ms']:.2f}", "", "", "", "", "", "", "", f"{b['row_round_ms']:.2f}", "")  # fmt: skip
    Console().print(table)
    print(
        "round = draft + verify + after (walk, commit); Python = graph building inside draft "
        "and verify; device = that verify and drafter pass evaluated alone; host = round - device; "
        "host (waits) = round - the round's own waits for the device, measured inside the round"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
        print(f"Wrote {args.json}")


if __name__ == "__main__":
    main()
