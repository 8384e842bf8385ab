"""Gemma 4, gpt-oss, MiniMax M2.x, GLM-4 MoE and MiMo-V2-Flash targets under verification:
greedy output token-identical to plain mlx-lm (its own rotating caches, sinks and routing) in
DFlash and DDTree at budgets 1, 4, 16 and 64, with and without lookup; sampling in
distribution on a sliding-window family and a sink family; sliding layers keep a bounded
cache; the families mlx-lm runs that cannot be verified are refused in one sentence."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from families import FAMILIES, FIXTURES, SLIDING, WINDOW, build, shrink, write_family
from oracle import OracleDrafter
from test_engine import mlx_lm_greedy, run
from test_sampling import chi2_pvalue, token_probs

from mlx_dflash.engine import GenerationConfig, Session, generate_rounds
from mlx_dflash.engine.contract import Pass
from mlx_dflash.engine.sampling import SamplingParams
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.cache import WindowedKVCache
from mlx_dflash.models.families import ARCHITECTURES, architecture
from mlx_dflash.models.target import Target, load_target

PROMPT = [5, 17, 3, 88, 41, 9, 120, 64, 33, 7, 200, 150, 12, 99, 45, 6, 71, 18, 230, 4]
N = 48
MODES = [("dflash", 1, 0), ("lookup", 16, 4)] + [
    ("ddtree", b, lookup) for b in (1, 4, 16, 64) for lookup in (0, 4)
]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, loaded target, mlx-lm's own greedy continuation)."""
    name = request.param
    target = load_target(write_family(tmp_path_factory.mktemp(name), name))
    target.set_taps([1, target.num_layers - 1])  # the last layer too, as MiMo's drafter taps
    return name, target, mlx_lm_greedy(target, PROMPT, N)


def test_every_registered_family_has_a_fixture():
    """A family is one ARCHITECTURES entry plus one fixture (tests/families.py FIXTURES)."""
    assert sorted(FIXTURES) == sorted(ARCHITECTURES)


@pytest.mark.parametrize("model_type", sorted(FIXTURES))
def test_each_familys_forward_is_mlx_lms(model_type, tmp_path):
    """Each fixture loads as its own family, and our layer loop's logits over a prompt longer
    than any shrunk sliding window are mlx-lm's own model's: the entry's attention variant,
    block, embedding and logit transforms and sliding rule are the family's."""
    target = load_target(FIXTURES[model_type](tmp_path))
    assert target.model_type == model_type
    ours, _ = target.forward([Pass(mx.array(PROMPT), target.make_cache(), 0, taps=False)])[0]
    theirs = target.model(mx.array(PROMPT)[None])[0]
    np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=1e-4, atol=1e-4)


def test_fixture_is_the_published_config_shrunk():
    """Only sizes and ids change; every published field stays, nested where it was."""
    for name, cfg in FAMILIES.items():
        small = shrink(cfg)
        assert set(small) == set(cfg), name
        if "text_config" in cfg:
            assert set(small["text_config"]) >= set(cfg["text_config"]), name


def test_greedy_is_mlx_lms_in_every_mode(family):
    name, target, ref = family
    assert len(set(ref)) > 8, f"{name}: the fixture's greedy continuation is degenerate"
    for mode, budget, lookup in MODES:
        oracle = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8, corrupt=0.3, seed=1)
        out, taus = run(
            Session(target, oracle), PROMPT, max_tokens=N, mode=mode, budget=budget, lookup=lookup
        )
        assert out == ref, (name, mode, budget, lookup)
        if mode != "lookup" and (budget > 1 or mode == "dflash"):
            assert np.mean(taus) > 1.5, (name, mode, budget, lookup)


