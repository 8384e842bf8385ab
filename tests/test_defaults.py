"""The default configuration (engine/choice.py): DDTree trees sized by --budget auto with lookup
branches and the drafter's corpus wherever speculation can pay, prompt lookup alone where no
drafter is known, plain decoding where this machine's verify costs about as many steps as it
has tokens (measured; faked here), each said in one line; and `--mode dflash`'s chain, a whole
block or sized by `--budget auto`."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from mlx_dflash import load_pair
from mlx_dflash.engine import GenerationConfig, Session, generate_rounds
from mlx_dflash.engine import budget as budget_mod
from mlx_dflash.engine.budget import PROBE_TOKENS, profile_name, speculation_pays, verify_steps
from mlx_dflash.engine.choice import default_mode, describe
from mlx_dflash.models.target import load_target
from mlx_dflash.models.tiny import write_tiny_target
from mlx_dflash.paths import cache_root

STORY = "Once upon a time"
REAL_BOUND = budget_mod.MIN_IDEAL_SPEEDUP  # read at import, before conftest lifts it


@pytest.fixture(autouse=True)
def real_bound(monkeypatch):
    """This file checks the probe's verdict itself: with the bound users get."""
    monkeypatch.setattr(budget_mod, "MIN_IDEAL_SPEEDUP", REAL_BOUND)


def greedy(target, ids: list[int], n: int) -> list[int]:
    argmax = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    steps = generate_step(mx.array(ids), target.model, max_tokens=n, sampler=argmax)
    return [int(t) for t, _ in steps]


def fake_timings(target, steps: float | None, full: bool = False) -> Path:
    """A verify of PROBE_TOKENS tokens priced at `steps` plain steps on this machine, as the
    probe (or with `full`, the whole verify profile) caches it; None removes both."""
    folder = cache_root() / "profiles"
    folder.mkdir(parents=True, exist_ok=True)
    name = profile_name(target)
    for p in (folder / f"{name}.json", folder / f"{name}-probe.json"):
        p.unlink(missing_ok=True)
    path = folder / (f"{name}.json" if full else f"{name}-probe.json")
    if steps is not None:
        sizes = [1, 2, 4, PROBE_TOKENS, 16] if full else [1, PROBE_TOKENS]
        seconds = [0.01 * (1 + (steps - 1) * (s - 1) / (PROBE_TOKENS - 1)) for s in sizes]
        path.write_text(json.dumps({"sizes": sizes, "seconds": seconds}))
    return path


def test_generation_config_defaults_are_the_auto_tree_with_lookup():
    cfg = GenerationConfig()
    assert (cfg.mode, cfg.budget, cfg.lookup, cfg.lookup_corpus) == ("ddtree", "auto", 10, None)
    assert GenerationConfig(budget=16).lookup == 0  # a fixed budget verifies every branch
    chain = GenerationConfig(mode="dflash")
    assert (chain.budget, chain.lookup) == (None, 0)  # the drafter's whole block
    assert GenerationConfig(mode="dflash", budget="auto").budget == "auto"
    assert GenerationConfig(mode="ar").lookup == 0
    assert GenerationConfig(mode="lookup").lookup == 10


def test_the_choice_follows_the_measured_verify_cost(tmp_path):
    target = load_target(write_tiny_target(tmp_path / "t", "llama"))
    drafter = object()  # (only its presence matters)
    fake_timings(target, 7.0)  # a quantized target on this CPU: 8 rows cost ~7 steps
    assert not speculation_pays(target) and verify_steps(target) == pytest.approx(7.0)
    choice = default_mode(target, drafter, "q4")
    assert choice.mode == "ar" and "8 tokens of q4 costs 7.0 plain steps" in choice.note
    fake_timings(target, 1.3)  # float32 through BLAS
    assert default_mode(target, drafter).mode == "ddtree"
    assert default_mode(target, drafter).note is None
    choice = default_mode(target, None, "mine")
    assert choice.mode == "lookup" and "no DFlash drafter is known for mine" in choice.note
    fake_timings(target, 4.0)  # exactly the bound: an ideal 2x still counts as paying
    assert default_mode(target, drafter).mode == "ddtree"
    fake_timings(target, 4.1)
    assert default_mode(target, drafter).mode == "ar"


