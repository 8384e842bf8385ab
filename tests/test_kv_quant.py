"""A quantized KV cache (mlx-lm's --kv-bits, --kv-group-size, --quantized-kv-start) under
verify and rewind: greedy output equals mlx-lm's generate_step with the same settings, token
for token, in every mode; rewinds move whole quantized rows."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from oracle import OracleDrafter, diversify
from test_engine import PROMPT, run

from mlx_dflash.engine import Session
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.cache import KVCache, KVQuantization, QuantizedKVCache
from mlx_dflash.models.target import load_target
from mlx_dflash.models.tiny import write_tiny_target

N = 48


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_5"])
def target(request, tmp_path_factory):
    # head_dim 64, as real targets have (quantization groups run along it)
    path = write_tiny_target(tmp_path_factory.mktemp(request.param), request.param, head_dim=64)
    target = load_target(path)
    assert target.layers[-1].self_attn.k_proj.weight.shape[0] == 2 * 64
    diversify(target.model)
    return target


def mlx_lm_greedy(target, prompt, n, kv: KVQuantization, prefill=512):
    steps = generate_step(
        mx.array(prompt),
        target.model,
        max_tokens=n,
        sampler=lambda x: mx.argmax(x, axis=-1),
        kv_bits=kv.bits,
        kv_group_size=kv.group_size,
        quantized_kv_start=kv.start,
        prefill_step_size=prefill,
    )
    return [int(t) for t, _ in steps]


def float_greedy(target, prompt, n):
    steps = generate_step(mx.array(prompt), target.model, max_tokens=n,
                          sampler=lambda x: mx.argmax(x, axis=-1))  # fmt: skip
    return [int(t) for t, _ in steps]


def saved_target(folder, kind: str, **overrides):
    """(folder, target): a tiny target whose folder holds diversified weights, for the CLI and
    serve to load as they would a user's."""
    from mlx_lm.utils import save_model

    path = write_tiny_target(folder, kind, **overrides)
    target = load_target(path)
    diversify(target.model)
    save_model(path, target.model)
    return path, target


def until_eos(target, ids: list[int]) -> str:
    """The text of greedy ids up to the first end of text (where serve's answer stops)."""
    eos = target.tokenizer.eos_token_id
    return target.tokenizer.decode(ids[: ids.index(eos)] if eos in ids else ids)


def served_batch(tmp_path, path, prompts: list[str], n: int, **config):
    """serve (ddtree rows batched, a random drafter) answering `prompts` at once: the texts and
    the cache types of a session it kept."""
    from concurrent.futures import ThreadPoolExecutor

    from test_serve import openai, serving

    from mlx_dflash.models.tiny import drafter_config_dict, write_drafter_checkpoint

    cfg = json.loads((path / "config.json").read_text())
    drafter = write_drafter_checkpoint(
        tmp_path / "d", drafter_config_dict("toplevel_block_size", cfg, block_size=8)
    )
    with serving(str(path), str(drafter), mode="ddtree", max_batch=4, **config) as (app, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

        def ask(p):
            return client.completions.create(model="tiny", prompt=p, max_tokens=n).choices[0]

        with ThreadPoolExecutor(len(prompts)) as pool:
            texts = [c.text for c in pool.map(ask, prompts)]
        return texts, {type(c) for c in app.pool.idle[0].cache}


# start 0: quantized from the first forward on; 20: inside the prompt (a prefill chunk of
# 16 crosses it); 39: the prompt's last token (its own forward in mlx-lm, quantized); 45 and
# 52: during generation, where verifies cross it.
KVS = [KVQuantization(4, 32, 0), KVQuantization(4, 64, 20), KVQuantization(4, 32, 39),
       KVQuantization(2, 32, 45), KVQuantization(8, 32, 52)]  # fmt: skip


@pytest.mark.parametrize("kv", KVS, ids=lambda k: f"{k.bits}bit-g{k.group_size}-from{k.start}")
@pytest.mark.parametrize("mode", ["ar", "dflash", "ddtree", "ddtree-auto"])
def test_greedy_equals_mlx_lm_with_the_same_kv_bits(target, kv, mode):
    ref = mlx_lm_greedy(target, PROMPT, N, kv, prefill=16)
    target.set_taps([0, 1])
    drafter = None
    if mode != "ar":
        drafter = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8, corrupt=0.3, seed=2)
    budget = {"ar": None, "dflash": None, "ddtree": 16, "ddtree-auto": "auto"}[mode]
    out, _ = run(Session(target, drafter, kv=kv), PROMPT, max_tokens=N, mode=mode.split("-")[0],
                 budget=budget, prefill_chunk=16)  # fmt: skip
    assert out == ref


def test_lookup_mode_equals_mlx_lm_too(target):
    kv = KVQuantization(4, 64, 45)
    prompt = PROMPT + PROMPT[:20]  # text to look up
    ref = mlx_lm_greedy(target, prompt, N, kv)
    out, _ = run(Session(target, None, kv=kv), prompt, max_tokens=N, mode="lookup")
    assert out == ref


