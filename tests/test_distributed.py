"""A target sharded over two processes (mx.distributed, ring backend on loopback, started by
`mlx.launch` as users start it): token for token what one process produces, for DFlash and
DDTree (fixed and auto budgets) on llama, qwen3, qwen3_5 (nested config, vocabulary-sharded
head) and kimi_k25 (MLA + MoE); `generate` prints once with world_size; a killed rank stops the
others with one sentence."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from published import write_published

from mlx_dflash.models.target import load_target
from mlx_dflash.models.tiny import write_tiny_target

LAUNCH = Path(sys.executable).parent / "mlx.launch"
pytestmark = pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")
PROMPT = list(range(3, 43))
N = 40
RUNS = {
    "dflash": {"mode": "dflash"},
    "sampled_dflash": {"mode": "dflash", "temperature": 1.0, "seed": 3},
    "sampled_ddtree": {"mode": "ddtree", "budget": 4, "temperature": 1.0, "seed": 3},
    "ddtree": {"mode": "ddtree", "budget": 6},
    "ddtree_auto": {"mode": "ddtree", "budget": "auto"},
}


def launch(*args, env=None, timeout=240):
    cmd = [str(LAUNCH), "--backend", "ring", "-n", "2", "--", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def kimi_folder(path: Path) -> Path:
    from test_mla import CONFIGS, build, clear_of_ties, save_folder

    from mlx_dflash.models.target import Target

    cfg = CONFIGS["kimi_k25"]
    # Clear of MoE routing ties (see tests/test_mla.py), with room for the ranks' summation.
    target, _ = clear_of_ties(lambda seed: Target(build(cfg, seed), None, cfg), N, margin=1e-2)
    return save_folder(path, target.model, cfg)


def run_worker(tmp_path, folder, truth, runs, max_tokens=N, env=None, timeout=240):
    """tests/dist_worker.py on two ranks; (launch result, rank 0's and rank 1's outputs)."""
    spec = {
        "model": str(folder),
        "prompt": PROMPT,
        "truth": truth,
        "max_tokens": max_tokens,
        "runs": runs,
        "out": str(tmp_path / "out.json"),
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    worker = Path(__file__).parent / "dist_worker.py"
    r = launch(sys.executable, str(worker), str(tmp_path / "spec.json"), env=env, timeout=timeout)
    outs = [tmp_path / "out.json", tmp_path / "out.json.rank1"]
    got = [json.loads(p.read_text()) if p.exists() else None for p in outs]
    return r, got[0], got[1]


def check_two_ranks(folder, tmp_path, env=None):
    """Every run on two ranks: greedy ones equal mlx-lm's one-process decoding, and (sampling
    included) rank 1 emitted what rank 0 did. Returns rank 0's outputs."""
    from test_engine import mlx_lm_greedy

    ref = mlx_lm_greedy(load_target(folder), PROMPT, N)
    r, got, other = run_worker(tmp_path, folder, PROMPT + ref, RUNS, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    for name in RUNS:
        if not name.startswith("sampled"):
            assert got[name]["tokens"] == ref, name
        assert other[name]["tokens"] == got[name]["tokens"], name
    return got, ref


FIXTURES = {
    "llama": lambda p: write_published(p, "meta-llama/Llama-3.1-8B-Instruct", "hf"),
    "qwen3": lambda p: write_published(p, "Qwen/Qwen3-8B", "hf"),
    "qwen3_5": lambda p: write_published(p, "Qwen/Qwen3.5-9B", "hf"),
    "kimi_k25": kimi_folder,
}


@pytest.mark.parametrize("family", sorted(FIXTURES))
def test_two_ranks_match_one_process(family, tmp_path):
    got, _ = check_two_ranks(FIXTURES[family](tmp_path / family), tmp_path)
    assert max(got["dflash"]["taus"]) > 2  # drafts were accepted: trims happened on both ranks
    assert got["_comm"]["broadcasts"] > 0 and got["_parallel"] == "tensor"


def test_generate_prints_once_with_world_size(tmp_path, run_cli):
    folder = write_published(tmp_path / "llama", "meta-llama/Llama-3.1-8B-Instruct", "hf")
    args = ["generate", "-m", str(folder), "--mode", "ar", "-p", "Hello", "-n", "12", "--json"]
    code, out, err = run_cli(*args)
    assert code == 0, err
    one = json.loads(out)
    r = launch(str(Path(sys.executable).parent / "dflash-mlx"), *args)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 1 prints nothing
    two = json.loads(lines[0])
    assert two["text"] == one["text"] and two["world_size"] == 2 and one["world_size"] == 1


def test_killed_rank_stops_the_others_with_one_sentence(tmp_path):
    folder = write_published(tmp_path / "llama", "meta-llama/Llama-3.1-8B-Instruct", "hf")
    r, got, _ = run_worker(
        tmp_path,
        folder,
        PROMPT,
        {"dflash": {"mode": "dflash"}},
        max_tokens=400,
        env={"DFLASH_TEST_DIE_AFTER": "3", "DFLASH_MLX_DIST_TIMEOUT": "10"},
        timeout=120,
    )
    log = r.stderr + r.stdout
    # mlx.launch stops the survivors when a rank exits with an error; a rank killed outright
    # leaves rank 0 blocked in an all-reduce, which the watchdog ends. One sentence either way
    # (mlx.launch's own exit status does not say).
    assert "error: rank 0 of 2: another rank stop" in log, log
    assert "Traceback" not in log
    assert got is None  # rank 0 never finished


def test_watchdog_ends_a_hang(monkeypatch):
    from mlx_dflash import distributed

    died = []
    monkeypatch.setattr(distributed.os, "_exit", lambda code: died.append(code))
    world = distributed.World(group=None, rank=0, size=2, timeout=0.2)
    world._beat -= 1.0  # no progress for a second
    import time

    monkeypatch.setattr(distributed.signal, "signal", lambda *a: None)
    monkeypatch.setattr(distributed.sys, "excepthook", distributed.sys.excepthook)
    distributed._install_failure_handling(world)
    deadline = time.time() + 5
    while not died and time.time() < deadline:
        time.sleep(0.05)
    assert died == [1]  # once: the watchdog stops after firing


def test_a_lost_peer_raised_as_an_error_ends_in_the_sentence(monkeypatch, capsys):
    """MLX's ring backend may raise at whichever evaluation waits on a dead rank, before
    mlx.launch's SIGTERM: the same sentence, no traceback; other errors keep theirs."""
    import sys

    from mlx_dflash import distributed

    died, passed = [], []
    monkeypatch.setattr(distributed.os, "_exit", lambda code: died.append(code))
    monkeypatch.setattr(distributed.signal, "signal", lambda *a: None)
    monkeypatch.setattr(
        distributed.threading, "Thread", lambda **kw: type("T", (), {"start": lambda self: None})()
    )
    monkeypatch.setattr(sys, "excepthook", lambda *a: passed.append(a[0]))
    distributed._install_failure_handling(distributed.World(None, 0, 2, timeout=60))
    sys.excepthook(RuntimeError, RuntimeError("[ring] connection to a peer was lost"), None)
    assert died == [1] and passed == []
    assert "error: rank 0 of 2: another rank stopped" in capsys.readouterr().err
    sys.excepthook(RuntimeError, RuntimeError("[metal] out of memory"), None)
    sys.excepthook(ValueError, ValueError("[ring] not this one"), None)
    assert died == [1] and passed == [RuntimeError, ValueError]


def test_chat_runs_sharded_with_rank_0_doing_the_io(tmp_path):
    """Scripted chat under mlx.launch: rank 0 reads the lines and prints; the answers equal a
    one-process chat's, and commands reach every rank (the /reset turn answers afresh)."""
    folder = write_published(tmp_path / "qwen3", "Qwen/Qwen3-8B", "hf")
    script = "Hello there\nTell me more\n/reset\nHello there\n/exit\n"
    exe = str(Path(sys.executable).parent / "dflash-mlx")
    args = ["chat", "-m", str(folder), "--mode", "ar", "-n", "8"]
    one = subprocess.run([exe, *args], input=script, capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr
    cmd = [str(LAUNCH), "--backend", "ring", "-n", "2", "--", exe, *args]
    two = subprocess.run(cmd, input=script, capture_output=True, text=True, timeout=240)
    answers = [line for line in one.stdout.splitlines() if line.strip()]
    assert [line for line in two.stdout.splitlines() if line.strip()] == answers
    assert answers[0] == answers[-1]  # after /reset, the same first turn again


def test_serve_runs_sharded(tmp_path, run_cli):
    """serve under mlx.launch: rank 0 answers HTTP, the other rank follows every job; answers
    equal one process's generate, streamed or not, and it shuts down on Ctrl-C."""
    import signal
    import socket
    import time
    import urllib.request

    openai = pytest.importorskip("openai")
    folder = write_published(tmp_path / "qwen3", "Qwen/Qwen3-8B", "hf")
    code, out, err = run_cli(
        "generate", "-m", str(folder), "--mode", "ar", "-p", "Hello", "-n", "10", "--json"
    )
    assert code == 0, err
    want = json.loads(out)["text"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = str(Path(sys.executable).parent / "dflash-mlx")
    cmd = [str(LAUNCH), "--backend", "ring", "-n", "2", "--", exe, "serve", "-m", str(folder)]
    proc = subprocess.Popen(
        [*cmd, "--mode", "ar", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "Hello"}]
        for _ in range(2):  # the second one reuses both ranks' cached prefix
            r = client.chat.completions.create(model="qwen3", messages=msgs, max_tokens=10)
            assert r.choices[0].message.content == want
        parts = client.chat.completions.create(
            model="qwen3", messages=msgs, max_tokens=10, stream=True
        )
        assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == want
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            log, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
    # (mlx.launch itself prints a KeyboardInterrupt traceback on Ctrl-C; none may be ours.)
    assert "mlx_dflash" not in log, log


def test_a_job_reaches_the_follower_ranks_whole():
    """What rank 0 sends a follower is the whole job: every setting a request makes (grammar and
    logprobs included: they change which forwards a round makes) and every field beside them."""
    from mlx_dflash.engine import GenerationConfig, SamplingParams
    from mlx_dflash.engine.grammar import GrammarSpec
    from mlx_dflash.server.tools import Tools
    from mlx_dflash.server.worker import REQUEST_SETTINGS, Job, job_from_json, job_to_json

    base = GenerationConfig(mode="lookup", max_tokens=64)
    request = {"max_tokens": 9, "sampling": SamplingParams(0.7, 0.9, 20), "seed": 5,
               "logprobs": 3, "grammar": GrammarSpec.json_schema({"type": "object"})}  # fmt: skip
    assert set(request) == set(REQUEST_SETTINGS)
    tools = Tools([{"type": "function", "function": {"name": "f"}}], "function", "f", False)
    job = Job([1, 2, 3], dataclasses.replace(base, **request), ["END"], True, ("<a>", "</a>"),
              tools, '{"x": ')  # fmt: skip
    copy = job_from_json(base, job_to_json(job))
    assert copy.cfg == job.cfg
    fields = ("prompt", "stop", "thinking", "tags", "tools", "inside")
    assert [getattr(copy, f) for f in fields] == [getattr(job, f) for f in fields]


@pytest.mark.parametrize("mode", ["dflash", "lookup"])
def test_serve_sharded_answers_a_format_with_logprobs(tmp_path, run_cli, mode):
    """response_format and logprobs under a speculative mode on two ranks: the follower runs
    the same constrained rounds as rank 0 (it once ran free text, whose forwards differ), and
    the answer is one process's."""
    import socket
    import time
    import urllib.request

    openai = pytest.importorskip("openai")
    from published import write_published_drafter

    folder = write_published(tmp_path / "qwen3", "Qwen/Qwen3-8B", "hf")
    pair = ["-m", str(folder), "--mode", mode]
    if mode == "dflash":
        pair += ["-d", str(write_published_drafter(tmp_path / "drafter", "Qwen/Qwen3-8B"))]
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    code, out, err = run_cli("generate", *pair, "-p", "Hello", "-n", "16", "--json-schema",
                             str(tmp_path / "schema.json"), "--json")  # fmt: skip
    assert code == 0, err
    want = json.loads(out)["text"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = str(Path(sys.executable).parent / "dflash-mlx")
    cmd = [str(LAUNCH), "--backend", "ring", "-n", "2", "--", exe, "serve", *pair]
    proc = subprocess.Popen([*cmd, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0, timeout=60)  # fmt: skip
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        r = client.chat.completions.create(
            model="qwen3", messages=[{"role": "user", "content": "Hello"}], max_tokens=16,
            response_format=fmt, logprobs=True, top_logprobs=2,
        )  # fmt: skip
        assert r.choices[0].message.content == want
        assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            log, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
    assert "mlx_dflash" not in log, log


PIPELINE = {
    # mlx-lm cannot shard Qwen3-Next: the ranks split its layers instead (automatic).
    "qwen3_next": (lambda p: write_tiny_target(p, "qwen3_next"), {}),
    # Any target on request.
    "llama": (
        lambda p: write_published(p, "meta-llama/Llama-3.1-8B-Instruct", "hf"),
        {"DFLASH_MLX_PARALLEL": "pipeline"},
    ),
}


@pytest.mark.parametrize("family", sorted(PIPELINE))
def test_pipeline_stages_match_one_process(family, tmp_path):
    write, env = PIPELINE[family]
    got, ref = check_two_ranks(write(tmp_path / family), tmp_path, env)
    assert len(set(ref)) > 3
    assert got["_parallel"] == "pipeline"
