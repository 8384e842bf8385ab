"""Published DFlash (1) drafter layouts beyond z-lab's first exports (issue 33, item 2).

- the re-released Qwen3.5 drafters: sliding + full layers, 8 taps, block size in dflash_config,
  rope in rope_parameters (verbatim z-lab/Qwen3.5-4B-DFlash config);
- MiMo's: `use_swa` / `swa_window_size`, per-head sink logits, a value scale, `v_head_dim`,
  partial RoPE, and a tap of the target's last layer (verbatim MiMo-V2.5-Pro-FP4-DFlash config);
- Muse Glimmer's v1 assistant: its own architecture name, top-level fields, `encoder.*` tensor
  names (verbatim config and safetensors header);
- gpt-oss's (attention biases), Gemma 4's (soft cap, tied config), Kimi-K2.6's (YaRN with
  mscale fields): the field sets ../shared/data/configs/SOURCES.md documents.

Each published config is shrunk (sizes and token ids only; taps by the published rule, which
every config but MiMo's follows) and loads; its drafts equal an independent NumPy reference
(tests/drafter_reference.py); DFlash and DDTree output equals the target's own greedy decoding;
converting keeps the drafts; a config that cannot run gets one sentence.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import drafter_reference as R
import mlx.core as mx
import numpy as np
import pytest
from families import FAMILIES, write_family
from mlx.utils import tree_flatten
from oracle import diversify
from published import MUSE_GLIMMER_30B, QWEN3_5_4B, published_file, write_published
from test_engine import mlx_lm_greedy, run

from mlx_dflash.checkpoints.convert import convert_drafter
from mlx_dflash.checkpoints.read import check_pair, drafter_weight_shapes
from mlx_dflash.engine import Session
from mlx_dflash.engine.contract import Pass
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.drafter import DrafterRunner, load_drafter
from mlx_dflash.models.drafter_config import UNUSED_DFLASH_FIELDS, DrafterConfig
from mlx_dflash.models.target import Target, load_target
from mlx_dflash.models.tiny import _published_taps, write_drafter_checkpoint, write_tiny_target

PROMPT = list(range(3, 33))
N = 32
VOCAB, WINDOW = 256, 8  # the tiny vocabulary; shrunk sliding windows, so the tests pass them
SMALL = {  # every size a published config has, shrunk; nothing is added
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "v_head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": VOCAB,
}
QWEN3_5_4B_FILE = "z-lab__Qwen3.5-4B-DFlash.config.json"
MIMO_FILE = "XiaomiMiMo__MiMo-V2.5-Pro-FP4-DFlash.config.json"
MUSE_FILE = "meta-models__Muse-Glimmer-30B-assistant.config.json"
MUSE_HEADER = "meta-models__Muse-Glimmer-30B-assistant.safetensors-header.json"

# No verbatim copy of these three was found; each holds the fields SOURCES.md documents for it,
# nothing more. A size it does not state is None (only the shrunk size is ever used); the
# architecture is the one every z-lab DFlash 1 export declares (algorithm.md §1); where a field
# sits (top level or dflash_config) is not documented, and both are read.
GPT_OSS_20B = {  # SOURCES.md "gpt-oss-20b-DFlash" (rev d53f6551...) + the specs table row
    "architectures": ["DFlashDraftModel"],
    "model_type": "gpt_oss",
    "attention_bias": True,
    "bos_token_id": 199998,
    "eos_token_id": 200002,
    "rope_theta": 150000,
    "max_position_embeddings": 131072,
    "initial_context_length": 4096,
    "num_hidden_layers": 8,
    "hidden_size": 2880,
    "intermediate_size": 7680,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "layer_types": ["full_attention"] * 8,
    "block_size": 8,
    "dflash_config": {"mask_token_id": 200000, "target_layer_ids": [1, 6, 11, 16, 21]},
    "num_target_layers": 24,  # gpt-oss-20b's layers, which the taps are spread over
}
GEMMA_4_31B = {  # SOURCES.md "gemma-4-31B-it-DFlash" (rev eabd6483...) + the specs table row
    "architectures": ["DFlashDraftModel"],
    "num_hidden_layers": 5,
    "hidden_size": 5376,
    "intermediate_size": 10752,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
    "sliding_window": 2048,
    "block_size": 16,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "final_logit_softcapping": 30.0,
    "tie_word_embeddings": True,
    "vocab_size": 262144,
    "dflash_config": {"mask_token_id": 4, "target_layer_ids": [1, 12, 23, 35, 46, 57]},
    "num_target_layers": 60,
}
KIMI_K2_6 = {  # SOURCES.md "Kimi-K2.6-DFlash" (rev c1462ef4..., from a tt-metal config)
    "architectures": ["DFlashDraftModel"],
    "num_hidden_layers": 6,
    "hidden_size": 7168,
    "intermediate_size": None,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_target_layers": 61,
    "rms_norm_eps": 1e-05,
    "block_size": 8,
    "dflash_config": {"mask_token_id": 163838, "target_layer_ids": [1, 12, 24, 35, 47, 58]},
    "rope_parameters": {
        "rope_theta": 50000,
        "rope_type": "yarn",
        "factor": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_max_position_embeddings": 4096,
        "mscale": 1,
        "mscale_all_dim": 1,
    },
}


def published(name: str) -> dict:
    """A published drafter config at full size: a verbatim file, or a SOURCES.md field set."""
    sources = {"gpt-oss-20b": GPT_OSS_20B, "gemma-4-31b-it": GEMMA_4_31B, "kimi-k2.6": KIMI_K2_6}
    if name in sources:
        return copy.deepcopy(sources[name])
    files = {"qwen3.5-4b": QWEN3_5_4B_FILE, "mimo-v2.5-pro": MIMO_FILE, "muse-assistant": MUSE_FILE}
    return published_file(files[name])


def shrink(cfg: dict, target_layers: int) -> dict:
    """Sizes and token ids shrunk to the tiny target; taps by the published rule, except that
    MiMo's (which taps the first and the last layer) are scaled onto the target's layers."""
    out = copy.deepcopy(cfg)
    out.update({k: v for k, v in SMALL.items() if k in out})
    d = out.get("dflash_config") or out  # Muse's assistant has its fields at the top level
    if out.get("sliding_window"):
        out["sliding_window"] = WINDOW
    if "swa_window_size" in d:
        d["swa_window_size"] = WINDOW
    full_layers = out.get("num_target_layers")
    if full_layers is not None:
        out["num_target_layers"] = target_layers
    taps = d["target_layer_ids"]
    if full_layers is not None and taps[-1] == full_layers - 1:
        d["target_layer_ids"] = [round(t * (target_layers - 1) / (full_layers - 1)) for t in taps]
    else:
        d["target_layer_ids"] = _published_taps(target_layers, len(taps))
    if d["mask_token_id"] >= VOCAB:
        d["mask_token_id"] = VOCAB - 1
    for key, tiny in (("bos_token_id", 1), ("eos_token_id", 2), ("pad_token_id", VOCAB - 2)):
        if out.get(key) is not None:
            out[key] = tiny
    return out


# name -> the tiny target it drafts for: Qwen3.5's hybrid, Muse Glimmer's own family, else a
# qwen3 (tied like Gemma's, untied like the others')
VARIANTS = {
    "qwen3.5-4b": "qwen3_5",
    "mimo-v2.5-pro": "qwen3",
    "muse-assistant": "muse",
    "gpt-oss-20b": "gpt-oss-20b",  # tests/families.py: the drafters' own target families
    "gemma-4-31b-it": "gemma4-31b",
    "kimi-k2.6": "kimi_k25",  # tests/test_mla.py's Kimi-K2.5 fixture: the same target family
}


def write_target(root: Path, kind: str) -> Path:
    if kind in FAMILIES:
        return write_family(root, kind)
    if kind == "kimi_k25":  # clear of MoE routing ties, as tests/test_distributed.py draws it
        from test_mla import CONFIGS, build, clear_of_ties, save_folder

        cfg = CONFIGS[kind]
        target, _ = clear_of_ties(lambda seed: Target(build(cfg, seed), None, cfg), N, margin=1e-2)
        return save_folder(root, target.model, cfg)
    if kind == "muse":
        return write_published(root, "meta-models/Muse-Glimmer-30B", "hf")
    if kind == "qwen3_5":
        return write_tiny_target(root, "qwen3_5", num_hidden_layers=12)
    return write_tiny_target(root, "qwen3", num_hidden_layers=8)


def as_release(folder: Path) -> Path:
    """MiMo's drafter as released: `model.`-prefixed names in two `dflash_draft_model-*`
    shards that only the index names (ik_llama.cpp PR #2048 describes the layout)."""
    weights = mx.load(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(weights)
    index: dict = {"metadata": {}, "weight_map": {}}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        fname = f"dflash_draft_model-{i + 1:05d}-of-00002.safetensors"
        mx.save_safetensors(str(folder / fname), {f"model.{k}": weights[k] for k in part})
        index["weight_map"].update({f"model.{k}": fname for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """Each tiny target once, with varied greedy output: (Target, raw config, reference)."""
    made: dict = {}

    def get(kind: str):
        if kind not in made:
            folder = write_target(tmp_path_factory.mktemp(kind), kind)
            target = load_target(folder)
            if kind not in FAMILIES and kind != "kimi_k25":  # those come with fit weights
                diversify(target.model)
            raw = json.loads((folder / "config.json").read_text())
            made[kind] = (target, raw, mlx_lm_greedy(target, PROMPT, N))
        return made[kind]

    return get


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, targets, tmp_path_factory):
    """(target, its raw config, the shrunk drafter's folder and raw config, the target's own
    greedy continuation of PROMPT)."""
    name = request.param
    target, raw, ref = targets(VARIANTS[name])
    cfg = shrink(published(name), target.num_layers)
    folder = write_drafter_checkpoint(tmp_path_factory.mktemp(name), cfg, seed=7)
    if name == "mimo-v2.5-pro":
        as_release(folder)
    return target, raw, folder, cfg, ref


def runner_of(target, raw, folder) -> DrafterRunner:
    drafter = load_drafter(folder, target_config=raw)
    target.set_taps(drafter.cfg.target_layer_ids)
    return DrafterRunner(drafter, target)


# --- the published configs, at full size ------------------------------------------------------


def test_published_configs_resolve():
    qwen = DrafterConfig.from_dict(published("qwen3.5-4b"))
    assert qwen.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert (qwen.block_size, qwen.sliding_window, qwen.rope_theta) == (16, 4096, 1e7)
    assert qwen.layer_is_causal(0) and not qwen.layer_is_causal(5) and qwen.num_taps == 8

    mimo = DrafterConfig.from_dict(published("mimo-v2.5-pro"))
    assert mimo.layer_types == ["sliding_attention"] * 5 and mimo.sliding_window == 1024
    assert not any(mimo.layer_is_causal(i) for i in range(5))  # use_swa: non-causal
    assert mimo.attention_sink_bias and mimo.attention_value_scale == 0.612
    assert (mimo.rotary_dims, mimo.value_head_dim, mimo.rope_theta) == (64, 128, 10000.0)
    assert mimo.target_layer_ids[-1] == mimo.num_target_layers - 1 == 69

    muse = DrafterConfig.from_dict(published("muse-assistant"))
    assert muse.kind == "dflash" and muse.vocab_size is None and muse.block_size == 16
    assert muse.target_layer_ids == [1, 13, 25, 37, 49] and muse.mask_token_id == 201818
    assert muse.layer_types == ["sliding_attention"] * 5 and muse.rope_theta == 500000.0

    assert DrafterConfig.from_dict(published("gpt-oss-20b")).attention_bias
    gemma = DrafterConfig.from_dict(published("gemma-4-31b-it"))
    assert gemma.final_logit_softcapping == 30.0 and gemma.mask_token_id == 4
    with pytest.raises(DFlashError, match="no 'intermediate_size' field"):
        DrafterConfig.from_dict(published("kimi-k2.6"))  # not documented for K2.6
    kimi = DrafterConfig.from_dict({**published("kimi-k2.6"), "intermediate_size": 18432})
    assert kimi.rope_theta == 50000.0 and kimi.rope_scaling is not None
    assert kimi.rope_scaling["mscale"] == kimi.rope_scaling["mscale_all_dim"] == 1


def test_mimos_other_fields_are_the_ones_documented_as_unused():
    """Every dflash_config field of MiMo's is read, or named (with why) in
    UNUSED_DFLASH_FIELDS: a new field in a re-release shows up here."""
    read = {"target_layer_ids", "mask_token_id", "block_size", "use_swa", "swa_window_size"}
    read |= {"attention_value_scale", "attention_sink_bias"}
    assert set(published("mimo-v2.5-pro")["dflash_config"]) - read == set(UNUSED_DFLASH_FIELDS)


def test_taps_follow_the_published_rule_except_mimos():
    """Shrinking taps by the rule is faithful: the published taps are the rule's, but MiMo's."""
    for name in VARIANTS:
        cfg = published(name)
        taps = (cfg.get("dflash_config") or cfg)["target_layer_ids"]
        n_target = cfg.get("num_target_layers", 52)  # Muse Glimmer-30B has 52 layers
        assert (taps == _published_taps(n_target, len(taps))) == (name != "mimo-v2.5-pro")


def test_published_pairs_fit_and_misfits_get_one_sentence():
    """The pairs whose target configs we hold fit; full-size drafters on tiny targets, or a
    target one layer short of MiMo's last tap, get one sentence."""
    check_pair(DrafterConfig.from_dict(published("qwen3.5-4b")), QWEN3_5_4B)
    check_pair(DrafterConfig.from_dict(published("muse-assistant")), MUSE_GLIMMER_30B)
    mimo = DrafterConfig.from_dict(published("mimo-v2.5-pro"))
    check_pair(mimo, {"hidden_size": 6144, "vocab_size": 152064, "num_hidden_layers": 70})
    cases = [
        (mimo, {"hidden_size": 6144, "vocab_size": 152064, "num_hidden_layers": 69}, "layer 69"),
        (mimo, {"hidden_size": 64, "vocab_size": 152064, "num_hidden_layers": 70}, "hidden"),
        (mimo, {"hidden_size": 6144, "vocab_size": 151936, "num_hidden_layers": 70}, "vocab"),
    ]
    muse = DrafterConfig.from_dict(published("muse-assistant"))
    cases.append((muse, {**MUSE_GLIMMER_30B["text_config"], "vocab_size": 201000}, "mask"))
    for cfg, target, match in cases:
        with pytest.raises(DFlashError, match=match) as e:
            check_pair(cfg, target)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("key", ["attention_value_scale", "output_multiplier"])
def test_a_non_number_where_a_drafter_scale_belongs_is_one_sentence(key):
    with pytest.raises(DFlashError, match=f"{key} must be a number") as e:
        DrafterConfig.from_dict({**published("qwen3.5-4b"), key: "abc"})
    assert "\n" not in str(e.value)


def test_muse_assistant_header_is_what_we_expect(tmp_path, targets):
    """The assistant's 58 published tensors are exactly what the code under test expects (after
    its renames), at their published shapes; shrunk, under exactly those names and dtype, they
    load for the shrunk Muse target."""
    header = {k: v for k, v in published_file(MUSE_HEADER).items() if k != "__metadata__"}
    assert len(header) == 58 and {"encoder.fc.weight", "encoder.output_norm_enc.weight"} < set(
        header
    )
    renamed = {R.zlab_name(k): k for k in header}
    expected = drafter_weight_shapes(DrafterConfig.from_dict(published("muse-assistant")))
    assert {n: tuple(header[k]["shape"]) for n, k in renamed.items()} == expected

    target, raw, _ = targets("muse")
    cfg = shrink(published("muse-assistant"), target.num_layers)
    size = {6656: 64, 33280: 5 * 64, 19968: 128, 4096: 4 * 16, 1024: 2 * 16, 128: 16}
    mx.random.seed(0)
    tensors = {
        k: (1.0 + 0.05 * mx.random.normal([size[n] for n in v["shape"]])).astype(mx.bfloat16)
        for k, v in header.items()
    }
    assert {v["dtype"] for v in header.values()} == {"BF16"}
    mx.save_safetensors(str(tmp_path / "model.safetensors"), tensors, {"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    drafter = load_drafter(tmp_path, target_config=raw)
    assert drafter.fc.weight.shape == (64, 5 * 64) and drafter.cfg.vocab_size == VOCAB
    assert mx.array_equal(drafter.hidden_norm.weight, tensors["encoder.output_norm_enc.weight"])


# --- each variant, shrunk: loads, drafts as the reference does, exact ----------------------------


def test_loads(pair):
    target, raw, folder, cfg, _ = pair
    drafter = load_drafter(folder, target_config=raw)
    resolved = DrafterConfig.from_dict(cfg, target.num_layers)
    assert drafter.cfg == dataclasses.replace(resolved, vocab_size=VOCAB)  # Muse's: the target's
    assert max(drafter.cfg.target_layer_ids) < target.num_layers
    names = [k for k, _ in tree_flatten(drafter.parameters())]
    assert not any("lm_head" in k or "embed" in k for k in names)  # Gemma's tied config too


def test_drafts_equal_the_reference(pair):
    """After a prompt's taps, one block's logits for every slot equal the NumPy reference's,
    computed from the published config and the tensors under their published names."""
    target, raw, folder, cfg, _ = pair
    runner = runner_of(target, raw, folder)
    session = Session(target, runner)
    _, taps = target.forward([Pass(mx.array(PROMPT[:-1]), session.cache, 0)])[0]
    session.commit(PROMPT[:-1], taps)
    last, start, n = PROMPT[-1], len(PROMPT) - 1, runner.block_size - 1
    mine = np.array(runner.propose(last, start, n).logits)

    weights: dict = {}
    for f in sorted(folder.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    mask = (cfg.get("dflash_config") or cfg)["mask_token_id"]
    block = mx.array([last] + [mask] * n)
    embeds = np.array(target.token_embeddings(block), dtype=np.float64)
    h = R.hidden_states(cfg, R.published_tensors(weights), embeds, np.array(taps), start)
    ref = R.logits(cfg, h, head_weight(target))[1:]
    np.testing.assert_allclose(mine, ref, rtol=2e-4, atol=2e-4)


def head_weight(target) -> np.ndarray:
    """The target's LM head rows (its embeddings when tied), float64."""
    owner = getattr(target.model, "language_model", target.model)
    head = getattr(owner, "lm_head", None)
    weight = (head if head is not None else target.inner.embed_tokens).weight
    return np.array(weight, dtype=np.float64)


@pytest.mark.parametrize("mode", ["dflash", "ddtree"])
def test_output_is_the_targets_own(pair, mode):
    target, raw, folder, _, ref = pair
    out, taus = run(Session(target, runner_of(target, raw, folder)), PROMPT, max_tokens=N,
                    mode=mode, budget=4)  # fmt: skip
    assert out == ref and taus


def test_convert_keeps_the_drafts(pair, tmp_path):
    """Converted (z-lab's names, every resolved field explicit), the drafter drafts as before."""
    target, raw, folder, _, _ = pair
    convert_drafter(folder, tmp_path, dtype="float32", target=None)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["DFlashDraftModel"]
    logits = []
    for f in (folder, tmp_path):
        runner = runner_of(target, raw, f)
        runner.add_context(target.forward([Pass(mx.array(PROMPT), target.make_cache(), 0)])[0][1])
        logits.append(np.array(runner.propose(PROMPT[-1], len(PROMPT), 3).logits))
    np.testing.assert_array_equal(logits[0], logits[1])


# --- what each variant adds, one at a time --------------------------------------------------


@pytest.mark.parametrize("mscale", [True, False], ids=["mscale-fields", "no-mscale-fields"])
def test_yarn_rope_is_mlx_lms_with_hugging_faces_attention_factor(mscale):
    """Kimi-K2.6's rope_parameters reach mlx-lm's initialize_rope whole: YaRN frequencies and,
    since both mscale fields are 1, no attention factor; without them, Hugging Face's default
    0.1 ln(64) + 1 (the disagreement algorithm.md mentions is a checkable factor here)."""
    cfg = shrink({**published("kimi-k2.6"), "intermediate_size": 18432}, 8)
    if not mscale:
        del cfg["rope_parameters"]["mscale"], cfg["rope_parameters"]["mscale_all_dim"]
    from mlx_dflash.models.drafter import DrafterAttention

    rope = DrafterAttention(DrafterConfig.from_dict(cfg)).rope
    assert type(rope).__name__ == "YarnRoPE"
    inv, dim, factor = R.rope_frequencies(cfg)
    assert factor == pytest.approx(1.0 if mscale else 0.1 * np.log(64) + 1)
    x = np.random.default_rng(0).normal(size=(1, 2, 5, 16))
    mine = np.array(rope(mx.array(x, dtype=mx.float32), offset=3000))
    pos = np.arange(3000, 3005, dtype=np.float64)
    ref = R.rotate(x[0].transpose(1, 0, 2), pos, (inv, dim, factor)).transpose(1, 0, 2)
    np.testing.assert_allclose(mine[0], ref, rtol=1e-4, atol=1e-4)


def test_a_tap_of_the_last_layer_is_its_output_before_the_final_norm(targets):
    """MiMo taps layer 69 of 70: what vLLM captures there is the residual stream after the last
    decoder layer, not the final-normed state. Our target's tap of its last layer is mlx-lm's
    last decoder layer's output, run here by hand."""
    target, _, _ = targets("qwen3")
    target.set_taps([0, target.num_layers - 1])
    _, taps = target.forward([Pass(mx.array(PROMPT), target.make_cache(), 0)])[0]
    inner = target.model.model
    h = inner.embed_tokens(mx.array(PROMPT)[None])
    for layer in inner.layers:
        h = layer(h, "causal", None)
    last, ref = np.array(taps[:, target.hidden_size :]), np.array(h[0])
    # Float32 noise scales with the residual stream's size (~60 here), not with each element.
    np.testing.assert_allclose(last, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())
    assert not np.allclose(last, np.array(inner.norm(h)[0]), atol=1e-2)


def _mimo(tmp_path, target_layers: int = 8, **overrides) -> tuple[Path, dict]:
    cfg = shrink(published("mimo-v2.5-pro"), target_layers)
    dflash = overrides.pop("dflash_config", {})
    cfg.update(overrides)
    cfg["dflash_config"].update(dflash)
    return tmp_path, cfg


def _refused(match: str, fn, *args, **kwargs) -> None:
    with pytest.raises(DFlashError, match=match) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value)


def test_configs_that_cannot_run_get_one_sentence():
    base = shrink(published("mimo-v2.5-pro"), 8)
    odd = {**base, "partial_rotary_factor": 0.45}  # 7.2 of 16 dimensions
    _refused("partial_rotary_factor 0.45", DrafterConfig.from_dict, odd)
    _refused("hidden_act 'gelu'", DrafterConfig.from_dict, {**base, "hidden_act": "gelu"})
    no_window = copy.deepcopy(base)
    del no_window["sliding_window"], no_window["dflash_config"]["swa_window_size"]
    _refused("no sliding_window", DrafterConfig.from_dict, no_window)


def test_checkpoints_that_do_not_match_their_config_get_one_sentence(tmp_path, targets):
    target, raw, _ = targets("qwen3")
    folder, cfg = _mimo(tmp_path / "a")
    write_drafter_checkpoint(folder, cfg, drop_keys=["layers.1.self_attn.attention_sink_bias"])
    _refused("missing tensor 'layers.1.self_attn.attention_sink_bias'", load_drafter, folder)
    no_sinks = copy.deepcopy(cfg)
    no_sinks["dflash_config"]["attention_sink_bias"] = False
    (folder / "config.json").write_text(json.dumps(no_sinks))
    write_drafter_checkpoint(tmp_path / "b", cfg)
    (tmp_path / "b" / "config.json").write_text(json.dumps(no_sinks))
    _refused("unexpected tensor 'layers.0.self_attn.attention_sink_bias'", load_drafter,
             tmp_path / "b")  # fmt: skip
    gpt = shrink(published("gpt-oss-20b"), 8)
    write_drafter_checkpoint(tmp_path / "c", gpt, drop_keys=["layers.0.self_attn.o_proj.bias"])
    _refused("missing tensor 'layers.0.self_attn.o_proj.bias'", load_drafter, tmp_path / "c")
    narrow = {**shrink(published("kimi-k2.6"), 8), "hidden_size": 32}
    _refused("hidden size 32 differs", load_drafter,
             write_drafter_checkpoint(tmp_path / "d", narrow), target_config=raw)  # fmt: skip


def test_mimos_pickled_mask_embedding_is_refused_not_ignored(tmp_path, targets):
    """MiMo's release replaces its mask token's embedding with mask_embedding.pt (vLLM PR
    #46104): a pickle, which we never load; ignoring it would draft from the wrong embedding."""
    target, raw, _ = targets("qwen3")
    folder, cfg = _mimo(tmp_path / "d")
    write_drafter_checkpoint(folder, cfg)
    (folder / "mask_embedding.pt").write_bytes(b"PK\x03\x04")
    _refused("mask_embedding.pt, a PyTorch pickle", load_drafter, folder, target_config=raw)
    out = tmp_path / "out"
    out.mkdir()
    _refused("never unpickles", convert_drafter, folder, out)


def test_training_refuses_what_its_attention_does_not_model(tmp_path):
    from mlx_dflash.training.forward import check_trainable

    check_trainable(DrafterConfig.from_dict(shrink(published("gpt-oss-20b"), 8)))
    _refused("attention sinks", check_trainable,
             DrafterConfig.from_dict(shrink(published("mimo-v2.5-pro"), 8)))  # fmt: skip


def test_training_forward_is_the_inference_forward(pair):
    """What `dflash-mlx train` computes for a block at anchor a equals what the drafter proposes
    there (biases, partial RoPE, windows, YaRN included); MiMo's is refused (above)."""
    from mlx_dflash.models.drafter import drafter_logits
    from mlx_dflash.training.forward import drafter_blocks

    target, raw, folder, cfg, _ = pair
    drafter = load_drafter(folder, target_config=raw)
    if drafter.cfg.attention_sink_bias:
        return
    target.set_taps(drafter.cfg.target_layer_ids)
    _, taps = target.forward([Pass(mx.array(PROMPT), target.make_cache(), 0)])[0]
    anchors = [5, 21]
    h = drafter_blocks(drafter, target, taps[None], mx.array([PROMPT]), mx.array([anchors]))
    logits = drafter_logits(drafter.cfg, target, h)
    for j, a in enumerate(anchors):
        runner = DrafterRunner(drafter, target)
        runner.add_context(taps[:a])
        ref = runner.propose(PROMPT[a], a, drafter.cfg.block_size - 1).logits
        np.testing.assert_allclose(np.array(logits[0, j, 1:]), np.array(ref), atol=1e-4)
