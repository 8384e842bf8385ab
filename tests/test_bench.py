"""`dflash-mlx bench` on a tiny target: JSON and PNG out, greedy outputs compared across
methods, and a planted mismatch that the comparison must catch."""

from __future__ import annotations

import importlib.util
import json

import pytest
from typer.testing import CliRunner

from mlx_dflash.benchmark import datasets as bench_datasets
from mlx_dflash.benchmark import runner as bench
from mlx_dflash.benchmark.datasets import DATASETS, load_prompts
from mlx_dflash.benchmark.report import check_identical
from mlx_dflash.benchmark.runner import Method, parse_methods
from mlx_dflash.cli import app
from mlx_dflash.engine.session import DEFAULT_LOOKUP
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.tiny import drafter_config_dict, write_drafter_checkpoint, write_tiny_target
from mlx_dflash.settings import SETTINGS

METHODS = "mlx-lm,ar,dflash,ddtree:4,ddtree:auto,lookup,ddtree+lookup:auto"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target = write_tiny_target(root / "target", "llama")
    cfg = json.loads((target / "config.json").read_text())
    drafter = write_drafter_checkpoint(
        root / "drafter", drafter_config_dict("toplevel_block_size", cfg, block_size=4)
    )
    return str(target), str(drafter)


@pytest.fixture
def data_dir(shared_file):
    return shared_file("data/bench/gsm8k_test.jsonl").parent


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Keep the DDTree auto-budget profile out of the user's cache."""
    monkeypatch.setattr(SETTINGS, "cache", str(tmp_path / "cache"))


def bench_args(pair, out):
    model, drafter = pair
    return ["bench", "-m", model, "-d", drafter, "--limit", "2", "-n", "10", "--out", str(out)]


def test_bench_writes_json_and_plot(pair, data_dir, tmp_path):
    out = tmp_path / "res" / "b.json"
    args = bench_args(pair, out) + ["--methods", METHODS, "--data-dir", str(data_dir)]
    r = CliRunner().invoke(app, [*args, "--dataset", "gsm8k", "--dataset", "mt-bench"])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    methods = METHODS.split(",")
    assert [(x["dataset"], x["method"]) for x in res["results"]] == [
        (d, m) for d in ("gsm8k", "mt-bench") for m in methods
    ]
    assert res["identical"] == {
        "checked": True,
        "identical": True,
        "reference": "mlx-lm",
        "comparisons": 2 * 2 * (len(methods) - 1),
        "mismatches": [],
    }
    assert res["baseline"] == "mlx-lm"
    for row in res["results"]:
        assert row["prompts"] == 2 and row["generated_tokens"] <= 20
        assert row["generation_tps"] > 0 and row["speedup"] > 0 and row["mean_tau"] >= 1
        assert sum(row["tau_histogram"].values()) == row["rounds"]
        assert row["peak_memory_mb"] > 0
        if row["method"] in ("dflash", "ddtree:4"):
            assert row["time_draft_s"] > 0 and row["time_verify_s"] > 0
            # Fixed budgets draft every round but, at most, the one making the last token.
            assert row["rounds"] - row["prompts"] <= row["draft_rounds"] <= row["rounds"]
        if row["method"] in ("mlx-lm", "ar"):
            assert row["draft_rounds"] == 0
    assert "token-identical" in r.stdout and "gsm8k" in r.stdout
    if importlib.util.find_spec("matplotlib"):
        png = out.with_suffix(".png")
        assert res["plot"] == str(png) and png.read_bytes()[:4] == b"\x89PNG"
    else:
        assert "Plot skipped" in r.stdout


def test_planted_mismatch_is_reported(pair, data_dir, tmp_path, monkeypatch):
    real = bench.run_engine

    def corrupt(target, runner, ids, cfg, session=None):
        run = real(target, runner, ids, cfg, session)
        if cfg.mode == "dflash" and len(run.tokens) > 3:
            run.tokens[3] = (run.tokens[3] + 1) % target.vocab_size
        return run

    monkeypatch.setattr(bench, "run_engine", corrupt)
    out = tmp_path / "b.json"
    args = bench_args(pair, out) + ["--methods", "ar,dflash", "--no-plot"]
    r = CliRunner().invoke(app, [*args, "--data-dir", str(data_dir), "--dataset", "gsm8k"])
    assert r.exit_code == 1
    assert "MISMATCH" in r.stdout and "dflash differs at token 3" in r.stdout
    ident = json.loads(out.read_text())["identical"]
    assert ident["identical"] is False and {m["method"] for m in ident["mismatches"]} == {"dflash"}
    assert [m["position"] for m in ident["mismatches"]] == [3, 3]


