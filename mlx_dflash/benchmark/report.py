"""Benchmark results: per-method aggregates, the token-identity check, the speedups, the
plot and the printed table."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .runner import Run


def summarize(runs: list[Run]) -> dict[str, Any]:
    """One method on one dataset: decode speed over all prompts, tau, time split."""
    gen = sum(len(r.tokens) for r in runs)
    dec_tokens = sum(max(len(r.tokens) - 1, 0) for r in runs)
    t_dec = sum(r.t_decode for r in runs)
    t_pre = sum(r.t_prefill for r in runs)
    taus = [t for r in runs for t in r.taus]
    per_response = [sum(r.taus) / len(r.taus) for r in runs if r.taus]
    split = {}
    for part in ("draft", "verify", "other", "build"):
        vals = [getattr(r, f"t_{part}") for r in runs]
        split[f"time_{part}_s"] = None if any(v is None for v in vals) else sum(vals)
    checked = [r.valid for r in runs if r.valid is not None]
    grammar = [r.t_grammar for r in runs if r.t_grammar is not None]
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
        "peak_memory_mb": max((r.peak_memory for r in runs), default=0) / 2**20,
        # structured output: answers complete and valid under their grammar, and its time
        "valid": sum(checked) / len(checked) if checked else None,
        "time_grammar_s": sum(grammar) if grammar else None,
        "grammar_pruned": sum(r.grammar[0] for r in runs),
        "grammar_drafts": sum(r.grammar[1] for r in runs),
        "grammar_drafts_accepted": sum(r.grammar[2] for r in runs),
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


def speedups(rows: list[dict[str, Any]]) -> str | None:
    """Fill `speedup` against mlx-lm (else our ar) per dataset; returns the baseline used."""
    methods = {r["method"] for r in rows}
    base = "mlx-lm" if "mlx-lm" in methods else "ar" if "ar" in methods else None
    by_ds = {r["dataset"]: r for r in rows if r["method"] == base}
    for r in rows:
        b = by_ds.get(r["dataset"])
        ok = b is not None and b["generation_tps"] > 0
        r["speedup"] = r["generation_tps"] / b["generation_tps"] if ok else None
    return base


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

    caption = "tok/s: decoding only; d/v/o: share of decode time drafting/verifying/other"
    if results["settings"].get("repeat", 1) > 1:
        caption += f"; each prompt's median of {results['settings']['repeat']} runs"
    table = Table(title=f"dflash-mlx bench: {results['model']}", caption=caption)
    for col in ("dataset", "method", "tok/s", "speedup", "tau", "tau histogram", "d/v/o %"):
        left = col in ("dataset", "method", "tau histogram")
        table.add_column(col, justify="left" if left else "right", no_wrap=col != "tau histogram")
    table.add_column("prompt tok/s", justify="right")
    table.add_column("peak MB", justify="right")
    structured = any(r.get("valid") is not None for r in results["results"])
    if structured:
        table.add_column("valid", justify="right")
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
            f"{r.get('peak_memory_mb', 0):.0f}",
            *(["-" if r["valid"] is None else f"{100 * r['valid']:.0f}%"] if structured else []),
        )
    console.print(table)
    chosen = results.get("default")
    if chosen:
        note = f" ({chosen['note']})" if chosen.get("note") else ""
        console.print(f"default = {chosen['ran']}{note}")
    if results["settings"].get("profile"):
        print_profile(results, console)
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


def print_profile(results: dict[str, Any], console) -> None:
    """bench --profile: where one round's time goes, in ms, next to one plain decoding step."""
    from rich.table import Table

    table = Table(
        title="Round profile (ms; phases synced one by one)",
        caption="Python: building MLX graphs, inside draft and verify; host: acceptance, "
        "cache commit and the tree; grammar: inside llguidance (masks, pruning, forced runs), "
        "part of the others; step: one plain decoding step",
    )
    cols = ("dataset", "method", "rounds", "draft", "verify", "host", "Python", "grammar", "total")
    for col in cols:
        table.add_column(col, justify="left" if col in ("dataset", "method") else "right")
    table.add_column("plain steps", justify="right")
    steps = {}
    for r in results["results"]:
        if r["method"] in ("mlx-lm", "ar") and r["generated_tokens"] > r["prompts"]:
            per = r["time_decode_s"] / (r["generated_tokens"] - r["prompts"])
            steps.setdefault(r["dataset"], per)  # mlx-lm's if it ran (it is listed first)
    for r in results["results"]:
        n = r["rounds"]
        if not n:
            continue
        step = steps.get(r["dataset"])
        total = r["time_decode_s"] / n
        times = (r.get(f"time_{p}_s") for p in ("draft", "verify", "other", "build", "grammar"))
        table.add_row(
            r["dataset"],
            r["method"],
            str(n),
            *("-" if t is None else f"{1000 * t / n:.2f}" for t in times),
            f"{1000 * total:.2f}",
            "-" if not step else f"{total / step:.2f}",
        )
    console.print(table)
