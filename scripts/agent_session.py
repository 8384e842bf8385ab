"""Agent sessions replayed through the real `openai` client against `dflash-mlx serve` (with its
defaults, or the flags you pass) and `mlx_lm.server`, on the same model, greedy: what a coding
agent's user waits for (issue 47's benchmark).

A session (mlx_dflash/benchmark/data/agent/sessions.json, or your own with --sessions) carries
tool definitions, a user's request, the assistant's tool calls and their results (a source
file, a failing test run) as an agent's transcript holds them, then requests: an explanation,
a fix, a diff, tests, the whole file back. Every turn sends the whole history, the
server's own earlier answers included, as agents send it. Per turn: seconds, time to first
token, completion tokens; then the totals, the ratio, and whether every answer is identical.

    .venv/bin/python scripts/agent_session.py -m models/qwen2.5-coder-0.5b-instruct-f32 \\
        --out runs/agent.json --plot docs/img/agent-session.png
    .venv/bin/python scripts/agent_session.py -m ... --serve-args "--mode dflash"  # the chain

Both servers use the same OpenBLAS (mlx_dflash/benchmark/servers.py) and run one after the
other on an otherwise idle machine.
"""

# isort: skip_file
from __future__ import annotations

import argparse
import json
import shlex
import time
from pathlib import Path

import mlx_dflash  # noqa: F401  (first: OpenBLAS before mlx)
from mlx_dflash.benchmark import servers

SESSIONS = Path(mlx_dflash.__file__).parent / "benchmark" / "data" / "agent" / "sessions.json"


def opening(session: dict, folder: Path) -> list[dict]:
    """The messages before the first answer: system, the user's request, each tool call as an
    assistant message and its result as a tool message."""
    messages = [{"role": "system", "content": session["system"]}]
    for i, item in enumerate(session["history"]):
        if "tool_call" not in item:
            messages.append(item)
            continue
        call = item["tool_call"]
        call_id = f"call_{i}"
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]})  # fmt: skip
        result = (folder / item["result_file"]).read_text()
        messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
    return messages


def turn(client, model: str, messages: list[dict], tools: list, max_tokens: int) -> dict:
    """One streamed request: its answer (text and tool calls), seconds, time to first token,
    prompt and completion tokens."""
    t0 = time.perf_counter()
    first, text, calls, usage = None, [], {}, None
    stream = client.chat.completions.create(
        model=model, messages=messages, tools=tools, temperature=0.0, max_tokens=max_tokens,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content or delta.tool_calls:
                first = first or time.perf_counter()
            if delta.content:
                text.append(delta.content)
            for tc in delta.tool_calls or []:
                slot = calls.setdefault(tc.index or 0, {"name": "", "arguments": ""})
                if tc.function is not None:
                    slot["name"] += tc.function.name or ""
                    slot["arguments"] += tc.function.arguments or ""
    end = time.perf_counter()
    return {
        "text": "".join(text),
        "tool_calls": [calls[k] for k in sorted(calls)],
        "seconds": end - t0,
        "ttft": (first or end) - t0,
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "tokens": usage.completion_tokens if usage else None,
    }


def replay(server: servers.Server, sessions: list[dict], folder: Path, max_tokens: int) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url, api_key="none", timeout=3600)
    # Warm-up, off the clock: first-call work (and our auto budget's verify profile).
    turn(client, server.model, [{"role": "user", "content": "Hello"}], [], 8)
    out = {}
    for s in sessions:
        messages, turns = opening(s, folder), []
        for k, request in enumerate(s["requests"]):
            if request is not None:
                messages.append({"role": "user", "content": request})
            t = turn(client, server.model, messages, s["tools"], max_tokens)
            turns.append(t)
            print(f"  {server.kind:10s} {s['name']} turn {k + 1}: {t['seconds']:6.1f} s, first "
                  f"token {t['ttft']:5.1f} s, {t['tokens']} tokens, prompt "
                  f"{t['prompt_tokens']}", flush=True)  # fmt: skip
            answer = {"role": "assistant", "content": t["text"]}
            if t["tool_calls"]:  # (the replay runs no tools: the call is answered as such)
                ids = [f"call_r{k}_{i}" for i in range(len(t["tool_calls"]))]
                answer["tool_calls"] = [{"id": i, "type": "function", "function": c}
                                        for i, c in zip(ids, t["tool_calls"], strict=True)]  # fmt: skip
                messages.append(answer)
                messages += [{"role": "tool", "tool_call_id": i,
                              "content": "(not run in this replay)"} for i in ids]  # fmt: skip
            else:
                messages.append(answer)
        out[s["name"]] = turns
    return out


