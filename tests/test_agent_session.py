"""scripts/agent_session.py's shipped sessions and its bookkeeping, offline (the replay itself
needs a tool-capable model and two servers: README, "An agent's session")."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def script():
    spec = importlib.util.spec_from_file_location(
        "agent_session", ROOT / "scripts" / "agent_session.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_shipped_sessions_carry_tools_tool_results_and_edit_requests():
    mod = script()
    data = json.loads(mod.SESSIONS.read_text())["sessions"]
    assert len(data) >= 2
    for s in data:
        messages = mod.opening(s, mod.SESSIONS.parent)
        roles = [m["role"] for m in messages]
        assert roles[:2] == ["system", "user"] and "tool" in roles
        calls = [c["id"] for m in messages if m["role"] == "assistant" for c in m["tool_calls"]]
        results = [m["tool_call_id"] for m in messages if m["role"] == "tool"]
        assert calls == results  # every tool call answered, in order
        assert all(len(m["content"]) > 500 for m in messages if m["role"] == "tool")
        assert {t["function"]["name"] for t in s["tools"]} >= {"read_file"}
        assert len(s["requests"]) >= 3 and all(isinstance(r, str) for r in s["requests"])


def test_the_comparison_reports_ratio_and_identity():
    mod = script()
    turn = {"text": "a", "tool_calls": [], "seconds": 2.0, "ttft": 0.5, "tokens": 10,
            "prompt_tokens": 100}  # fmt: skip
    other = {**turn, "seconds": 4.0}
    report = {"servers": {"dflash-mlx": {"s": [turn, turn]}, "mlx-lm": {"s": [other, other]}}}
    summary = mod.compare(report)
    assert summary["ratio"] == 0.5 and summary["identical"]
    report["servers"]["mlx-lm"]["s"][1] = {**other, "text": "b"}
    summary = mod.compare(report)
    assert not summary["identical"] and [r["identical"] for r in summary["turns"]] == [True, False]
