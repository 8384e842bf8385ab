"""`dflash-mlx bench`: plain mlx-lm decoding, our AR loop, DFlash and DDTree, side by side.

All methods run on the same loaded target, prompt by prompt (interleaved, so thermal or load
drift hits every method alike), after one warm-up each. Only decoding is timed; prefill is
reported on its own. Greedy outputs must be token-identical across methods (that is the
lossless claim), so they are compared and any difference is reported loudly.
"""

from __future__ import annotations

import gzip
import json
import os
import platform
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from .engine import GenerationConfig, Session, generate_rounds
from .errors import DFlashError
from .generate import Stats, encode_prompt, load_pair, parse_budget, stop_ids
from .sampling import SamplingParams

# name -> (local file under --data-dir, field holding the prompt)
DATASETS: dict[str, tuple[str, str]] = {
    "humaneval": ("HumanEval.jsonl.gz", "prompt"),
    "gsm8k": ("gsm8k_test.jsonl", "question"),
    "math500": ("math500_test.jsonl", "problem"),
    "mbpp": ("mbpp_sanitized.json", "prompt"),
    "mt-bench": ("mt_bench_question.jsonl", "turns"),
}
# Where the same sets live on the Hugging Face hub, for machines without ../shared.
HUB_DATASETS: dict[str, tuple[str, str]] = {
    "humaneval": ("openai/openai_humaneval", "openai_humaneval/test-00000-of-00001.parquet"),
    "gsm8k": ("openai/gsm8k", "main/test-00000-of-00001.parquet"),
    "math500": ("HuggingFaceH4/MATH-500", "test.jsonl"),
    "mbpp": ("google-research-datasets/mbpp", "sanitized/test-00000-of-00001.parquet"),
    "mt-bench": ("HuggingFaceH4/mt_bench_prompts", "raw/question.jsonl"),
}
# Fields tried, in order, for a user's own FILE.jsonl.
PROMPT_FIELDS = ("prompt", "question", "problem", "instruction", "input", "text", "turns")
DEFAULT_METHODS = "mlx-lm,ar,dflash,ddtree:auto"
WARMUP_TOKENS = 8


# --------------------------------------------------------------------------------------------
# Methods


@dataclass(frozen=True)
class Method:
    label: str  # as the user wrote it: "ddtree:16"
    mode: str  # "mlx-lm" | "ar" | "dflash" | "ddtree"
    budget: int | str = 16


def parse_methods(spec: str | list[str]) -> list[Method]:
    """`mlx-lm,ar,dflash,ddtree:4,ddtree:auto` -> Methods (ddtree alone means budget 16)."""
    items = spec.split(",") if isinstance(spec, str) else [s for x in spec for s in x.split(",")]
    out: list[Method] = []
    for item in (s.strip() for s in items):
        if not item:
            continue
        mode, _, arg = item.partition(":")
        if mode in ("mlx-lm", "ar", "dflash") and not arg:
            out.append(Method(item, mode))
        elif mode == "ddtree":
            out.append(Method(item, mode, parse_budget(arg or "16")))
        else:
            raise DFlashError(
                f"Unknown method '{item}' (use mlx-lm, ar, dflash, ddtree or ddtree:BUDGET)."
            )
    if not out:
        raise DFlashError("--methods names no method.")
    labels = [m.label for m in out]
    dup = next((x for x in labels if labels.count(x) > 1), None)
    if dup:
        raise DFlashError(f"Method '{dup}' is listed twice.")
    return out


# --------------------------------------------------------------------------------------------
# Prompt sets


def default_data_dir() -> Path | None:
    """$DFLASH_SHARED/data/bench, else the repo's ../shared/data/bench, when it exists."""
    roots = [os.environ.get("DFLASH_SHARED"), Path(__file__).resolve().parents[2] / "shared"]
    for root in roots:
        if root and (Path(root) / "data" / "bench").is_dir():
            return Path(root) / "data" / "bench"
    return None


def _read_records(path: Path) -> list[Any]:
    name = path.name.lower()
    try:
        if name.endswith(".parquet"):
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise DFlashError(
                    f"Reading {path.name} needs pyarrow: pip install pyarrow."
                ) from None
            return pq.read_table(path).to_pylist()
        opener = gzip.open if name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            text = f.read()
        if name.endswith((".json", ".json.gz")):
            data = json.loads(text)
            return data if isinstance(data, list) else [data]
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except (OSError, ValueError, UnicodeDecodeError, EOFError) as e:
        raise DFlashError(f"Could not read prompts from {path}: {e}.") from e