def test_check_identical():
    same = {"d": [{"a": [1, 2, 3], "b": [1, 2, 3]}]}
    assert check_identical(same)["identical"] is True
    short = check_identical({"d": [{"a": [1, 2, 3], "b": [1, 2]}]})
    assert short["identical"] is False and short["mismatches"][0]["position"] == 2
    assert check_identical(same, greedy=False)["checked"] is False


def test_parse_methods():
    spec = "mlx-lm, ar,dflash,ddtree,ddtree:4,ddtree:auto,lookup,lookup:auto,ddtree+lookup:8"
    assert parse_methods(spec) == [
        Method("mlx-lm", "mlx-lm"),
        Method("ar", "ar"),
        Method("dflash", "dflash"),
        Method("ddtree", "ddtree", 16),
        Method("ddtree:4", "ddtree", 4),
        Method("ddtree:auto", "ddtree", "auto"),
        Method("lookup", "lookup", 16, DEFAULT_LOOKUP),
        Method("lookup:auto", "lookup", "auto", DEFAULT_LOOKUP),
        Method("ddtree+lookup:8", "ddtree", 8, DEFAULT_LOOKUP),
    ]
    assert parse_methods("dflash:3,dflash:auto") == [
        Method("dflash:3", "dflash", 3, 0, ""),
        Method("dflash:auto", "dflash", "auto", 0, ""),
    ]
    for bad in ("eagle", "dflash:0", "ddtree:0", "ddtree:x", "ar,ar", "", "lookup:0"):
        with pytest.raises(DFlashError):
            parse_methods(bad)


def test_packaged_copy_set():
    prompts = load_prompts("copy")
    assert len(prompts) == 12 and all("\n" in p for p in prompts)
    assert load_prompts("copy", limit=3) == prompts[:3]


@pytest.mark.parametrize("name", list(DATASETS))
def test_named_datasets_load(name, data_dir):
    prompts = load_prompts(name, data_dir, limit=3)
    assert len(prompts) == 3 and all(isinstance(p, str) and len(p) > 10 for p in prompts)


def test_mbpp_is_its_test_split_as_on_the_hub(data_dir, tmp_path):
    """The local sanitized MBPP file holds every split; the bench set is its test split (tasks
    11-510, the hub's sanitized test parquet), never the train and validation tasks the
    shipped coder drafter learnt from."""
    real = load_prompts("mbpp", data_dir)
    assert len(real) == 257  # the sanitized test split's size
    rows = [{"task_id": i, "prompt": f"task {i}"} for i in (2, 11, 300, 510, 511, 601, 900)]
    (tmp_path / "mbpp_sanitized.json").write_text(json.dumps(rows))
    assert load_prompts("mbpp", tmp_path) == ["task 11", "task 300", "task 510"]


def test_own_jsonl_and_errors(tmp_path, monkeypatch):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"question": "What is 2+2?"}\n\n{"turns": ["Hi", "Bye"]}\n')
    assert load_prompts(str(f)) == ["What is 2+2?", "Hi"]
    raw = tmp_path / "raw.jsonl"  # a line separator held raw inside a JSON string, as ShareGPT
    raw.write_text('{"prompt": "one\u2028two"}\r\n{"prompt": "three"}\n', encoding="utf-8")
    assert load_prompts(str(raw)) == ["one\u2028two", "three"]
    with pytest.raises(DFlashError, match="Unknown dataset"):
        load_prompts("nope")
    with pytest.raises(DFlashError, match="does not exist"):
        load_prompts("gsm8k", tmp_path)

    def offline(*a, **k):
        raise ConnectionError("offline")

    monkeypatch.setattr(bench_datasets, "default_data_dir", lambda: None)
    monkeypatch.setattr("huggingface_hub.hf_hub_download", offline)
    with pytest.raises(DFlashError, match="could not be fetched from the Hugging Face hub"):
        load_prompts("math500")


def test_long_context_prompts(pair, data_dir, tmp_path):
    """--context N: each prompt follows earlier text of its set, about N tokens in all; our
    methods share one prefill per prompt, and outputs still equal mlx-lm's."""
    out = tmp_path / "ctx.json"
    methods = "mlx-lm,dflash,ar,ddtree:4,lookup"
    args = bench_args(pair, out) + ["--methods", methods, "--data-dir", str(data_dir)]
    r = CliRunner().invoke(app, [*args, "--dataset", "gsm8k", "--context", "300"])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    assert res["settings"]["context"] == 300 and res["identical"]["identical"]
    prefilled = {row["method"]: row["prompt_tokens"] for row in res["results"]}
    for method in ("mlx-lm", "dflash"):  # two prompts of ~300 tokens, prefilled whole
        assert 2 * 280 <= prefilled[method] <= 2 * 330
    for method in ("ar", "ddtree:4", "lookup"):  # the prompt's last token only
        assert prefilled[method] == 2


