"""`dflash-mlx bench`: methods side by side on prompt sets; JSON, a PNG plot, a table."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer

from ..benchmark.report import print_report, write_plot
from ..benchmark.runner import DEFAULT_METHODS, run_bench
from ..progress import progress


def bench_command(
    model: str = typer.Option(
        None, "--model", "-m", help="Target folder or hub id (default: embedded stories260K)."
    ),
    drafter: str = typer.Option(None, "--drafter", "-d", help="DFlash drafter folder or hub id."),
    methods: str = typer.Option(
        DEFAULT_METHODS,
        "--methods",
        help="Comma list: mlx-lm, default (what generate runs untold), ar, dflash[:N|auto], "
        "ddtree:BUDGET|auto, lookup[:auto], ddtree+lookup[:auto]; lookup+corpus / "
        "ddtree+lookup+corpus with --lookup-corpus. A coding agent's sessions against serve "
        "and mlx_lm.server: scripts/agent_session.py.",
    ),
    dataset: list[str] = typer.Option(
        ["gsm8k"],
        "--dataset",
        help="humaneval | gsm8k | math500 | mbpp | mt-bench | copy | FILE.jsonl (repeat or comma list).",
    ),
    data_dir: Path = typer.Option(
        None, "--data-dir", help="Folder with the bench files (default: ../shared/data/bench)."
    ),
    limit: int = typer.Option(10, "--limit", min=1, help="Prompts per dataset."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", min=1),
    temp: float = typer.Option(0.0, "--temp", min=0.0, help="0 = greedy (outputs are compared)."),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0),
    top_k: int = typer.Option(0, "--top-k", min=0),
    seed: int = typer.Option(0, "--seed"),
    block_size: int = typer.Option(None, "--block-size", help="At most the drafter's."),
    chat_template: bool = typer.Option(
        None, "--chat-template/--no-chat-template", help="Default: on for models that have one."
    ),
    system: str = typer.Option(None, "--system", help="System message (chat template)."),
    context: int = typer.Option(
        None,
        "--context",
        min=1,
        help="Long context: each prompt after earlier text of its set, about N tokens in all.",
    ),
    profile: bool = typer.Option(
        False,
        "--profile",
        help="Split each round into draft / verify / host / Python time (syncs every phase).",
    ),
    lookup_corpus: str = typer.Option(
        None,
        "--lookup-corpus",
        help="The target's past answers (JSONL of token lists) that the +corpus methods "
        "(lookup+corpus, ddtree+lookup+corpus) also look up in.",
    ),
    grow_corpus: bool = typer.Option(
        False,
        "--grow-corpus",
        help="Each answer of a +corpus method joins its corpus before the next prompt, as "
        "serve's corpus grows with the answers it serves (empty at first without "
        "--lookup-corpus).",
    ),
    repeat: int = typer.Option(
        1, "--repeat", min=1, help="Run each prompt N times; each method's median run counts."
    ),
    out: Path = typer.Option(
        None, "--out", "-o", help="JSON results (default: bench-results/bench-<timestamp>.json)."
    ),
    plot: bool = typer.Option(True, "--plot/--no-plot", help="Also write a PNG next to the JSON."),
) -> None:
    """Benchmark mlx-lm, AR, DFlash and DDTree side by side; writes JSON and a PNG plot."""
    settings = {k: v for k, v in locals().items() if k not in ("out", "plot", "dataset")}
    from rich.console import Console

    # Logs and pipes get the whole table rather than columns squeezed to 80 characters.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    with progress() as bar:

        def on_start(total):
            task = bar.add_task("loading", total=total)
            return lambda desc, n: bar.update(task, advance=n, description=desc)

        results = run_bench(**settings, datasets=dataset, progress=on_start)
    _write(results, out, plot, console)
    if results["identical"]["checked"] and not results["identical"]["identical"]:
        raise typer.Exit(1)


def _write(results: dict, out: Path | None, plot: bool, console) -> None:
    """The JSON (default: bench-results/bench-<timestamp>.json), the PNG beside it, the table."""
    if out is None:
        out = Path("bench-results") / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    png = None
    if plot:
        png = write_plot(results, out.with_suffix(".png"))
        results["plot"] = str(png) if png else None
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print_report(results, console)
    console.print(f"Wrote {out}")
    if png:
        console.print(f"Wrote {png}")
    elif plot:
        console.print("Plot skipped: matplotlib is not installed (pip install 'mlx-dflash[plot]').")
