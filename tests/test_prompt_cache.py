"""Prompt cache files (mlx-lm's --prompt-cache-file): `dflash-mlx cache`, chat's /save, and
`generate` / `chat --prompt-cache-file`. A run from a file prefills only what follows the
cached tokens and decodes exactly what a run without it decodes, drafts included; a file that
does not fit the run is one sentence, and nothing else is ever overwritten."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from oracle import diversify
from test_engine import random_drafter
from typer.testing import CliRunner

from mlx_dflash import prompt_cache
from mlx_dflash.cli import app
from mlx_dflash.engine import GenerationConfig, Session, generate_rounds
from mlx_dflash.engine.rounds import prefill
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.cache import KVQuantization
from mlx_dflash.models.target import load_target
from mlx_dflash.models.tiny import write_tiny_target
from mlx_dflash.paths import DEFAULT_TARGET

PREFIX = list(range(3, 40))
MORE = list(range(50, 62))


def rounds(session, ids, **kw):
    cfg = GenerationConfig(max_tokens=24, **{"mode": "ddtree", "budget": 8, **kw})
    out = list(generate_rounds(session, ids, cfg))
    return [t for r in out for t in r.tokens], [r.accepted for r in out], out[0].prefill_tokens


@pytest.mark.parametrize(
    "kind, kv, max_kv",
    [
        ("llama", None, None),
        ("qwen3_5", None, None),
        ("qwen3", KVQuantization(4, 64, 20), None),
        ("qwen3", None, 24),
        ("gemma4-31b", None, None),
    ],
)
def test_a_saved_session_goes_on_as_the_one_that_saved_it(kind, kv, max_kv, tmp_path):
    """Target caches (KV, recurrent, quantized, rotating, sliding-window) and the drafter's
    context survive the file: the restored session decodes the same tokens with the same
    acceptance, and prefills only the new part of the prompt."""
    if kind.startswith("gemma"):
        from families import write_family

        folder = write_family(tmp_path / kind, kind)
    else:
        folder = write_tiny_target(tmp_path / kind, kind, head_dim=64)
    target = load_target(folder)
    diversify(target.model)
    runner = random_drafter(target)
    first = Session(target, runner, kv, max_kv)
    prefill(first, PREFIX, GenerationConfig(mode="ddtree"))
    first.mark_prompt_end()
    path = tmp_path / "p.safetensors"
    prompt_cache.save(path, first, "m")
    saved, arrays = prompt_cache.read(path)
    assert saved.tokens == PREFIX and saved.kv == (None if kv is None else kv.__dict__)
    second = Session(target, type(runner)(runner.drafter, target), kv, max_kv)
    prompt_cache.restore(second, saved, arrays, folder)
    if max_kv is None and not kind.startswith("gemma"):  # (a KV setting the file does not hold)
        other = KVQuantization(8, 64, 20) if kv is None else None
        with pytest.raises(DFlashError, match="This prompt cache was made with --kv-bits"):
            prompt_cache.restore(Session(target, kv=other), saved, arrays, folder)
    want = rounds(first, PREFIX + MORE)
    got = rounds(second, PREFIX + MORE)
    assert got == want and got[2] == len(MORE)


def test_cache_then_generate_as_mlx_lm_continues_a_cached_prompt(tmp_path):
    """The embedded pair (no chat template): `cache` runs the text once; `generate
    --prompt-cache-file` continues it with the prompt, prefilling only the prompt's tokens,
    and writes what a run of the whole text writes; the drafter's context came along (the
    first round drafts, tau as without the file)."""
    path = tmp_path / "story.safetensors"
    runner = CliRunner()
    head, tail = "Once upon a time, there was a little girl named Lily", " She liked"
    r = runner.invoke(app, ["cache", "-p", head, "--prompt-cache-file", str(path)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["generate", "--prompt-cache-file", str(path), "-p", tail, "-n", "32",
                            "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    cached = json.loads(r.stdout)
    target = load_target(DEFAULT_TARGET)
    saved, _ = prompt_cache.read(path)
    ids = saved.tokens + target.tokenizer.encode(tail, add_special_tokens=False)
    whole = runner.invoke(app, ["generate", "-p", target.tokenizer.decode(ids), "-n", "32",
                                "--json", "--no-chat-template"])  # fmt: skip
    plain = json.loads(whole.stdout)
    assert cached["text"] == plain["text"]
    assert cached["prompt_tokens"] == len(ids) - len(saved.tokens)
    assert cached["acceptance_lengths"][0] > 1


def test_chat_save_and_resume_is_the_same_conversation(tmp_path):
    """chat's /save, then chat --prompt-cache-file and generate --prompt-cache-file: the next
    answer is the one the unbroken chat gives."""
    path = tmp_path / "talk.safetensors"
    runner = CliRunner()
    lines = lambda xs: "".join(f"{x}\n" for x in xs)  # noqa: E731
    one = runner.invoke(app, ["chat", "-n", "16"], input=lines(["Tell a story", "Go on"]))
    assert one.exit_code == 0
    want = one.stdout.splitlines()[-1]
    a = runner.invoke(app, ["chat", "-n", "16"], input=lines(["Tell a story", f"/save {path}"]))
    assert a.exit_code == 0 and f"to {path}" in a.stdout
    b = runner.invoke(app, ["chat", "-n", "16", "--prompt-cache-file", str(path)],
                      input=lines(["Go on"]))  # fmt: skip
    assert b.exit_code == 0 and b.stdout.splitlines()[-1] == want
    g = runner.invoke(app, ["generate", "-n", "16", "--prompt-cache-file", str(path), "-p",
                            "Go on", "--json"])  # fmt: skip
    assert g.exit_code == 0 and json.loads(g.stdout)["text"] == want


def test_a_file_that_does_not_fit_is_one_sentence(tmp_path, run_cli):
    weights = tmp_path / "model.safetensors"
    mx.save_safetensors(str(weights), {"w": mx.zeros((2,))})
    code, _, err = run_cli("cache", "-p", "Hi", "--prompt-cache-file", weights)
    assert code == 1 and "exists and is not a prompt cache; it is left as it is" in err
    assert mx.load(str(weights))["w"].shape == (2,)
    code, _, err = run_cli("generate", "-p", "Hi", "--prompt-cache-file", weights)
    assert code == 1 and "is not a prompt cache file of dflash-mlx" in err
    good = tmp_path / "c.safetensors"
    assert run_cli("cache", "-p", "Once upon", "--prompt-cache-file", good)[0] == 0
    code, _, err = run_cli("chat", "--prompt-cache-file", good)
    assert code == 1 and "continue it with generate --prompt-cache-file" in err
    other = write_tiny_target(tmp_path / "other", "llama")
    code, _, err = run_cli("generate", "-m", other, "--mode", "ar", "-p", "Hi",
                           "--prompt-cache-file", good)  # fmt: skip
    assert code == 1 and "made with another target" in err