def test_bench_profile_splits_rounds(pair, data_dir, tmp_path):
    """--profile: per-round draft / verify / host / Python time, against a plain step."""
    out = tmp_path / "p.json"
    args = bench_args(pair, out) + ["--data-dir", str(data_dir), "--no-plot", "--profile"]
    r = CliRunner().invoke(app, [*args, "--methods", "mlx-lm,dflash,ddtree:4"])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    assert res["settings"]["profile"] is True
    for row in res["results"][1:]:
        assert row["time_draft_s"] > 0 and row["time_verify_s"] > 0
        # Python graph building is part of drafting and verifying, never more.
        assert 0 < row["time_build_s"] < row["time_draft_s"] + row["time_verify_s"]
    assert "Round profile" in r.stdout and "plain steps" in r.stdout


def test_every_method_runs_a_dflash2_drafter(data_dir, tmp_path):
    """bench with a DFlash 2 drafter (Qwen3.8's published config, shrunk to a tiny target):
    every drafting method, lookup grafted on too, token-identical to mlx-lm."""
    from published import dflash2_config, shrink_dflash2, write_dflash2_drafter

    target = write_tiny_target(tmp_path / "target", "llama")
    cfg = json.loads((target / "config.json").read_text())
    dcfg = shrink_dflash2(dflash2_config("z-lab/Qwen3.8-27B-DFlash2"), cfg)
    drafter = write_dflash2_drafter(tmp_path / "drafter", dcfg)
    out = tmp_path / "b.json"
    methods = "mlx-lm,dflash,ddtree:4,ddtree:16,ddtree:auto,ddtree+lookup:auto"
    args = bench_args((str(target), str(drafter)), out) + ["--methods", methods, "--no-plot"]
    r = CliRunner().invoke(app, [*args, "--data-dir", str(data_dir), "--dataset", "gsm8k"])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    assert res["drafter_kind"]["kind"] == "dflash2"
    assert res["identical"]["identical"] and res["identical"]["comparisons"] == 2 * 5
    assert [row["method"] for row in res["results"]] == methods.split(",")


def test_structured_set_answers_under_each_prompts_schema(pair, tmp_path):
    """A set whose lines carry schemas: every method (mlx-lm with the grammar's mask as a logits
    processor, the plain constrained baseline) answers under them, the answers are identical,
    valid, and the grammar's time is reported."""
    from mlx_dflash.benchmark.datasets import load_grammars

    assert len(load_prompts("structured")) == len(load_grammars("structured", 99)) >= 12
    assert all(g is not None and g.kind == "json_schema" for g in load_grammars("structured", 99))
    schema = {"type": "object", "properties": {"pick": {"enum": ["red", "green"]}},
              "required": ["pick"], "additionalProperties": False,
              "x-guidance": {"whitespace_flexible": False}}  # fmt: skip
    data = tmp_path / "s.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "schema": schema}) + "\n"
                            for p in ("Pick a colour.", "Another one?")))  # fmt: skip
    out = tmp_path / "s.json"
    model, drafter = pair
    args = ["bench", "-m", model, "-d", drafter, "-n", "24", "--out", str(out), "--no-plot",
            "--dataset", str(data), "--methods", METHODS, "--profile"]  # fmt: skip
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    assert res["identical"]["identical"] is True
    for row in res["results"]:
        assert row["valid"] == 1.0 and row["time_grammar_s"] > 0, row["method"]
        if row["method"] not in ("mlx-lm", "ar"):  # '{"pick":"' is certain: verified in one go
            assert row["grammar_drafts_accepted"] > 0, row["method"]
    assert "valid" in r.stdout and "grammar" in r.stdout


def test_the_default_method_is_what_generate_runs(pair, data_dir, tmp_path):
    """`default` runs what `generate` runs when told nothing (engine/choice.py), resolved for
    the loaded pair on this machine, and the table says what that was; `dflash:auto` and
    `dflash:N` size the chain."""
    out = tmp_path / "d.json"
    args = bench_args(pair, out) + ["--methods", "mlx-lm,default,dflash,dflash:2,dflash:auto"]
    r = CliRunner().invoke(app, [*args, "--data-dir", str(data_dir), "--dataset", "gsm8k"])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    assert res["default"]["ran"] == "ddtree --budget auto, lookup 10"
    assert res["default"]["note"] is None
    assert "default = ddtree --budget auto, lookup 10" in r.output
    assert res["identical"]["identical"]
    m = {x.label: x for x in parse_methods("default,dflash,dflash:2,dflash:auto,ddtree")}
    assert m["dflash"].budget is None and m["dflash:2"].budget == 2
    assert m["dflash:auto"].budget == "auto" and m["ddtree"].budget == 16
    assert m["default"].corpus is None and m["dflash"].corpus == ""