def test_sliding_layers_keep_a_bounded_cache(family):
    """Past the window, a sliding layer holds about two windows and a verify, never the whole
    sequence; global layers hold everything."""
    name, target, ref = family
    if name not in SLIDING:
        pytest.skip("no sliding-window layers")
    session = Session(target, OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8))
    run(session, PROMPT, max_tokens=N, mode="ddtree", budget=16)
    total = len(PROMPT) + N
    windowed = [c for c in session.cache if isinstance(c, WindowedKVCache)]
    assert windowed and len(windowed) < len(session.cache)
    for c in windowed:
        assert c.end >= total - 1 and c.offset <= 2 * WINDOW + 16, (c.end, c.offset)
    for c in session.cache:
        if not isinstance(c, WindowedKVCache):
            assert c.offset >= total - 1


def test_prefix_reuse_across_the_window(family):
    """A second turn that shares the first prompt reuses what the windowed caches still hold
    (or starts over), and decodes exactly as a fresh session would."""
    name, target, ref = family
    if name not in SLIDING:
        pytest.skip("no sliding-window layers")
    oracle = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8, corrupt=0.2)
    session = Session(target, oracle)
    run(session, PROMPT, max_tokens=N, mode="ddtree", budget=8)
    second = PROMPT + ref[:30]
    again, _ = run(session, second, max_tokens=12, mode="ddtree", budget=8)
    assert again == ref[30:42]


def marginals(target, prompt, sampling, depth, vocab):
    """The target's exact marginal distribution of tokens 1..depth (every prefix enumerated,
    through mlx-lm's own forward with its windowed masks)."""
    marg, prefixes, weights = [], [()], np.array([1.0])
    for _ in range(depth):
        logits = target.model(mx.array([prompt + list(p) for p in prefixes]))[:, -1, :]
        joint = weights[:, None] * token_probs(logits, sampling)
        marg.append(joint.sum(axis=0))
        prefixes = [p + (t,) for p in prefixes for t in range(vocab)]
        weights = joint.reshape(-1)
    return marg


@pytest.mark.parametrize("name", ["gemma4-26b-a4b", "gpt-oss-20b"])
def test_sampling_stays_in_distribution(name):
    """Tokens 2 and 3 come from a DDTree round (token 1 from the prefill): over many seeds their
    frequencies match the target's exact marginals (chi-square), past the sliding window, on
    a sliding-window MoE family and a sink family."""
    V, depth = 24, 3
    cfg = shrink(FAMILIES[name])
    text = cfg.get("text_config", cfg)
    text["vocab_size"] = cfg["vocab_size"] = V
    target = Target(build(cfg, seed=2), None, cfg)
    target.set_taps([1, 4])
    prompt = [3, 9, 4, 17, 5, 11, 20, 7, 2, 13, 6, 19]  # longer than the window
    sampling = SamplingParams(1.0)
    truth = prompt + mlx_lm_greedy(target, prompt, depth)
    samples, taus = [], []
    for seed in range(500):
        oracle = OracleDrafter(truth, V, block_size=4, corrupt=0.5, seed=seed, margin=1.0)
        gen = GenerationConfig(max_tokens=depth, sampling=sampling, seed=seed, mode="ddtree",
                               budget=4)  # fmt: skip
        out = []
        for r in generate_rounds(Session(target, oracle), prompt, gen):
            out += r.tokens
            taus += [] if r.prefill else [r.accepted]
        samples.append(out[:depth])
    samples_np = np.array(samples)
    assert 1.0 < np.mean(taus) < 3.0, "both acceptance and rejection must be exercised"
    for k, expected in enumerate(marginals(target, prompt, sampling, depth, V)):
        assert chi2_pvalue(samples_np[:, k], expected) > 1e-3, f"{name}: token {k + 1} is biased"


