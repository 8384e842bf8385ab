"""A target sharded over two processes (mx.distributed, ring backend on loopback, started by
`mlx.launch` as users start it): token for token what one process produces, for DFlash and
DDTree (fixed and auto budgets) on llama, qwen3, qwen3_5 (nested config, vocabulary-sharded
head) and kimi_k25 (MLA + MoE); `generate` prints once with world_size; a killed rank stops the
others with one sentence."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from published import write_published

from mlx_dflash.models.target import load_target

LAUNCH = Path(sys.executable).parent / "mlx.launch"
pytestmark = pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")
PROMPT = list(range(3, 43))
N = 40
RUNS = {
    "dflash": {"mode": "dflash"},
    "ddtree": {"mode": "ddtree", "budget": 6},
    "ddtree_auto": {"mode": "ddtree", "budget": "auto"},
}


def launch(*args, env=None, timeout=240):
    cmd = [str(LAUNCH), "--backend", "ring", "-n", "2", "--", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def kimi_folder(path: Path) -> Path:
    from factories import write_tiny_tokenizer
    from mlx_lm.utils import save_config, save_model
    from test_engine import mlx_lm_greedy
    from test_mla import CONFIGS, build, router_margin

    from mlx_dflash.models.target import Target

    cfg = CONFIGS["kimi_k25"]
    for seed in range(20):  # clear of MoE routing ties (see tests/test_mla.py)
        model = build(cfg, seed)
        t = Target(model, None, cfg)
        if router_margin(t, PROMPT + mlx_lm_greedy(t, PROMPT, N), len(PROMPT)) > 1e-2:
            break
    save_model(path, model)
    save_config(cfg, path / "config.json")
    write_tiny_tokenizer(path, 256)
    return path


FIXTURES = {
    "llama": lambda p: write_published(p, "meta-llama/Llama-3.1-8B-Instruct", "hf"),
    "qwen3": lambda p: write_published(p, "Qwen/Qwen3-8B", "hf"),
    "qwen3_5": lambda p: write_published(p, "Qwen/Qwen3.5-9B", "hf"),
    "kimi_k25": kimi_folder,
}


@pytest.mark.parametrize("family", sorted(FIXTURES))
def test_two_ranks_match_one_process(family, tmp_path):
    from test_engine import mlx_lm_greedy

    folder = FIXTURES[family](tmp_path / family)
    target = load_target(folder)
    ref = mlx_lm_greedy(target, PROMPT, N)
    spec = {
        "model": str(folder),
        "prompt": PROMPT,
        "truth": PROMPT + ref,
        "max_tokens": N,
        "runs": RUNS,
        "out": str(tmp_path / "out.json"),
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    worker = Path(__file__).parent / "dist_worker.py"
    r = launch(sys.executable, str(worker), str(tmp_path / "spec.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads((tmp_path / "out.json").read_text())
    for name in RUNS:
        assert got[name]["tokens"] == ref, name
    assert max(got["dflash"]["taus"]) > 2  # drafts were accepted: trims happened on both ranks
    assert got["_comm"]["broadcasts"] > 0


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
    spec = {
        "model": str(folder),
        "prompt": PROMPT,
        "truth": PROMPT,
        "max_tokens": 400,
        "runs": {"dflash": {"mode": "dflash"}},
        "out": str(tmp_path / "out.json"),
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    worker = Path(__file__).parent / "dist_worker.py"
    r = launch(
        sys.executable,
        str(worker),
        str(tmp_path / "spec.json"),
        env={"DFLASH_TEST_DIE_AFTER": "3", "DFLASH_MLX_DIST_TIMEOUT": "10"},
        timeout=120,
    )
    log = r.stderr + r.stdout
    # mlx.launch stops the survivors when a rank exits with an error; a rank killed outright
    # leaves rank 0 blocked in an all-reduce, which the watchdog ends. One sentence either way
    # (mlx.launch's own exit status does not say).
    assert "error: rank 0 of 2: another rank stop" in log, log
    assert "Traceback" not in log
    assert not (tmp_path / "out.json").exists()


def test_watchdog_ends_a_hang(monkeypatch):
    from mlx_dflash import distributed

    died = []
    monkeypatch.setattr(distributed.os, "_exit", lambda code: died.append(code))
    world = distributed.World(group=None, rank=0, size=2, timeout=0.2)
    world._beat -= 1.0  # no progress for a second
    import time

    monkeypatch.setattr(distributed.signal, "signal", lambda *a: None)
    distributed._install_failure_handling(world)
    deadline = time.time() + 5
    while not died and time.time() < deadline:
        time.sleep(0.05)
    assert died == [1]  # once: the watchdog stops after firing