def test_dataset_lists_read_as_methods_do():
    """`--dataset "gsm8k, mbpp"` names two datasets (spaces after commas, as `--methods` takes
    them); an empty list is one sentence."""
    from mlx_dflash.benchmark.runner import _dataset_names
    from mlx_dflash.errors import DFlashError

    assert _dataset_names("gsm8k, mbpp") == ["gsm8k", "mbpp"]
    assert _dataset_names(["humaneval,", " stories"]) == ["humaneval", "stories"]
    with pytest.raises(DFlashError, match="names no dataset"):
        _dataset_names(" , ")


def test_repeat_keeps_each_prompts_median_run(monkeypatch):
    """--repeat N: every method runs each prompt N times, interleaved (the methods alternate
    within a repeat), the run of median decode time stands for it, and a growing corpus gains
    the prompt's answer once, after its repeats (so no repeat looks up its own answer)."""
    from mlx_dflash.engine.corpus import AnswerCorpus

    calls, decode = [], iter([5.0, 1.0, 3.0, 9.0, 7.0, 8.0] * 2)

    def fake_run(m, target, runner, ids, cfg, session=None):
        calls.append(m.label)
        t = next(decode)
        return bench.Run(tokens=[ids[0], len(m.label)], prompt_tokens=1, t_prefill=0.1,
                         t_decode=t, taus=[1])  # fmt: skip

    monkeypatch.setattr(bench, "run_method", fake_run)
    grown = AnswerCorpus([])
    meths = [Method("ar", "ar"), Method("lookup+corpus", "lookup", corpus=grown)]
    progress = []
    runs, outputs = bench._run_all(
        meths, None, None, {"set": [[10], [20]]}, {"set": [None, None]}, _cfg(), False,
        lambda desc, n: progress.append(n), repeat=3,
    )  # fmt: skip
    assert calls == ["ar", "lookup+corpus"] * 6 and len(progress) == 12
    # prompt 1: ar ran 5, 3, 7 -> 5; lookup ran 1, 9, 8 -> 8; prompt 2 likewise
    assert [r.t_decode for r in runs["set"]["ar"]] == [5.0, 5.0]
    assert [r.t_decode for r in runs["set"]["lookup+corpus"]] == [8.0, 8.0]
    assert outputs["set"][1] == {"ar": [20, 2], "lookup+corpus": [20, 13]}
    assert len(grown) == 4  # two answers of 2 tokens: one per prompt, not one per repeat


def test_repeat_reports_a_repeat_that_decoded_otherwise(monkeypatch):
    """The median run counts for speed, but every repeat's answer is checked: a repeat that
    decoded differently (state left over from an earlier run, say) is the prompt's output."""
    decode = iter([2.0, 1.0, 3.0])

    def fake_run(m, target, runner, ids, cfg, session=None):
        t = next(decode)
        tokens = [7, 8] if t == 3.0 else [7, 9]  # the slowest repeat answers otherwise
        return bench.Run(tokens=tokens, prompt_tokens=1, t_prefill=0.1, t_decode=t, taus=[1])

    monkeypatch.setattr(bench, "run_method", fake_run)
    runs, outputs = bench._run_all(
        [Method("ar", "ar")], None, None, {"set": [[1]]}, {"set": [None]}, _cfg(), False, None, 3
    )
    assert runs["set"]["ar"][0].t_decode == 2.0 and outputs["set"][0]["ar"] == [7, 8]


def _cfg():
    from mlx_dflash.engine.session import GenerationConfig

    return GenerationConfig(max_tokens=4)


def test_repeat_from_the_command_line(pair, data_dir, tmp_path):
    out = tmp_path / "r.json"
    args = bench_args(pair, out) + ["--methods", "mlx-lm,dflash", "--no-plot", "--repeat", "2"]
    r = CliRunner().invoke(app, [*args, "--data-dir", str(data_dir), "--limit", "1"])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    assert res["settings"]["repeat"] == 2 and res["identical"]["identical"] is True
    assert "median of 2 runs" in " ".join(r.stdout.split())  # (the caption may wrap)
    assert [x["prompts"] for x in res["results"]] == [1, 1]
    bad = CliRunner().invoke(app, [*args[:-1], "0", "--data-dir", str(data_dir)])
    assert bad.exit_code != 0 and "Traceback" not in bad.output