def _prompt_of(record: Any, field: str | None, source: str) -> str:
    if isinstance(record, str):
        return record
    if not isinstance(record, dict):
        raise DFlashError(f"{source} holds a {type(record).__name__}, not prompt records.")
    fields = [field] if field in record else [f for f in PROMPT_FIELDS if f in record]
    if not fields:
        raise DFlashError(f"{source} has records without any of the fields {PROMPT_FIELDS}.")
    value = record[fields[0]]
    if isinstance(value, list):  # multi-turn sets: the first turn
        value = value[0] if value else ""
    return str(value)


def _hub_file(name: str) -> Path:
    from huggingface_hub import hf_hub_download

    repo, filename = HUB_DATASETS[name]
    try:
        return Path(hf_hub_download(repo, filename, repo_type="dataset"))
    except Exception as e:  # offline, DNS, gated, moved: the user's remedy is the same
        raise DFlashError(
            f"The {name} prompts are not on this machine (no --data-dir, no ../shared/data/bench) "
            f"and could not be fetched from the Hugging Face hub ({repo}); pass --data-dir."
        ) from e


def load_prompts(dataset: str, data_dir: str | Path | None = None, limit: int | None = None):
    """The prompts of a named set (from `data_dir`, else the hub) or of a .jsonl/.json file."""
    if dataset in DATASETS:
        filename, field = DATASETS[dataset]
        folder = Path(data_dir) if data_dir is not None else default_data_dir()
        if folder is not None:
            path = folder / filename
            if not path.is_file():
                raise DFlashError(f"{path} does not exist (the {dataset} prompts).")
        else:
            path = _hub_file(dataset)
    else:
        path, field = Path(dataset).expanduser(), None
        if not path.is_file():
            names = ", ".join(DATASETS)
            raise DFlashError(f"Unknown dataset '{dataset}': use one of {names} or a .jsonl file.")
    records = _read_records(path)
    prompts = [_prompt_of(r, field, str(path)) for r in records]
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise DFlashError(f"{path} holds no prompts.")
    return prompts[:limit] if limit else prompts


# --------------------------------------------------------------------------------------------
# Running one prompt


@dataclass
class Run:
    tokens: list[int]
    prompt_tokens: int
    t_prefill: float
    t_decode: float
    taus: list[int]
    t_draft: float | None = None
    t_verify: float | None = None
    t_other: float | None = None
    draft_rounds: int = 0


def run_engine(target, runner, ids: list[int], cfg: GenerationConfig) -> Run:
    """Our engine (ar, dflash or ddtree) on one prompt, from an empty cache."""
    session = Session(target, runner if cfg.mode != "ar" else None)
    stats, tokens = Stats(), []
    for rnd in generate_rounds(session, ids, cfg):
        stats.add(rnd)
        tokens += rnd.tokens
    return Run(
        tokens,
        stats.prompt_tokens,
        stats.t_prefill,
        stats.t_decode,
        stats.taus,
        stats.t_draft,
        stats.t_verify,
        stats.t_other,
        stats.draft_rounds,
    )


