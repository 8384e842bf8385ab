"""`dflash-mlx generate` end to end, the embedded default pair, and every bad-input path."""

from __future__ import annotations

import json
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from mlx_dflash import load_pair
from mlx_dflash.engine import GenerationConfig, Session, generate_rounds
from mlx_dflash.engine.contract import Pass
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.tiny import drafter_config_dict, write_drafter_checkpoint, write_tiny_target
from mlx_dflash.paths import DEFAULT_DRAFTER, DEFAULT_TARGET

STORY = "Once upon a time"


def one_error_line(code: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_default_pair_is_shipped():
    assert (DEFAULT_TARGET / "config.json").exists() and (DEFAULT_DRAFTER / "config.json").exists()


@pytest.mark.parametrize("mode", ["dflash", "ddtree", "ar"])
def test_generate_default_pair_matches_mlx_lm(run_cli, mode):
    """No model arguments: the embedded stories260K pair, greedy, equals mlx-lm's decoding."""
    target, _ = load_pair(None, None)
    ids = target.tokenizer.encode(STORY)
    greedy = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    ref = [
        int(t) for t, _ in generate_step(mx.array(ids), target.model, max_tokens=60, sampler=greedy)
    ]
    code, out, err = run_cli("generate", "--prompt", STORY, "-n", "60", "--mode", mode, "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["text"] == target.tokenizer.decode(ref)
    assert res["generated_tokens"] == 60 and res["finish_reason"] == "length"
    assert "little girl" in res["text"]
    assert sum(int(k) * v for k, v in res["tau_histogram"].items()) == 60 - 1
    # Round by round: each round's accepted length, in order (the first token comes from
    # prefill); they add up to the tokens generated and agree with the histogram.
    lengths = res["acceptance_lengths"]
    assert sum(lengths) == 60 - 1 and len(lengths) == res["rounds"]
    assert {str(k): v for k, v in Counter(lengths).items()} == {
        str(k): v for k, v in res["tau_histogram"].items()
    }
    if mode != "ar":
        assert max(lengths) > 1


def test_auto_budget_joins_lookup_branches_by_default(run_cli):
    """`--mode ddtree --budget auto` takes prompt-lookup branches unless --lookup says
    otherwise (a fixed budget does not), and stays the target's own greedy text."""
    from mlx_dflash.cli.options import Flags

    def lookup(budget, n=None):
        return Flags(8, mode="ddtree", budget=budget, lookup=n).config().lookup

    assert lookup("auto") == 10 and lookup("auto", 0) == 0 and lookup("auto", 4) == 4
    assert lookup(8) == 0 and lookup("8") == 0
    _, ar, _ = run_cli("generate", "--prompt", STORY, "-n", "48", "--mode", "ar", "--json")
    for extra in ([], ["--lookup", "0"]):
        code, out, err = run_cli("generate", "--prompt", STORY, "-n", "48", "--mode", "ddtree",
                                 "--budget", "auto", "--json", *extra)  # fmt: skip
        assert code == 0, err
        assert json.loads(out)["text"] == json.loads(ar)["text"]


def test_generate_streams_text_and_stats(run_cli):
    code, out, err = run_cli("generate", "--prompt", STORY, "-n", "20")
    assert code == 0 and out.startswith(", there was")
    assert "tok/s" in err and "tau" in err


def test_stories260k_exact_over_many_rounds():
    """The real pretrained model, a long prompt, DFlash and DDTree vs mlx-lm greedy, 200 tokens."""
    target, drafter = load_pair(None, None)
    ids = target.tokenizer.encode(STORY + ", there was a little dog named Max. Max liked to run.")
    greedy = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    ref = [
        int(t)
        for t, _ in generate_step(mx.array(ids), target.model, max_tokens=200, sampler=greedy)
    ]
    # (mode, budget, tokens): the widest trees are the slowest on a CPU, so they run shorter.
    runs = [("dflash", 16, 200), ("ddtree", 1, 100), ("ddtree", 4, 200), ("ddtree", 16, 200)]
    runs += [("ddtree", 64, 100), ("ddtree", 256, 60)]
    for mode, budget, n in runs:
        drafter.reset()
        out = []
        cfg = GenerationConfig(max_tokens=n, mode=mode, budget=budget)
        for r in generate_rounds(Session(target, drafter), ids, cfg):
            out += r.tokens
        assert out == ref[:n], (mode, budget)


@pytest.fixture(scope="module")
def other_target(tmp_path_factory):
    return write_tiny_target(tmp_path_factory.mktemp("llama"), "llama")


def test_bad_inputs_end_in_one_sentence(run_cli, tmp_path, other_target):
    cfg = json.loads((other_target / "config.json").read_text())
    wrong = write_drafter_checkpoint(
        tmp_path / "wrong-drafter", drafter_config_dict("dflash_config_block_size", cfg)
    )
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text((DEFAULT_DRAFTER / "config.json").read_text())
    (corrupt / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    cases = {
        ("--prompt", "   "): "empty",
        ("--prompt", STORY, "--drafter", wrong): "vocabulary",
        ("--prompt", STORY, "--model", tmp_path / "nope"): "does not exist",
        ("--prompt", STORY, "--block-size", "17"): "Block size",
        ("--prompt", STORY, "--mode", "beam"): "Unknown mode",
        ("--prompt", STORY, "--drafter", corrupt): "model.safetensors",
        ("--prompt", STORY, "--mode", "ddtree", "--budget", "x"): "--budget",
        ("--prompt", STORY, "--model", other_target, "--drafter", DEFAULT_DRAFTER): "vocabulary",
        ("--prompt", STORY, "--drafter", DEFAULT_TARGET): "not a DFlash drafter",
        # Arguments swapped: the drafter named as the model.
        ("--prompt", STORY, "--model", DEFAULT_DRAFTER): "pass it with --drafter",
        ("--prompt", STORY, "--model", DEFAULT_DRAFTER, "--drafter", DEFAULT_TARGET): (
            "pass it with --drafter"
        ),
    }
    for args, needle in cases.items():
        code, _, err = run_cli("generate", *args)
        assert needle in one_error_line(code, err), (args, err)


def test_unknown_flag_is_a_usage_error(run_cli):
    code, _, err = run_cli("generate", "--prompt", STORY, "--frobnicate")
    assert code == 2 and "No such option" in err and "Traceback" not in err


def test_numerics_long_context_verify_vs_single_step(tmp_path):
    """At 2K+ context, a 16-token verify (causal block and tree) matches 16 one-token steps."""
    from oracle import diversify

    from mlx_dflash.models.target import load_target

    target = load_target(write_tiny_target(tmp_path / "t", "qwen3", max_position_embeddings=8192))
    diversify(target.model)
    target.set_taps([1, 3])
    rng = np.random.default_rng(0)
    prefix = mx.array(rng.integers(3, 256, size=2300))
    block = rng.integers(3, 256, size=16)
    cache = target.make_cache()
    target.forward([Pass(prefix, cache, 0, logits="none", taps=False)])[0]
    p = len(prefix)
    v_logits, v_taps = target.forward([Pass(mx.array(block), cache, p)])[0]
    for c in cache:
        c.trim(p)
    t_logits, _ = target.forward([Pass(mx.array(block), cache, p, parents=np.arange(-1, 15))])[0]
    for c in cache:
        c.trim(p)
    step_logits = []
    for i, tok in enumerate(block):
        lg, _ = target.forward([Pass(mx.array([int(tok)]), cache, p + i)])[0]
        step_logits.append(np.array(lg[0]))
    step_logits = np.stack(step_logits)
    scale = np.abs(step_logits).max()
    np.testing.assert_allclose(np.array(v_logits), step_logits, atol=1e-4 * scale)
    np.testing.assert_allclose(np.array(t_logits), step_logits, atol=1e-4 * scale)
    assert (np.array(v_logits).argmax(-1) == step_logits.argmax(-1)).all()


def test_a_quantized_target_on_the_cpu_gets_a_note_on_speculative_modes(tmp_path, run_cli):
    """On the CPU, MLX's quantized matmul costs grow with every row a verify carries (4-bit
    SmolLM2: 3x slower DFlash than plain steps), so a speculative mode there says so once on
    stderr, with the command that makes a float32 copy; plain decoding and float32 say nothing."""
    from published import write_published

    from mlx_dflash.cli.options import slow_verify_note
    from mlx_dflash.models.target import load_target

    llama = "meta-llama/Llama-3.1-8B-Instruct"
    q4 = write_published(tmp_path / "q4", llama, "mlx-lm-4bit")
    f32 = write_published(tmp_path / "f32", llama, "hf")
    quantized = load_target(q4)
    note = slow_verify_note(quantized, str(q4), "ddtree")
    assert note is not None and f"convert {q4} --out {q4}-f32 --dequantize" in note
    assert slow_verify_note(quantized, str(q4), "ar") is None
    assert slow_verify_note(load_target(f32), str(f32), "dflash") is None
    code, out, err = run_cli("generate", "-m", q4, "-p", "Hi", "-n", "4", "--mode", "lookup")
    assert code == 0 and err.count("note:") == 1 and "--dequantize" in err
    code, out, err = run_cli("generate", "-m", q4, "-p", "Hi", "-n", "4", "--mode", "ar")
    assert code == 0 and "note:" not in err


def test_block_size_zero_is_refused_and_version_prints(run_cli):
    """--block-size 0 was taken for the drafter's 16 without a word; --version is mlx-lm's."""
    code, _, err = run_cli("generate", "-p", "Hi", "-n", "4", "--block-size", "0")
    assert code == 1 and "Block size must be between 2 and the drafter's 16, not 0" in err
    code, out, _ = run_cli("--version")
    assert code == 0 and out.startswith("dflash-mlx ")


def test_max_tokens_past_the_context_is_said_once(run_cli):
    """The embedded target's context is 512 tokens: asking for more says so in one line."""
    code, _, err = run_cli("generate", "-p", "Once upon a time", "-n", "520", "--mode", "ar")
    assert code == 0 and err.count("note:") == 1 and "context of 512 tokens" in err
    code, _, err = run_cli("generate", "-p", "Once upon a time", "-n", "32", "--mode", "ar")
    assert code == 0 and "note:" not in err


def test_a_system_message_without_a_chat_template_says_where_it_went(run_cli):
    """The embedded target has no chat template: --system is prepended as text, said once
    (--thinking there is refused: it has no text form)."""
    code, _, err = run_cli("generate", "-p", "Once", "-n", "4", "--system", "Be brief.")
    assert code == 0 and err.count("note:") == 1 and "--system goes before the prompt" in err


def test_prompt_file_and_extra_eos_token_as_mlx_lm_reads_them(run_cli, tmp_path):
    """--prompt-file reads the prompt; --extra-eos-token (a token's id or text) ends the answer
    where the target first emits it; a missing file or unknown token is one sentence."""
    (tmp_path / "p.txt").write_text(STORY)
    args = ("generate", "-n", "24", "--mode", "ar", "--json", "--no-chat-template")
    code, out, err = run_cli(*args, "-p", STORY)
    assert code == 0, err
    full = json.loads(out)
    code, out, _ = run_cli(*args, "--prompt-file", tmp_path / "p.txt")
    assert code == 0 and json.loads(out)["text"] == full["text"]
    target, _ = load_pair(None, None)
    ids = target.tokenizer.encode(STORY)
    argmax = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    steps = generate_step(mx.array(ids), target.model, max_tokens=24, sampler=argmax)
    tokens = [int(t) for t, _ in steps]
    stop = tokens[6]
    code, out, _ = run_cli(*args, "-p", STORY, "--extra-eos-token", str(stop))
    cut = tokens[: tokens.index(stop)]
    assert code == 0 and json.loads(out)["text"] == target.tokenizer.decode(cut)
    code, _, err = run_cli(*args, "--prompt-file", tmp_path / "none.txt")
    assert code == 1 and "Cannot read the prompt file" in err and "No such file" in err
    code, _, err = run_cli(*args, "-p", STORY, "--extra-eos-token", "zzzqqq")
    assert code == 1 and "'zzzqqq' is not a token of this model" in err
    code, _, err = run_cli(*args)
    assert code == 1 and "--prompt or --prompt-file" in err


def test_prefill_step_size_changes_the_chunks_not_the_text(run_cli):
    """mlx-lm's --prefill-step-size: the prompt in chunks of 3 tokens, the same output."""
    args = ("generate", "-p", STORY + ", there was a little dog", "-n", "24", "--json")
    code, out, err = run_cli(*args)
    assert code == 0, err
    code, small, err = run_cli(*args, "--prefill-step-size", "3")
    assert code == 0, err
    assert json.loads(small)["text"] == json.loads(out)["text"]
    with pytest.raises(DFlashError, match="prefill step must be at least 1"):
        GenerationConfig(prefill_chunk=0)


def test_help_groups_the_flags_in_panels(run_cli, monkeypatch):
    """Issue 51: generate --help was one flat panel of 116 lines at 80 columns, --mode showed
    as <str>, -d meant --dequantize in convert, and the command list cut summaries mid-line."""
    from mlx_dflash import cli

    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run_cli("generate", "--help")
    assert code == 0
    panels = [line.split("─ ")[1].split(" ─")[0] for line in out.splitlines() if "╭─ " in line]
    assert panels == ["Options", "Prompt", "Model", "Chat template", "KV cache", "Speculation",
                      "Sampling", "Structured output", "Output"]  # fmt: skip
    assert "[ddtree|dflash|lookup|ar]" in out and "<str>" not in out
    assert len(out.splitlines()) < 100
    _, out, _ = run_cli("convert", "--help")
    assert "-d " not in out and "--dequantize" in out  # -d: --drafter, everywhere
    for command in cli.app.registered_commands:  # each summary is one whole sentence
        summary = command.help.split("\n\n")[0]
        assert "\n" not in summary and summary.endswith("."), command.name
    _, out, _ = run_cli("--help")
    assert "whether this build runs each." in out


def test_min_p_one_keeps_only_the_most_probable_token(run_cli):
    """--min-p (mlx-lm's): at 1.0 only the most probable token survives, so sampling at any
    temperature is greedy decoding, through every speculative mode."""
    code, greedy, err = run_cli("generate", "-p", STORY, "-n", "24", "--no-stats")
    assert code == 0, err
    for mode in ("ddtree", "dflash"):
        code, out, err = run_cli("generate", "-p", STORY, "-n", "24", "--no-stats", "--mode",
                                 mode, "--temp", "1.5", "--min-p", "1.0", "--seed", "3")  # fmt: skip
        assert code == 0 and out == greedy, (mode, err)
    code, out, _ = run_cli("generate", "-p", STORY, "-n", "24", "--no-stats", "--temp", "1.5",
                           "--seed", "3")  # fmt: skip
    assert out != greedy  # (the same sampling without min-p is not greedy)


def test_stop_strings_and_verbose_as_mlx_lm_users_type_them(run_cli):
    """--stop TEXT ends the answer before the text (repeatable; the earliest wins), in the
    stream and in --json, with finish "stop"; --verbose False drops the stats line."""
    code, full, _ = run_cli("generate", "-p", STORY, "-n", "40", "--no-stats")
    assert code == 0 and "girl" in full and "Lily" in full
    code, out, err = run_cli("generate", "-p", STORY, "-n", "40", "--stop", "Lily", "--stop",
                             "girl")  # fmt: skip
    assert code == 0 and out.rstrip("\n") == full[: full.index("girl")]
    code, out, _ = run_cli("generate", "-p", STORY, "-n", "40", "--stop", "Lily", "--json")
    d = json.loads(out)
    assert d["text"] == full[: full.index("Lily")] and d["finish_reason"] == "stop"
    code, out, err = run_cli("generate", "-p", STORY, "-n", "8", "--verbose", "False")
    assert code == 0 and err == ""
    code, out, err = run_cli("generate", "-p", STORY, "-n", "8", "--verbose", "True")
    assert code == 0 and "tok/s" in err


def test_xtc_flags_reach_the_sampler(run_cli):
    """--xtc-probability / --xtc-threshold (mlx-lm's; the distribution is tested against
    mlx-lm's sampler in test_sampling): excluding the top choices every draw changes a sampled
    story, and a threshold no two tokens pass excludes nothing."""
    args = ("generate", "-p", STORY, "-n", "24", "--no-stats", "--temp", "1.0", "--seed", "5")
    code, plain, err = run_cli(*args)
    assert code == 0, err
    code, out, err = run_cli(*args, "--xtc-probability", "1", "--xtc-threshold", "0.05")
    assert code == 0 and out != plain, err
    code, out, err = run_cli(*args, "--xtc-probability", "1", "--xtc-threshold", "0.5")
    assert code == 0 and out == plain, err


def test_prefill_response_starts_the_answer(run_cli, tmp_path):
    """--prefill-response (mlx-lm's): the answer begins with it and the model continues it;
    without a template that is the prompt's text and then it, through a chat template the
    assistant's message left open (continue_final_message)."""
    code, out, err = run_cli("generate", "-p", STORY, "--prefill-response", ", there was",
                             "-n", "16", "--no-stats")  # fmt: skip
    assert code == 0, err
    code, joined, _ = run_cli("generate", "-p", STORY + ", there was", "-n", "16", "--no-stats")
    assert out == joined
    from mlx_dflash.models.target import load_target
    from mlx_dflash.prompts import encode_prompt

    path = write_tiny_target(tmp_path / "t", "qwen3")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
        "{% if not loop.last or m['role'] != 'assistant' %}<|end|>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_target(path).tokenizer
    text = tok.decode(encode_prompt(tok, "Hi", prefill_response="Sure, 1 2"))
    assert text.endswith("<|user|>Hi<|end|><|assistant|>Sure, 1 2")


def test_every_mlx_lm_flag_is_taken_or_refused_with_its_reason(run_cli):
    """Issue 51's goal: each flag of mlx_lm.generate / chat / server is ours by the same name,
    or ends in one sentence naming what to type instead or why not (never 'No such option')."""
    from mlx_dflash.cli import MLX_LM_FLAGS

    for flag, why in MLX_LM_FLAGS.items():
        code, out, err = run_cli("generate", "-p", "x", flag, "1")
        assert (
            code == 1
            and not out
            and err.strip() == f"error: {flag} is mlx-lm's and not taken here: {why}."
        )
    taken = ["--model", "--prompt", "--max-tokens", "--temp", "--top-p", "--top-k", "--min-p",
             "--min-tokens-to-keep", "--xtc-probability", "--xtc-threshold", "--seed",
             "--extra-eos-token", "--prefill-step-size", "--system-prompt", "--max-kv-size",
             "--kv-bits", "--kv-group-size", "--quantized-kv-start", "--prompt-cache-file",
             "--prefill-response", "--verbose"]  # fmt: skip
    import typer

    from mlx_dflash.cli import app

    command = typer.main.get_command(app).commands["generate"]  # type: ignore[attr-defined]
    names = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
    assert set(taken) <= names, set(taken) - names
