"""A rotating KV cache (mlx-lm's --max-kv-size: at most N positions, the first 4 kept) under
verify and rewind: greedy output equals mlx-lm's generate_step with the same max_kv_size,
token for token, in every mode, through all of mlx-lm's regimes (prompt chunks before the
limit, across it, past it; the last prompt token alone; one-token steps in the ring)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import RotatingKVCache
from oracle import OracleDrafter, diversify
from test_engine import PROMPT, run
from test_kv_quant import saved_target, served_batch, until_eos

from mlx_dflash.engine import Session
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.target import load_target
from mlx_dflash.models.tiny import write_tiny_target

N = 48


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target(request, tmp_path_factory):
    path = write_tiny_target(tmp_path_factory.mktemp(request.param), request.param)
    target = load_target(path)
    diversify(target.model)
    return target


def mlx_lm_greedy(target, prompt, n, max_kv_size, prefill=16):
    """mlx-lm's decoding with its rotating cache (keep=4, as make_prompt_cache makes it for
    --max-kv-size; built here, since mlx-lm's llama makes its own cache and ignores the flag)."""
    cache = None
    if max_kv_size is not None:
        cache = [RotatingKVCache(max_size=max_kv_size, keep=4) for _ in target.model.layers]
    steps = generate_step(mx.array(prompt), target.model, max_tokens=n, prompt_cache=cache,
                          sampler=lambda x: mx.argmax(x, axis=-1), prefill_step_size=prefill)  # fmt: skip
    return [int(t) for t, _ in steps]


@pytest.mark.parametrize("size", [12, 20, 24, 33, 64])
@pytest.mark.parametrize("mode", ["ar", "dflash", "ddtree", "ddtree-auto"])
def test_greedy_equals_mlx_lm_with_the_same_max_kv_size(target, size, mode):
    ref = mlx_lm_greedy(target, PROMPT, N, size)
    target.set_taps([0, 1])
    drafter = None
    if mode != "ar":
        drafter = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8, corrupt=0.3, seed=2)
    budget = {"ar": None, "dflash": None, "ddtree": 16, "ddtree-auto": "auto"}[mode]
    session = Session(target, drafter, max_kv_size=size)
    out, _ = run(session, PROMPT, max_tokens=N, mode=mode.split("-")[0], budget=budget,
                 prefill_chunk=16)  # fmt: skip
    assert out == ref
    cache = session.cache[0]  # bounded: the window, its amortised slack and a verify
    assert cache.offset <= 2 * size + 16 and cache.keys.shape[2] <= cache.offset + 256


def test_the_limit_changes_the_output():
    """(So the test above can fail: a small window is not the full cache.)"""
    import tempfile

    t = load_target(write_tiny_target(tempfile.mkdtemp(), "llama"))
    diversify(t.model)
    assert mlx_lm_greedy(t, PROMPT, N, 12) != mlx_lm_greedy(t, PROMPT, N, None)


def test_what_it_cannot_bound_is_refused(tmp_path):
    hybrid = load_target(write_tiny_target(tmp_path / "h", "qwen3_5"))
    with pytest.raises(DFlashError, match="--max-kv-size applies to targets of attention layers"):
        Session(hybrid, max_kv_size=64)
    from mlx_dflash.models.cache import KVQuantization

    plain = load_target(write_tiny_target(tmp_path / "p", "llama", head_dim=64))
    with pytest.raises(DFlashError, match="do not go together"):
        Session(plain, kv=KVQuantization(4), max_kv_size=64)
    with pytest.raises(DFlashError, match="must be more than 4"):
        Session(plain, max_kv_size=4)


def test_the_flag_on_generate_and_a_prompt_cache_keep_it(run_cli, tmp_path):
    """generate --max-kv-size: mlx-lm's output; `cache` saves the rotating rows and a run from
    the file takes the size from it, or refuses another."""
    import json

    path, target = saved_target(tmp_path / "t", "qwen3")
    text = " ".join(map(str, range(3, 40)))
    ids = target.tokenizer.encode(text)
    want = mlx_lm_greedy(target, ids, 24, 20, prefill=512)
    assert want != mlx_lm_greedy(target, ids, 24, None, prefill=512)
    code, out, err = run_cli("generate", "-m", path, "-p", text, "-n", 24, "--mode", "ar",
                             "--no-chat-template", "--json", "--max-kv-size", 20)  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["text"] == target.tokenizer.decode(want)
    saved = tmp_path / "c.safetensors"
    code, _, err = run_cli("cache", "-m", path, "--mode", "ar", "--no-chat-template", "-p", text,
                           "--max-kv-size", 20, "--prompt-cache-file", saved)  # fmt: skip
    assert code == 0, err
    code, out, err = run_cli("generate", "--prompt-cache-file", saved, "-p", " 41", "-n", 8,
                             "--mode", "ar", "--json")  # fmt: skip
    assert code == 0, err
    code, _, err = run_cli("generate", "--prompt-cache-file", saved, "-p", " 41", "-n", 8,
                           "--mode", "ar", "--max-kv-size", 30)  # fmt: skip
    assert code == 1 and "made with --max-kv-size 20; give the same" in err


def test_serve_batches_rotating_rows_as_mlx_lm_decodes_them(tmp_path):
    """serve --max-kv-size: each answer of a batch of ddtree rows is mlx-lm's."""
    from mlx_dflash.models.cache import RotatingKVCache as Ours

    path, target = saved_target(tmp_path / "t", "qwen3")
    prompts = [" ".join(map(str, range(i, i + 14))) for i in (3, 40, 90)]
    want = [until_eos(target, mlx_lm_greedy(target, target.tokenizer.encode(p), 24, 16, 512))
            for p in prompts]  # fmt: skip
    got, kinds = served_batch(tmp_path, path, prompts, 24, max_kv_size=16)
    assert kinds == {Ours}
    assert got == want