def run_mlx_lm(target, ids: list[int], cfg: GenerationConfig) -> Run:
    """mlx-lm's own generate_step with its sampler: the reference everyone compares to."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    s = cfg.sampling
    sampler = make_sampler(s.temperature, top_p=s.top_p if s.top_p < 1 else 0.0, top_k=s.top_k)
    if cfg.seed is not None:
        mx.random.seed(cfg.seed)
    tokens: list[int] = []
    t0 = time.perf_counter()
    t_first = t_last = t0
    gen = generate_step(mx.array(ids), target.model, max_tokens=cfg.max_tokens, sampler=sampler)
    try:
        for tok, _ in gen:
            t_last = time.perf_counter()
            if not tokens:
                t_first = t_last
            tokens.append(int(tok))
            if tokens[-1] in cfg.stop_ids:
                break
    finally:
        gen.close()
    n = len(tokens)
    return Run(tokens, len(ids), t_first - t0, t_last - t_first, [1] * max(n - 1, 0))


def run_method(method: Method, target, runner, ids: list[int], cfg: GenerationConfig) -> Run:
    if method.mode == "mlx-lm":
        return run_mlx_lm(target, ids, cfg)
    cfg = GenerationConfig(**{**vars(cfg), "mode": method.mode, "budget": method.budget})
    return run_engine(target, runner, ids, cfg)


# --------------------------------------------------------------------------------------------
# Aggregates and the identity check


def summarize(runs: list[Run]) -> dict[str, Any]:
    """One method on one dataset: decode speed over all prompts, tau, time split."""
    gen = sum(len(r.tokens) for r in runs)
    dec_tokens = sum(max(len(r.tokens) - 1, 0) for r in runs)
    t_dec = sum(r.t_decode for r in runs)
    t_pre = sum(r.t_prefill for r in runs)
    taus = [t for r in runs for t in r.taus]
    per_response = [sum(r.taus) / len(r.taus) for r in runs if r.taus]
    split = {}
    for part in ("draft", "verify", "other"):
        vals = [getattr(r, f"t_{part}") for r in runs]
        split[f"time_{part}_s"] = None if any(v is None for v in vals) else sum(vals)
    return {
        "prompts": len(runs),
        "prompt_tokens": sum(r.prompt_tokens for r in runs),
        "prompt_tps": sum(r.prompt_tokens for r in runs) / t_pre if t_pre > 0 else 0.0,
        "time_prefill_s": t_pre,
        "generated_tokens": gen,
        "generation_tps": dec_tokens / t_dec if t_dec > 0 else 0.0,
        "time_decode_s": t_dec,
        **split,
        "rounds": len(taus),
        "draft_rounds": sum(r.draft_rounds for r in runs),
        "mean_tau": sum(taus) / len(taus) if taus else 0.0,
        "mean_tau_per_response": sum(per_response) / len(per_response) if per_response else 0.0,
        "tau_histogram": {str(k): v for k, v in sorted(Counter(taus).items())},
        "per_prompt": [
            {
                "prompt_tokens": r.prompt_tokens,
                "generated_tokens": len(r.tokens),
                "generation_tps": (len(r.tokens) - 1) / r.t_decode if r.t_decode > 0 else 0.0,
                "mean_tau": sum(r.taus) / len(r.taus) if r.taus else 0.0,
            }
            for r in runs
        ],
    }


def check_identical(outputs: dict[str, list[dict[str, list[int]]]], greedy: bool = True) -> dict:
    """Compare every method's tokens with the first method's, prompt by prompt.

    outputs: dataset -> one {method label: tokens} per prompt. Sampled outputs legitimately
    differ, so the check only applies to greedy runs.
    """
    if not greedy:
        return {"checked": False, "identical": None, "reason": "sampling (temperature > 0)"}
    mismatches, compared, reference = [], 0, None
    for dataset, prompts in outputs.items():
        for i, by_method in enumerate(prompts):
            labels = list(by_method)
            reference = reference or labels[0]
            ref = by_method[labels[0]]
            for label in labels[1:]:
                got = by_method[label]
                compared += 1
                if got == ref:
                    continue
                pos = next(
                    (k for k, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b),
                    min(len(ref), len(got)),
                )
                mismatches.append(
                    {
                        "dataset": dataset,
                        "prompt": i,
                        "method": label,
                        "reference": labels[0],
                        "position": pos,
                        "expected": ref[pos] if pos < len(ref) else None,
                        "got": got[pos] if pos < len(got) else None,
                        "lengths": [len(ref), len(got)],
                    }
                )
    return {
        "checked": True,
        "identical": not mismatches,
        "reference": reference,
        "comparisons": compared,
        "mismatches": mismatches,
    }


def _speedups(rows: list[dict[str, Any]]) -> str | None:
    """Fill `speedup` against mlx-lm (else our ar) per dataset; returns the baseline used."""
    methods = {r["method"] for r in rows}
    base = "mlx-lm" if "mlx-lm" in methods else "ar" if "ar" in methods else None
    by_ds = {r["dataset"]: r for r in rows if r["method"] == base}
    for r in rows:
        b = by_ds.get(r["dataset"])
        ok = b is not None and b["generation_tps"] > 0
        r["speedup"] = r["generation_tps"] / b["generation_tps"] if ok else None
    return base


def _environment() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    import mlx.core as mx

    from . import __version__, _blas

    env = {"dflash_mlx": __version__, "python": platform.python_version()}
    for pkg in ("mlx", "mlx-lm"):
        try:
            env[pkg] = version(pkg)
        except PackageNotFoundError:
            env[pkg] = None
    env["machine"] = f"{platform.system()} {platform.machine()}"
    env["device"] = str(mx.default_device())
    env["blas"] = _blas.loaded_blas
    return env


# --------------------------------------------------------------------------------------------
# The benchmark


def run_bench(
    model: str | None = None,
    drafter: str | None = None,
    methods: str | list[str] = DEFAULT_METHODS,
    datasets: str | list[str] = "gsm8k",
    data_dir: str | Path | None = None,
    limit: int | None = 10,
    max_tokens: int = 256,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = 0,
    block_size: int | None = None,
    chat_template: bool | None = None,
    system: str | None = None,
    progress=None,
) -> dict[str, Any]:
    """Run every method on every prompt of every dataset; return the results as a dict.

    `progress(total)` may return `update(description, advance)`, called as the runs go.
    """
    meths = parse_methods(methods)
    names = [d.strip() for d in ([datasets] if isinstance(datasets, str) else datasets)]
    names = [n for x in names for n in x.split(",") if n.strip()]
    if not names:
        raise DFlashError("--dataset names no dataset.")
    prompt_sets = {n: load_prompts(n, data_dir, limit) for n in names}
    needs_drafter = any(m.mode in ("dflash", "ddtree") for m in meths)
    target, runner = load_pair(model, drafter, "dflash" if needs_drafter else "ar")
    tok = target.tokenizer
    encoded = {
        n: [encode_prompt(tok, p, chat_template, system) for p in ps]
        for n, ps in prompt_sets.items()
    }
    cfg = GenerationConfig(
        max_tokens=max_tokens,
        sampling=SamplingParams(temp, top_p, top_k),
        seed=seed,
        block_size=block_size,
        stop_ids=stop_ids(tok),
    )

    total = sum(len(v) for v in encoded.values()) * len(meths)
    update = progress(total) if progress else None
    # Warm-up: compile paths, allocate caches, measure the DDTree auto profile, off the clock.
    first = next(iter(encoded.values()))[0]
    warm = GenerationConfig(**{**vars(cfg), "max_tokens": min(max_tokens, WARMUP_TOKENS)})
    for m in meths:
        if update:
            update(f"warming up {m.label}", 0)
        run_method(m, target, runner, first, warm)
    runs: dict[str, dict[str, list[Run]]] = {n: {m.label: [] for m in meths} for n in encoded}
    outputs: dict[str, list[dict[str, list[int]]]] = {n: [] for n in encoded}
    for name, prompts in encoded.items():
        for i, ids in enumerate(prompts):
            outputs[name].append({})
            for m in meths:
                run = run_method(m, target, runner, ids, cfg)
                runs[name][m.label].append(run)
                outputs[name][i][m.label] = run.tokens
                if update:
                    update(f"{name} {i + 1}/{len(prompts)} {m.label}", 1)

    rows = [
        {"dataset": n, "method": m.label, **summarize(runs[n][m.label])}
        for n in encoded
        for m in meths
    ]
    baseline = _speedups(rows)
    return {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "model": model or "stories260K (embedded)",
        "drafter": drafter,
        "settings": {
            "methods": [m.label for m in meths],
            "datasets": names,
            "limit": limit,
            "max_tokens": max_tokens,
            "temp": temp,
            "top_p": top_p,
            "top_k": top_k,
            "seed": seed,
            "block_size": block_size,
            "chat_template": bool(getattr(tok, "chat_template", None))
            if chat_template is None
            else chat_template,
            "system": system,
        },
        "environment": _environment(),
        "baseline": baseline,
        "results": rows,
        "identical": check_identical(outputs, greedy=temp <= 0),
    }


# --------------------------------------------------------------------------------------------
# Reporting


def write_plot(results: dict[str, Any], path: Path) -> Path | None:
    """Speedup and mean tau per method, grouped by dataset; None when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = results["results"]
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cell = {(r["dataset"], r["method"]): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(datasets) + 6), 4.2))
    width = 0.8 / len(methods)
    for ax, key, title in (
        (axes[0], "speedup", f"speedup over {results.get('baseline') or 'baseline'}"),
        (axes[1], "mean_tau", "mean acceptance length (tau)"),
    ):
        for j, m in enumerate(methods):
            vals = [cell[(d, m)].get(key) or 0.0 for d in datasets]
            xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(datasets))]
            bars = ax.bar(xs, vals, width, label=m)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.set_xticks(range(len(datasets)), datasets)
        ax.set_title(title)
        if key == "speedup":
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"dflash-mlx bench: {results['model']}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _pct(part: float | None, total: float) -> str:
    return "-" if part is None or total <= 0 else f"{100 * part / total:.0f}"