@pytest.mark.parametrize(
    "config, words",
    [
        ({"model_type": "glm_moe_dsa"}, "DSA sparse attention"),
        ({"model_type": "gemma4", "text_config": {"model_type": "gemma4_text"}}, "E2B"),
        ({"model_type": "mimo_v2"}, "not supported"),
    ],
)
def test_unverifiable_families_are_refused_in_one_sentence(config, words, tmp_path, run_cli):
    with pytest.raises(DFlashError, match=words):
        architecture(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli("generate", "-m", str(tmp_path), "--prompt", "hi", "--mode", "ar")
    assert code != 0 and words in err and "Traceback" not in err


def test_openais_mxfp4_release_layout_loads_and_runs_exactly(tmp_path):
    """gpt-oss as OpenAI publishes it (MXFP4 experts as `_blocks` / `_scales` bytes, gate and
    up interleaved, a `quant_method: mxfp4` quantization_config) loads through mlx-lm's own
    sanitize into the same model as mlx-community's copy, and decodes exactly."""
    hf = load_target(write_family(tmp_path / "hf", "gpt-oss-20b", layout="hf"))
    mlx = load_target(write_family(tmp_path / "mlx", "gpt-oss-20b"))
    ref = mlx_lm_greedy(hf, PROMPT, N)
    assert ref == mlx_lm_greedy(mlx, PROMPT, N)
    hf.set_taps([1, 5])
    for mode, budget, lookup in [("dflash", 1, 0), ("ddtree", 16, 4)]:
        oracle = OracleDrafter(PROMPT + ref, hf.vocab_size, block_size=8, corrupt=0.3)
        out, _ = run(
            Session(hf, oracle), PROMPT, max_tokens=N, mode=mode, budget=budget, lookup=lookup
        )
        assert out == ref, (mode, budget)


def test_gemma_drafters_read_the_scaled_embeddings(family):
    """z-lab's drafters call the target's `embed_tokens`; Hugging Face's Gemma embedding
    module multiplies by sqrt(hidden_size) itself, so the drafter reads scaled rows there and
    raw rows elsewhere."""
    name, target, _ = family
    ids = mx.array([3, 7, 11])
    raw = target.inner.embed_tokens(ids)
    scale = target.hidden_size**0.5 if name.startswith("gemma4") else 1.0
    assert mx.allclose(target.token_embeddings(ids), raw * scale).item()


def test_minimaxs_fp8_release_converts_and_runs_exactly(tmp_path, run_cli):
    """MiniMax as released (FP8 e4m3 blocks with inverse scales, experts one by one) converts
    through mlx-lm's own dequantization to a float32 folder that keeps the FP8 values and
    decodes exactly."""
    hf = write_family(tmp_path / "hf", "minimax-m2", layout="hf")
    code, _, err = run_cli("convert", hf, "--out", tmp_path / "mlx", "--dtype", "float32")
    assert code == 0, err
    target = load_target(tmp_path / "mlx")
    codes = mx.load(str(hf / "model.safetensors"))
    q = codes["model.layers.0.self_attn.q_proj.weight"]
    scale = codes["model.layers.0.self_attn.q_proj.weight_scale_inv"][0, 0]
    expect = (mx.from_fp8(q, dtype=mx.bfloat16) * scale).astype(mx.float32)
    got = target.layers[0].self_attn.q_proj.weight
    assert got.dtype == mx.float32 and mx.allclose(got, expect, rtol=1e-2, atol=1e-6).item()
    ref = mlx_lm_greedy(target, PROMPT, N)
    target.set_taps([1, 5])
    oracle = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8, corrupt=0.3)
    out, _ = run(Session(target, oracle), PROMPT, max_tokens=N, mode="ddtree", budget=16)
    assert out == ref and len(set(ref)) > 8


@pytest.mark.parametrize("name", ["minimax-m2", "mimo-v2-flash"])
def test_nvfp4_conversions_run_exactly(name, tmp_path):
    """MLX conversions in NVFP4 (`mlx_lm.convert --q-mode nvfp4`, every linear layer and the
    experts), a MoE family with and one without sliding windows: exact in DDTree with lookup."""
    target = load_target(write_family(tmp_path / name, name, layout="nvfp4"))
    assert target.layers[1].self_attn.q_proj.mode == "nvfp4"
    ref = mlx_lm_greedy(target, PROMPT, N)
    target.set_taps([1, 5])
    oracle = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8, corrupt=0.3)
    out, _ = run(Session(target, oracle), PROMPT, max_tokens=N, mode="ddtree", budget=16, lookup=4)
    assert out == ref and len(set(ref)) > 8
