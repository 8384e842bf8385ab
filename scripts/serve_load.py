"""Several clients at once against `dflash-mlx serve` (batched and one at a time) and
`mlx_lm.server`, side by side in one run (issue 34's load benchmark).

Each server is started on the same model as a subprocess with the same OpenBLAS this project
loads (mlx-lm's server too: it is started through mlx_dflash's BLAS loader, or the comparison
would measure BLAS, not batching). For each client count C, C clients each send `--rounds`
streamed chat requests back to back (prompts from a shipped set), and the script reports:
aggregate completion tokens/s, per-request tokens/s (its tokens over its own wall time),
p50 / p95 time to first token counted from when the request was sent, and our servers' tau
(their /metrics histogram). JSON to --out, a plot to --plot.

    .venv/bin/python scripts/serve_load.py -m models/smollm2-135m-instruct-f32 \\
        --clients 1,2,4,8 --out runs/serve-load.json --plot docs/img/serve-load.png
"""

# isort: skip_file
from __future__ import annotations

import argparse
import json
import os
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import mlx_dflash  # noqa: F401  (first: OpenBLAS before mlx)
from mlx_dflash.benchmark import servers
from mlx_dflash.benchmark.datasets import load_prompts

MODEL_ID: dict[str, str] = {}  # the id each server serves


def start(kind: str, args) -> tuple[subprocess.Popen, str]:
    extra = []
    if kind != "mlx-lm":
        extra = ["--mode", args.mode, "--budget", args.budget,
                 "--max-batch", "1" if kind == "single" else str(args.max_batch)]  # fmt: skip
        extra += ["-d", args.drafter] if args.drafter else []
    server = servers.start(kind, args.model, extra)
    MODEL_ID[server.url] = server.model
    return server.proc, server.url


def ask(url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed chat request: time to first token, tokens, wall time."""
    body = {"model": MODEL_ID.get(url, "default"), "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    req = urllib.request.Request(
        url + "/v1/chat/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    t0 = time.perf_counter()
    first, pieces, usage = None, 0, None
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            try:
                chunk = json.loads(line[6:])
            except json.JSONDecodeError:  # (a keep-alive or a partial line)
                continue
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                if c.get("delta", {}).get("content"):
                    first = first or time.perf_counter()
                    pieces += 1
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else pieces
    return {"ttft": (first or end) - t0, "tokens": tokens, "seconds": end - t0}


def tau_totals(url: str) -> tuple[float, float]:
    """(sum, count) of our servers' acceptance-length histogram; (0, 0) elsewhere."""
    try:
        text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    except OSError:
        return 0.0, 0.0
    vals = {}
    for line in text.splitlines():
        for key in ("dflash_acceptance_length_sum", "dflash_acceptance_length_count"):
            if line.startswith(key + " "):
                vals[key] = float(line.split()[1])
    return vals.get("dflash_acceptance_length_sum", 0.0), vals.get(
        "dflash_acceptance_length_count", 0.0
    )


def load(url: str, clients: int, prompts: list[str], rounds: int, max_tokens: int) -> dict:
    results: list[dict] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for k in range(rounds):
            r = ask(url, prompts[(c * rounds + k) % len(prompts)], max_tokens)
            with lock:
                results.append(r)

    s0, n0 = tau_totals(url)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    s1, n1 = tau_totals(url)
    ttft = sorted(r["ttft"] for r in results)
    pct = lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))]  # noqa: E731
    return {
        "clients": clients,
        "requests": len(results),
        "aggregate_tps": sum(r["tokens"] for r in results) / wall,
        "request_tps": sum(r["tokens"] / r["seconds"] for r in results) / len(results),
        "ttft_p50": pct(0.5),
        "ttft_p95": pct(0.95),
        "tau": (s1 - s0) / (n1 - n0) if n1 > n0 else None,
    }


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for kind, rows in report["servers"].items():
        xs = [r["clients"] for r in rows]
        a.plot(xs, [r["aggregate_tps"] for r in rows], marker="o", label=kind)
        b.plot(xs, [r["ttft_p95"] for r in rows], marker="o", label=kind)
    a.set(xlabel="concurrent clients", ylabel="aggregate tokens/s", title="throughput")
    b.set(xlabel="concurrent clients", ylabel="seconds", title="p95 time to first token")
    for ax in (a, b):
        ax.set_xticks(xs)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{Path(report['model']).name}, {report['max_tokens']}-token greedy answers")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-d", "--drafter", default=None)
    ap.add_argument("--mode", default="ddtree")
    ap.add_argument("--budget", default="auto")
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=2, help="requests per client, back to back")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--servers", default="batched,single,mlx-lm")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    prompts = load_prompts(args.dataset)
    counts = [int(c) for c in args.clients.split(",")]
    report: dict = {"model": args.model, "mode": args.mode, "budget": args.budget,
                    "max_batch": args.max_batch, "max_tokens": args.max_tokens,
                    "threads": os.environ.get("OPENBLAS_NUM_THREADS"), "servers": {}}  # fmt: skip
    for kind in args.servers.split(","):
        proc, url = start(kind, args)
        try:
            ask(url, prompts[0], 8)  # warm-up (and the auto budget's calibration)
            rows = []
            for c in counts:
                rows.append(load(url, c, prompts, args.rounds, args.max_tokens))
                r = rows[-1]
                tau = "" if r["tau"] is None else f"  tau {r['tau']:.2f}"
                print(f"{kind:8s} {c} clients: {r['aggregate_tps']:6.1f} tok/s aggregate, "
                      f"{r['request_tps']:5.1f} per request, TTFT p50 {r['ttft_p50']:.2f} s "
                      f"p95 {r['ttft_p95']:.2f} s{tau}", flush=True)  # fmt: skip
            report["servers"][kind] = rows
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(report, args.plot)


if __name__ == "__main__":
    main()