def print_report(results: dict[str, Any], console) -> None:
    from rich.table import Table

    table = Table(
        title=f"dflash-mlx bench: {results['model']}",
        caption="tok/s: decoding only; d/v/o: share of decode time drafting/verifying/other",
    )
    for col in ("dataset", "method", "tok/s", "speedup", "tau", "tau histogram", "d/v/o %"):
        left = col in ("dataset", "method", "tau histogram")
        table.add_column(col, justify="left" if left else "right", no_wrap=col != "tau histogram")
    table.add_column("prompt tok/s", justify="right")
    for r in results["results"]:
        dec = r["time_decode_s"]
        split = "/".join(_pct(r[f"time_{p}_s"], dec) for p in ("draft", "verify", "other"))
        hist = " ".join(f"{k}:{v}" for k, v in r["tau_histogram"].items())
        table.add_row(
            r["dataset"],
            r["method"],
            f"{r['generation_tps']:.1f}",
            "-" if r["speedup"] is None else f"{r['speedup']:.2f}x",
            f"{r['mean_tau']:.2f}",
            hist if len(hist) <= 40 else hist[:37] + "...",
            split,
            f"{r['prompt_tps']:.0f}",
        )
    console.print(table)
    ident = results["identical"]
    if not ident["checked"]:
        console.print(f"Output identity not checked: {ident['reason']}.")
    elif ident["identical"]:
        console.print(
            f"[green]Greedy outputs are token-identical across all methods "
            f"({ident['comparisons']} comparisons against {ident['reference']}).[/]"
        )
    else:
        mm = ident["mismatches"]
        console.print(
            f"[bold white on red] MISMATCH [/] [bold red]greedy outputs differ in {len(mm)} of "
            f"{ident['comparisons']} comparisons against {ident['reference']}:[/]"
        )
        for x in mm[:10]:
            console.print(
                f"[red]  {x['dataset']} prompt {x['prompt']}: {x['method']} differs at token "
                f"{x['position']} (expected {x['expected']}, got {x['got']}; lengths "
                f"{x['lengths'][0]} vs {x['lengths'][1]})[/]"
            )
        if len(mm) > 10:
            console.print(f"[red]  ... and {len(mm) - 10} more (see the JSON file)[/]")
        console.print(
            "[red]Lossless decoding must reproduce the target's greedy output; in float32 this "
            "is a bug. In bf16/quantized targets, near-tied logits can flip between a "
            "multi-token verify and a one-token step.[/]"
        )


