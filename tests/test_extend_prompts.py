"""training/extend_prompts.py: a grown prompt list keeps every old id and the held-out tail."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "training" / "extend_prompts.py"
spec = importlib.util.spec_from_file_location("extend_prompts", SCRIPT)
extend_prompts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(extend_prompts)


def sharegpt(n):
    return [{"id": f"c{i // 2}_{i % 2}", "prompt": f"question number {i} " * 2} for i in range(n)]


def test_old_lines_and_held_out_tail_stay_put():
    pool = sharegpt(40)
    old = [{"prompt": p["prompt"], "source": "sharegpt", "id": p["id"]} for p in pool[:10]]
    old += [{"prompt": f"held out prompt {i} ....", "source": "x", "id": i} for i in range(3)]
    new = extend_prompts.extend(old, pool, 8, held_out=3, seed=0, exclude=(set(), set()))
    assert len(new) == 21
    assert new[:10] == old[:10] and new[-3:] == old[-3:]
    added = new[10:18]
    assert {p["id"] for p in added} == {p["id"] for p in pool[10:18]}  # next in file order
    assert [p["id"] for p in added] != [p["id"] for p in pool[10:18]]  # shuffled


def test_skips_bench_texts_their_conversations_short_and_duplicate_prompts():
    pool = sharegpt(30)
    pool[2]["prompt"] = "short"  # under 20 characters
    pool[3]["prompt"] = pool[1]["prompt"]  # a duplicate text
    exclude = ({pool[4]["prompt"].strip()}, {"c3"})  # a bench text; conversation c3 (6, 7)
    new = extend_prompts.extend([], pool, 5, held_out=0, seed=0, exclude=exclude)
    assert sorted(p["id"] for p in new) == ["c0_0", "c0_1", "c2_1", "c4_0", "c4_1"]


def test_too_few_prompts_left_is_one_sentence():
    with pytest.raises(SystemExit, match="Only 4 new ShareGPT prompts are left"):
        extend_prompts.extend([], sharegpt(4), 5, held_out=0, seed=0, exclude=(set(), set()))


def test_cli_refuses_to_overwrite(tmp_path):
    old = tmp_path / "old.jsonl"
    old.write_text(json.dumps({"prompt": "a prompt of some length", "id": 0}) + "\n")
    out = tmp_path / "new.jsonl"
    out.write_text("mine\n")
    cmd = [sys.executable, str(SCRIPT), str(old), "--add", "1", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode != 0 and "not overwriting" in r.stderr
    assert out.read_text() == "mine\n"
    cmd = [sys.executable, str(SCRIPT), str(tmp_path / "none.jsonl"), "--add", "1", "--out",
           str(tmp_path / "other.jsonl")]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode != 0 and "Could not read prompts" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "other.jsonl").exists()