@pytest.mark.parametrize("keep", [[0, 2, 3, 7], [0, 1, 2], [0], "device"])
def test_compact_keeps_the_accepted_rows_in_order(keep):
    """A float cache after a tree verify: the accepted rows follow the prefix in path order,
    whether they move, are already the verify's first rows (a trim: nothing moves), or come
    as a device array."""
    rng = np.random.default_rng(1)
    prefix, tree = (mx.array(rng.normal(size=(1, 2, n, 8)).astype(np.float32)) for n in (5, 9))
    cache = KVCache()
    cache.append(prefix, prefix)
    cache.append(tree, 2 * tree)
    path = [0, 3, 4] if keep == "device" else keep
    cache.compact(5, mx.array(path, dtype=mx.int32) if keep == "device" else keep)
    assert cache.offset == 5 + len(path)
    keys, values = (a[:, :, : cache.offset] for a in cache.state_arrays)
    assert mx.array_equal(keys, mx.concatenate([prefix, tree[:, :, path]], axis=2))
    assert mx.array_equal(values, mx.concatenate([prefix, 2 * tree[:, :, path]], axis=2))


def test_a_rewind_moves_whole_quantized_rows():
    """After a tree verify, compact keeps the accepted rows: each is exactly the quantization
    of that token's keys, as if the rejected ones had never been written, and the rows a
    forward reads are the `offset` written ones."""
    rng = np.random.default_rng(0)
    kv = KVQuantization(4, 32, 0)
    rows = lambda n: mx.array(rng.normal(size=(1, 2, n, 64)).astype(np.float32))  # noqa: E731
    prefix, tree = rows(5), rows(9)
    cache = QuantizedKVCache(kv)
    cache.append(prefix, prefix)  # (float: a cache's first forward)
    keys, _ = cache.append(tree, tree)  # quantized from here on
    assert cache.quantized and keys[0].shape[2] == 14
    keep = [0, 2, 3, 7]
    cache.compact(5, keep)
    want = mx.concatenate([prefix, tree[:, :, keep]], axis=2)
    for got, ref in zip(cache.packed[0], cache.quantize(want), strict=True):
        assert mx.array_equal(got[:, :, :9], ref)
    cache.trim(7)
    keys, values = cache.append(rows(2), rows(2))
    assert keys[0].shape[2] == 9 and cache.offset == 9
    plain = KVCache()
    plain.append(want, want)
    # 4 bits and a float32 scale and bias per 32 values: 6 / 32 of float32's bytes
    assert cache.nbytes == sum(a.nbytes for a in plain.state_arrays) * 6 // 32


def test_targets_it_cannot_quantize_are_refused_in_one_sentence(tmp_path):
    from families import write_family

    windowed = load_target(write_family(tmp_path / "g", "gemma4-31b"))
    with pytest.raises(DFlashError, match="does not apply to this target's sliding-window"):
        Session(windowed, kv=KVQuantization(4, 32))
    with pytest.raises(DFlashError, match="--kv-bits must be 2, 3, 4, 5, 6 or 8, not 7"):
        KVQuantization(7)
    with pytest.raises(DFlashError, match="--kv-group-size must be 32, 64 or 128"):
        KVQuantization(4, 16)


def test_the_flags_on_generate_as_mlx_lm_reads_them(run_cli, tmp_path):
    """generate --kv-bits / --kv-group-size / --quantized-kv-start: mlx-lm's output, and a
    head dimension the group does not divide is one sentence, before any output."""
    path, target = saved_target(tmp_path / "t", "llama", head_dim=64)
    prompt = list(range(3, 30))
    ids = " ".join(map(str, prompt))
    kv = KVQuantization(4, 32, 10)
    want = mlx_lm_greedy(target, target.tokenizer.encode(ids), 16, kv)
    assert want != float_greedy(target, target.tokenizer.encode(ids), 16)
    code, out, err = run_cli("generate", "-m", path, "-p", ids, "-n", 16, "--mode", "ar",
                             "--no-chat-template", "--json", "--kv-bits", 4,
                             "--kv-group-size", 32, "--quantized-kv-start", 10)  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["text"] == target.tokenizer.decode(want)
    code, out, err = run_cli("generate", "-m", path, "-p", ids, "--mode", "ar",
                             "--kv-bits", 4, "--kv-group-size", 128)  # fmt: skip
    assert code == 1 and not out
    assert err.strip() == ("error: --kv-group-size 128 does not divide this target's head "
                           "dimension of 64 (quantization groups run along it).")  # fmt: skip


def test_serve_batches_quantized_rows_as_mlx_lm_decodes_them(tmp_path):
    """serve --kv-bits: each answer of a batch (ddtree rounds of several requests in one
    packed forward) is mlx-lm's with the same settings."""
    path, target = saved_target(tmp_path / "t", "qwen3", head_dim=64)
    kv = KVQuantization(4, 64, 12)
    prompts = [" ".join(map(str, range(i, i + 14))) for i in (3, 40, 90)]
    want = []
    for p in prompts:
        ids = mlx_lm_greedy(target, target.tokenizer.encode(p), 20, kv)
        want.append(until_eos(target, ids))
        assert ids != float_greedy(target, target.tokenizer.encode(p), 20)
    got, kinds = served_batch(tmp_path, path, prompts, 20, kv=kv)
    assert kinds == {QuantizedKVCache}
    assert got == want