def _bar_progress(console):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )


def bench_command(
    model: str = typer.Option(
        None, "--model", "-m", help="Target folder or hub id (default: embedded stories260K)."
    ),
    drafter: str = typer.Option(None, "--drafter", "-d", help="DFlash drafter folder or hub id."),
    methods: str = typer.Option(
        DEFAULT_METHODS, "--methods", help="Comma list: mlx-lm, ar, dflash, ddtree:BUDGET|auto."
    ),
    dataset: list[str] = typer.Option(
        ["gsm8k"],
        "--dataset",
        help="humaneval | gsm8k | math500 | mbpp | mt-bench | FILE.jsonl (repeat or comma list).",
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
    out: Path = typer.Option(
        None, "--out", "-o", help="JSON results (default: bench-results/bench-<timestamp>.json)."
    ),
    plot: bool = typer.Option(True, "--plot/--no-plot", help="Also write a PNG next to the JSON."),
) -> None:
    """Benchmark mlx-lm, AR, DFlash and DDTree side by side; writes JSON and a PNG plot."""
    from rich.console import Console

    # Logs and pipes get the whole table rather than columns squeezed to 80 characters.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    err = Console(stderr=True)
    if out is None:
        out = Path("bench-results") / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    with _bar_progress(err) as bar:

        def progress(total):
            task = bar.add_task("loading", total=total)
            return lambda desc, n: bar.update(task, advance=n, description=desc)

        results = run_bench(
            model=model,
            drafter=drafter,
            methods=methods,
            datasets=dataset,
            data_dir=data_dir,
            limit=limit,
            max_tokens=max_tokens,
            temp=temp,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            block_size=block_size,
            chat_template=chat_template,
            system=system,
            progress=progress,
        )
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
    if results["identical"]["checked"] and not results["identical"]["identical"]:
        raise typer.Exit(1)
