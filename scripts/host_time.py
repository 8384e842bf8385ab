"""Host time per round, by round kind, on targets whose compute is almost nothing (issue 50).

On a Mac a 4-bit 8B step takes 15-25 ms, so a few milliseconds of Python, numpy and syncs per
round decide the speedup; on this CPU a real step hides them. So each round kind runs here on
the planted pairs of `scripts/overhead_case.py` (a tiny Qwen3 target and a trained drafter,
tau ~5; a DFlash and a DFlash 2 one), where a verify costs well under a millisecond, and the
table shows per round (medians over every decoding round of every prompt, after a warm-up):

- round: the whole round's wall time; its spread (median / min) beside it;
- waits: the round's own waits for the device (its syncs, and on this CPU the part of a
  queued pass MLX evaluates inside `mx.async_eval`);
- host: round - waits, the host's work, split into
  - graphs: building the MLX graphs of the target's forwards and the drafter's passes;
  - tree & lookup: the draft tree from the drafter's candidates (top-k on the host here, a
    CPU trick), the budget's cut, the lookup branch search and its graft;
  - rest: everything else (the walk, the commit, the policy's books, the loop);
  each measured outside the waits inside it;
- llguidance: the grammar's own time (Round.t_grammar), inside tree & lookup and rest;
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


# Host seconds by phase, outside the waits inside them; a call inside another timed one counts
# for the outer one only.
PHASES = {"graphs": 0.0, "tree": 0.0}
_INSIDE = [False]


def _phase(real, name: str):
    def run(*args, **kwargs):
        if _INSIDE[0]:
            return real(*args, **kwargs)
        _INSIDE[0] = True
        t0, w0 = time.perf_counter(), WAITED[0]
        try:
            return real(*args, **kwargs)
        finally:
            _INSIDE[0] = False
            PHASES[name] += time.perf_counter() - t0 - (WAITED[0] - w0)

    return run


def count_waits() -> None:
    """Time every wait (WAITED) and the host's phases (PHASES) from now on."""
    from mlx_dflash.engine import ddtree, rounds
    from mlx_dflash.models.target import Target

    mx.eval = _timed(mx.eval)
    mx.async_eval = _timed(mx.async_eval)
    mx.array.item = _timed(mx.array.item)
    rounds.to_host = _timed(rounds.to_host)
    Target.forward = _phase(Target.forward, "graphs")
    DrafterRunner.propose = _phase(DrafterRunner.propose, "graphs")
    for name in ("_drafter_tree", "_lookup_only", "_lookup_branches", "_cut_lookup"):
        setattr(ddtree.DDTree, name, _phase(getattr(ddtree.DDTree, name), "tree"))
    ddtree.graft = _phase(ddtree.graft, "tree")


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


def measure(pair, settings: dict, prompts, n: int, reps: int, truth) -> dict:
    target, drafter = pair
    cfg = GenerationConfig(max_tokens=n, **settings)
    rounds, waited, phases = [], [], []
    for rep in range(reps + 1):  # the first pass warms up (compiles, profiles, indexes)
        for ids, want in zip(prompts, truth, strict=True):
            got = []
            WAITED[0] = 0.0
            PHASES.update(graphs=0.0, tree=0.0)
            for r in generate_rounds(Session(target, drafter), ids, cfg):
                got.append((r, WAITED[0], dict(PHASES)))
                WAITED[0] = 0.0
                PHASES.update(graphs=0.0, tree=0.0)
            out = [t for r, _, _ in got for t in r.tokens]
            if not settings.get("grammar"):
                assert out == want, f"{settings}: not the target's greedy text"
            if rep:
                kept = [g for g in got if not g[0].prefill and g[0].drafted]
                rounds += [r for r, _, _ in kept]
                waited += [w for _, w, _ in kept]
                phases += [ph for _, _, ph in kept]
    if not rounds:
        return {}

    def ms(values) -> float:
        return 1000 * float(np.median(values))

    total = np.array([r.t_draft + r.t_verify + r.t_other for r in rounds])
    host = total - np.array(waited)
    graphs = np.array([ph["graphs"] for ph in phases])
    tree = np.array([ph["tree"] for ph in phases])
    return {
        "rounds": len(rounds),
        "tau": float(np.mean([r.accepted for r in rounds])),
        "verify_tokens": int(np.median([r.drafted + 1 for r in rounds])),
        "round_ms": ms(total),
        "median_over_min": float(np.median(total) / np.min(total)),
        "waits_ms": ms(waited),
        "host_outside_waits_ms": ms(host),
        "graphs_ms": ms(graphs),
        "tree_and_lookup_ms": ms(tree),
        "rest_ms": ms(host - graphs - tree),
        "grammar_ms": ms([r.t_grammar for r in rounds]),
        "host_outside_waits_min_ms": 1000 * float(np.min(host)),
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
    cols = ("case", "tau", "tokens", "round", "med/min", "waits", "host", "graphs",
            "tree & lookup", "rest", "llguidance", "host min")  # fmt: skip
    keys = ("round_ms", "median_over_min", "waits_ms", "host_outside_waits_ms", "graphs_ms",
            "tree_and_lookup_ms", "rest_ms", "grammar_ms", "host_outside_waits_min_ms")  # fmt: skip
    for c in cols:
        table.add_column(c, justify="left" if c == "case" else "right")
    results = {}
    for label, kind, settings in cases(str(corpus)):
        r = measure(pairs[kind], settings, prompts[kind], args.max_tokens, args.reps, truth[kind])
        results[label] = r
        if r:
            table.add_row(label, f"{r['tau']:.2f}", str(r["verify_tokens"]),
                          *(f"{r[k]:.2f}" for k in keys))  # fmt: skip
    for rows in (4, 8):
        b = batched_tick(
            pairs["dflash"], prompts["dflash"], args.max_tokens, rows, {"mode": "dflash"}
        )
        results[f"batched tick, {rows} rows"] = b
        table.add_row(f"batched DFlash, {rows} rows: a tick / a row-round", "", "",
                      f"{b['tick_ms']:.2f} / {b['row_round_ms']:.2f}")  # fmt: skip
    # (not a terminal: wide enough that the table is not folded into unreadable columns)
    Console(width=None if sys.stdout.isatty() else 170).print(table)
    print(
        "host = round - waits (the round's own waits for the device, measured inside it) = "
        "graphs + tree & lookup + rest, each outside the waits inside it; llguidance is part of "
        "tree & lookup and rest"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
        print(f"Wrote {args.json}")


if __name__ == "__main__":
    main()