def test_a_cached_profile_is_read_and_a_missing_one_measured_once(tmp_path, monkeypatch):
    target = load_target(write_tiny_target(tmp_path / "t", "llama"))
    fake_timings(target, 6.0, full=True)
    monkeypatch.setattr(budget_mod.VerifyProfile, "measure", None)  # never called
    assert verify_steps(target) == pytest.approx(6.0)
    monkeypatch.undo()
    probe = fake_timings(target, None)
    calls = []
    real = budget_mod.VerifyProfile.measure.__func__

    def measure(cls, *a, **kw):
        calls.append(kw.get("sizes"))
        return real(cls, *a, **kw)

    monkeypatch.setattr(budget_mod.VerifyProfile, "measure", classmethod(measure))
    first = verify_steps(target)
    assert calls == [(1, PROBE_TOKENS)] and probe.exists() and first > 0
    assert verify_steps(target) == first and len(calls) == 1  # cached


def test_generate_runs_the_default_and_says_so(run_cli):
    """No flags: the embedded pair runs DDTree under --budget auto with lookup branches, the
    target's own greedy text, and the stats line and --json say what ran."""
    target, _ = load_pair(None, None)
    ids = target.tokenizer.encode(STORY)
    ref = target.tokenizer.decode(greedy(target, ids, 40))
    code, out, err = run_cli("generate", "--prompt", STORY, "-n", "40", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert (res["mode"], res["budget"], res["lookup"]) == ("ddtree", "auto", 10)
    assert res["configuration"] == "ddtree --budget auto, lookup 10"
    assert res["text"] == ref and "note:" not in err
    code, out, err = run_cli("generate", "--prompt", STORY, "-n", "40")
    assert code == 0 and err.startswith("ddtree --budget auto, lookup 10 | prompt")
    code, out, err = run_cli("generate", "--prompt", STORY, "-n", "40", "--mode", "dflash")
    assert code == 0 and err.startswith("dflash (the drafter's whole block) | prompt")


def test_without_a_known_drafter_the_default_is_lookup(tmp_path, run_cli):
    folder = write_tiny_target(tmp_path / "mine", "llama")
    target = load_target(folder)
    fake_timings(target, 1.3)
    prompt = "a b c a b c a b c a b"
    ids = target.tokenizer.encode(prompt)
    code, out, err = run_cli("generate", "-m", folder, "-p", prompt, "-n", "12", "--json",
                             "--no-chat-template")  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["mode"] == "lookup" and err.count("note:") == 1
    assert "no DFlash drafter is known" in err
    assert target.tokenizer.encode(json.loads(out)["text"]) == greedy(target, ids, 12)
    # A mode that needs a drafter, typed, still says it needs one.
    code, _, err = run_cli("generate", "-m", folder, "-p", prompt, "--mode", "ddtree")
    assert code == 1 and "No published DFlash drafter is known" in err


def test_a_quantized_target_on_a_slow_verify_decodes_plainly(tmp_path, run_cli):
    """Where a verify of 8 tokens costs ~7 steps (4-bit weights on this CPU), the default is
    plain decoding, said in one line; a typed mode still speculates, with its own note."""
    from published import write_published

    q4 = write_published(tmp_path / "q4", "meta-llama/Llama-3.1-8B-Instruct", "mlx-lm-4bit")
    fake_timings(load_target(q4), 7.0)
    code, out, err = run_cli("generate", "-m", q4, "-p", "Hi", "-n", "4", "--json",
                             "--budget", "8", "--lookup", "3")  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["mode"] == "ar" and err.count("note:") == 1
    assert "plain decoding (--mode ar)" in err and "costs 7.0 plain steps" in err
    code, out, err = run_cli("generate", "-m", q4, "-p", "Hi", "-n", "4", "--mode", "lookup")
    assert code == 0 and "--dequantize" in err and "plain decoding (--mode ar)" not in err
    assert "--budget auto decodes plainly" in err and "costs 7.0 plain steps" in err
    code, out, err = run_cli("generate", "-m", q4, "-p", "Hi", "-n", "4", "--mode", "lookup",
                             "--budget", "4")  # fmt: skip
    assert code == 0 and "--dequantize" in err and "decodes plainly" not in err


def test_describe_names_the_corpus():
    assert describe(GenerationConfig(mode="ar")) == "ar (plain decoding)"
    assert describe(GenerationConfig(budget=4)) == "ddtree --budget 4"
    assert describe(GenerationConfig(lookup_corpus="/x/answers.jsonl.gz")) == (
        "ddtree --budget auto, lookup 10 + corpus answers.jsonl.gz"
    )
    assert describe(GenerationConfig(mode="dflash", budget="auto")) == "dflash --budget auto"


@pytest.mark.parametrize("budget", [None, 3, "auto"])
def test_dflash_chains_are_exact_at_any_size(budget):
    """`--mode dflash`: the drafter's whole block (z-lab's loop), a fixed number of drafts, or
    each chain sized by --budget auto (a tree round with one child per node)."""
    target, drafter = load_pair(None, None)
    ids = target.tokenizer.encode(STORY + ", there was a little dog")
    ref = greedy(target, ids, 48)
    cfg = GenerationConfig(max_tokens=48, mode="dflash", budget=budget)
    out, drafted = [], []
    for r in generate_rounds(Session(target, drafter), ids, cfg):
        out += r.tokens
        drafted += [] if r.prefill else [r.drafted]
    assert out == ref
    if budget is None:
        assert max(drafted) == drafter.block_size - 1
    elif budget == 3:
        assert max(drafted) == 3
    else:
        assert 1 <= max(drafted) <= drafter.block_size - 1


@pytest.mark.parametrize("mode", ["ddtree", "dflash", "lookup"])
def test_auto_decodes_plainly_where_no_draft_can_pay(mode):
    """--budget auto prices the measured verify: where 8 tokens cost 7 steps (4-bit weights on
    this CPU) no round drafts or verifies more than one token, and the output is the target's
    own; a fixed budget still speculates on the same machine."""
    target, drafter = load_pair(None, None)
    ids = target.tokenizer.encode(STORY + ", there was a little dog")
    ref = greedy(target, ids, 32)

    def run(**kw):
        cfg = GenerationConfig(max_tokens=32, mode=mode, **kw)
        rounds = list(generate_rounds(Session(target, drafter), ids, cfg))
        assert [t for r in rounds for t in r.tokens] == ref
        return max(r.drafted for r in rounds)

    fake_timings(target, 7.0)
    assert run(budget="auto") == 0
    assert run(budget=8) > 0
    fake_timings(target, 1.3)  # float32 through BLAS: auto speculates
    assert run(budget="auto") > 0


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5"])
def test_plain_auto_ends_exactly_at_max_tokens(tmp_path, model_type):
    """Where --budget auto decodes plainly, its steps are pipelined (one in flight), and the
    last token that max_tokens allows is that same step, never a second plain step run on top
    of the one in flight (which repeated a token: wrong text from a recurrent target)."""
    target = load_target(write_tiny_target(tmp_path / "t", model_type))
    ids = list(range(3, 23))
    ref = greedy(target, ids, 12)
    fake_timings(target, 7.0)
    for n in (2, 3, 7, 12):
        cfg = GenerationConfig(max_tokens=n, mode="lookup", budget="auto")
        rounds = list(generate_rounds(Session(target), ids, cfg))
        assert max(r.drafted for r in rounds) == 0
        assert [t for r in rounds for t in r.tokens] == ref[:n], n