def compare(report: dict) -> dict:
    """Per turn, each server's time against the first server's, and whether the answers are
    identical; the totals."""
    kinds = list(report["servers"])
    ours, ref = kinds[0], kinds[-1]
    rows, same = [], True
    for name, turns in report["servers"][ours].items():
        for k, t in enumerate(turns):
            r = report["servers"][ref][name][k]
            identical = (t["text"], t["tool_calls"]) == (r["text"], r["tool_calls"])
            same &= identical
            rows.append({"session": name, "turn": k + 1, "prompt_tokens": t["prompt_tokens"],
                         "tokens": t["tokens"], ours: t["seconds"], f"{ours} ttft": t["ttft"],
                         ref: r["seconds"], f"{ref} ttft": r["ttft"],
                         "ratio": t["seconds"] / r["seconds"], "identical": identical})  # fmt: skip
    total = {
        k: sum(t["seconds"] for ts in report["servers"][k].values() for t in ts) for k in kinds
    }
    return {"turns": rows, "total_s": total, "ratio": total[ours] / total[ref], "identical": same}


def print_table(summary: dict, ours: str, ref: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"agent sessions: {ours} against {ref}")
    for col in ("session", "turn", "prompt", "tokens", f"{ours} s", "first token",
                f"{ref} s", "first token", "ratio", "same"):  # fmt: skip
        table.add_column(col, justify="left" if col == "session" else "right")
    for r in summary["turns"]:
        table.add_row(r["session"], str(r["turn"]), str(r["prompt_tokens"]), str(r["tokens"]),
                      f"{r[ours]:.1f}", f"{r[f'{ours} ttft']:.1f}", f"{r[ref]:.1f}",
                      f"{r[f'{ref} ttft']:.1f}", f"{r['ratio']:.2f}",
                      "yes" if r["identical"] else "NO")  # fmt: skip
    console = Console(width=140)
    console.print(table)
    t = summary["total_s"]
    console.print(f"total: {ours} {t[ours]:.1f} s, {ref} {t[ref]:.1f} s: time ratio "
                  f"{summary['ratio']:.2f}; answers "
                  f"{'identical' if summary['identical'] else 'DIFFER'}")  # fmt: skip


def plot(report: dict, summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    kinds = list(report["servers"])
    rows = summary["turns"]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows) + 2), 4))
    w = 0.8 / len(kinds)
    for i, k in enumerate(kinds):
        secs = [r[k] for r in rows]
        ttft = [r[f"{k} ttft"] for r in rows]
        pos = x + (i - (len(kinds) - 1) / 2) * w
        ax.bar(pos, secs, w, label=k)
        ax.bar(pos, ttft, w, fill=False, hatch="//", edgecolor="black", linewidth=0.5)
    ax.set_xticks(x, [f"{r['session']}\nturn {r['turn']}" for r in rows], fontsize=8)
    ax.set_ylabel("seconds (hatched: to first token)")
    ax.set_title(f"{Path(report['model']).name}: {report['max_tokens']} tokens a turn, greedy\n"
                 f"total time against {kinds[-1]}: {summary['ratio']:.2f}", fontsize=10)  # fmt: skip
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--serve-args", default="", help="extra flags for `dflash-mlx serve`")
    ap.add_argument(
        "--sessions", default=str(SESSIONS), help="a sessions.json (see the shipped one)"
    )
    ap.add_argument("--only", default=None, help="comma list of session names")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--servers", default="dflash-mlx,mlx-lm", help="ours first, the reference last")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    path = Path(args.sessions)
    sessions = json.loads(path.read_text())["sessions"]
    if args.only:
        sessions = [s for s in sessions if s["name"] in args.only.split(",")]
    report: dict = {"model": args.model, "max_tokens": args.max_tokens,
                    "serve_args": args.serve_args, "servers": {}}  # fmt: skip
    for kind in args.servers.split(","):
        extra = [] if kind == "mlx-lm" else shlex.split(args.serve_args)
        with servers.running(kind, args.model, extra) as server:
            if server.start_line:
                print(server.start_line, flush=True)
                report["start_line"] = server.start_line
            report["servers"][kind] = replay(server, sessions, path.parent, args.max_tokens)
    kinds = list(report["servers"])
    summary = compare(report)
    report["summary"] = summary
    print_table(summary, kinds[0], kinds[-1])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(report, summary, args.plot)


if __name__ == "__main__":
    main()
