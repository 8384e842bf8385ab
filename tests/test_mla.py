"""Multi-head latent attention targets (DeepSeek-V3, Kimi-K2.5): DFlash and DDTree token for
token against mlx-lm's own greedy decoding, on shrunk configs that keep every MLA, MoE and yarn
field of the published ones."""

from __future__ import annotations

import copy
import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from oracle import OracleDrafter, diversify
from test_engine import PROMPT, mlx_lm_greedy, random_drafter, run

from mlx_dflash.engine import Session
from mlx_dflash.models.cache import KVCache
from mlx_dflash.models.mla import mla_attention
from mlx_dflash.models.target import Target, load_target
from mlx_dflash.models.tiny import write_tiny_tokenizer
from mlx_dflash.settings import SETTINGS

N = 48

# moonshotai/Kimi-K2.5 config.json: the multimodal wrapper with the DeepSeek-V3 language model
# under text_config (its own type kimi_k2). Written from the published file's fields (vision
# tower fields abridged to the ones mlx-lm reads); `shrink` below changes sizes only.
KIMI_K25 = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "pad_token_id": 163839,
    "media_placeholder_token_id": 163605,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "text_config": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "bos_token_id": 163584,
        "eos_token_id": 163585,
        "ep_size": 1,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 7168,
        "initializer_range": 0.02,
        "intermediate_size": 18432,
        "kv_lora_rank": 512,
        "max_position_embeddings": 262144,
        "moe_intermediate_size": 2048,
        "moe_layer_freq": 1,
        "n_group": 1,
        "n_routed_experts": 384,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 64,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 61,
        "num_key_value_heads": 64,
        "num_nextn_predict_layers": 0,
        "pretraining_tp": 1,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "factor": 64.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 50000.0,
        "routed_scaling_factor": 2.827,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "v_head_dim": 128,
        "vocab_size": 163840,
    },
    "vision_config": {"model_type": "moonvit", "hidden_size": 1152, "num_hidden_layers": 27},
}


def deepseek_v3_text() -> dict:
    """DeepSeek-V3's own config: the same family flat, yarn factor 40, grouped routing."""
    t = copy.deepcopy(KIMI_K25["text_config"])
    t.update(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        first_k_dense_replace=3,
        max_position_embeddings=163840,
        n_group=8,
        n_routed_experts=256,
        num_attention_heads=128,
        num_key_value_heads=128,
        num_nextn_predict_layers=1,
        topk_group=4,
        vocab_size=129280,
        rms_norm_eps=1e-06,
        rope_theta=10000,
        bos_token_id=0,
        eos_token_id=1,
    )
    t["rope_scaling"] = {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    }
    return t


def shrink_text(t: dict) -> dict:
    t = copy.deepcopy(t)
    t.update(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        vocab_size=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    if t["n_group"] > 1:
        t.update(n_group=4, topk_group=2)
    return t


def shrink(cfg: dict) -> dict:
    if "text_config" not in cfg:
        return shrink_text(cfg)
    out = copy.deepcopy(cfg)
    out["text_config"] = shrink_text(cfg["text_config"])
    out.update(bos_token_id=1, eos_token_id=2, pad_token_id=0, media_placeholder_token_id=3)
    return out


CONFIGS = {"kimi_k25": shrink(KIMI_K25), "deepseek_v3": shrink(deepseek_v3_text())}


def build(cfg: dict, seed: int = 0):
    from mlx_lm.utils import _get_classes

    from mlx_dflash.models.families import model_classes

    model_cls, args_cls = model_classes(cfg)
    assert (model_cls, args_cls) == _get_classes(
        {**cfg, "model_type": cfg["model_type"].replace("kimi_k2", "deepseek_v3")}
        if cfg["model_type"] == "kimi_k2"
        else cfg
    )
    model = model_cls(args_cls.from_dict(cfg))
    diversify(model, gain=2.0, seed=seed)
    # The MoE router's correction bias starts at zero: give routing real choices.
    params = dict(tree_flatten(model.parameters()))
    for k, v in params.items():
        if k.endswith("e_score_correction_bias"):
            params[k] = mx.random.normal(v.shape) * 0.5
    model.update(tree_unflatten(list(params.items())))
    mx.eval(model.parameters())
    return model


def router_margin(target: Target, tokens: list[int], start: int) -> float:
    """The smallest gap, over positions >= start and MoE layers, between the k-th and the
    (k+1)-th expert score. Routing is discontinuous: where two experts tie to ~1e-6, the
    float-level difference between a 17-token verify and a 1-token step (mlx-lm's own prefill
    and decode differ the same way) picks another expert, so greedy exactness is only defined
    away from such ties; fixtures are drawn until their reference continuation has none."""
    h = target.embed(mx.array(tokens)[None])
    cache = target.make_cache()
    worst = float("inf")
    for layer, c in zip(target.layers, cache, strict=True):
        h = h + mla_attention(layer.self_attn, layer.input_layernorm(h), c, 0, None, None, {})
        y = layer.post_attention_layernorm(h)
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            scores = mx.sigmoid(y @ gate.weight.T) + gate.e_score_correction_bias
            s = np.sort(np.array(scores[0, start:]), axis=-1)[:, ::-1]
            k = gate.top_k
            worst = min(worst, float((s[:, k - 1] - s[:, k]).min()))
        h = h + layer.mlp(y)
    return worst


def clear_of_ties(make, n: int, margin: float = 1e-3):
    """The first of make(0), make(1), ... (a Target, or a tuple that starts with one) whose
    greedy continuation of n tokens keeps clear of routing ties (see above); with that
    continuation."""
    for seed in range(20):
        made = make(seed)
        target = made[0] if isinstance(made, tuple) else made
        ref = mlx_lm_greedy(target, PROMPT, n)
        if router_margin(target, PROMPT + ref, len(PROMPT)) > margin:
            return made, ref
    raise AssertionError("no seed gave a continuation clear of routing ties")


def well_routed(cfg: dict, n: int = 96) -> Target:
    return clear_of_ties(lambda seed: Target(build(cfg, seed), None, cfg), n)[0]


def save_folder(path, model, cfg: dict):
    """A model folder as mlx-lm writes it, with the tiny tokenizer."""
    from mlx_lm.utils import save_config, save_model

    save_model(path, model)
    save_config(copy.deepcopy(cfg), path / "config.json")  # save_config edits its argument
    write_tiny_tokenizer(path, 256)
    return path


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def target(request):
    return well_routed(CONFIGS[request.param])


def test_shrunk_configs_keep_every_field():
    for full, small in (
        (KIMI_K25, CONFIGS["kimi_k25"]),
        (deepseek_v3_text(), CONFIGS["deepseek_v3"]),
    ):
        assert set(full) == set(small)
        if "text_config" in full:
            assert set(full["text_config"]) == set(small["text_config"])
    text = CONFIGS["kimi_k25"]["text_config"]
    for key in (
        "kv_lora_rank",
        "q_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
    ):
        assert text[key] > 0
    assert text["rope_scaling"]["type"] == "yarn" and text["rope_scaling"]["factor"] > 1
    assert (text["topk_method"], text["scoring_func"]) == ("noaux_tc", "sigmoid")


def test_layers_are_mla_with_dense_and_moe_mlps(target):
    from mlx_dflash.models.mla import is_mla

    assert all(is_mla(layer.self_attn) for layer in target.layers)
    first_k = int(target.text_config["first_k_dense_replace"])
    kinds = [type(layer.mlp).__name__ for layer in target.layers]
    assert all("MoE" not in k for k in kinds[:first_k]) and all("MoE" in k for k in kinds[first_k:])
    assert all(isinstance(c, KVCache) for c in target.make_cache())
    # yarn's mscale changes the attention scale, as in mlx-lm.
    attn = target.layers[0].self_attn
    assert attn.scale != attn.q_head_dim**-0.5


def test_ar_matches_mlx_lm(target):
    ref = mlx_lm_greedy(target, PROMPT, N)
    assert len(set(ref)) > 5  # a real continuation, not one token repeated
    out, _ = run(Session(target), PROMPT, max_tokens=N, mode="ar")
    assert out == ref


@pytest.mark.parametrize(
    "mode,budget,branching",
    [("dflash", None, None), ("ddtree", 4, None), ("ddtree", 16, None), ("ddtree", 8, 1)],
)
def test_speculative_greedy_exact(target, mode, budget, branching):
    ref = mlx_lm_greedy(target, PROMPT, N)
    target.set_taps([1, 3])
    oracle = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8, corrupt=0.3, seed=2)
    out, taus = run(
        Session(target, oracle), PROMPT, max_tokens=N, mode=mode, budget=budget, branching=branching
    )
    assert out == ref
    assert np.mean(taus) > 2  # real partial acceptance: trims and compactions happened


def test_real_drafter_on_mla_taps(target):
    """A real (random) DFlash drafter fed the MLA target's taps: DFlash and DDTree exact."""
    ref = mlx_lm_greedy(target, PROMPT, N)
    for mode in ("dflash", "ddtree"):
        out, taus = run(Session(target, random_drafter(target)), PROMPT, max_tokens=N, mode=mode)
        assert out == ref and all(1 <= t <= 8 for t in taus)


def test_tree_compaction_keeps_the_latent_cache_exact(target):
    """After a tree round the cache holds exactly the accepted path's latents, as if that path
    had been decoded: a long run through many compactions ends where mlx-lm does."""
    ref = mlx_lm_greedy(target, PROMPT, 96)
    target.set_taps([1, 3])
    oracle = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8, corrupt=0.5, seed=5)
    out, taus = run(Session(target, oracle), PROMPT, max_tokens=96, mode="ddtree", budget=12)
    assert out == ref and max(taus) > 3 and len(set(taus)) > 2  # varied acceptance


def test_kimi_k25_folder_loads_through_mlx_lm(tmp_path):
    """A kimi_k25 folder (wrapper config, language_model.* weights) loads and decodes exactly."""
    cfg = CONFIGS["kimi_k25"]
    target = load_target(save_folder(tmp_path, build(cfg), cfg))
    assert target.model_type == "kimi_k25" and target.num_layers == 4
    ref = mlx_lm_greedy(target, PROMPT, 24)
    target.set_taps([1, 3])
    oracle = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8, corrupt=0.3, seed=3)
    out, _ = run(Session(target, oracle), PROMPT, max_tokens=24, mode="ddtree", budget=6)
    assert out == ref
    assert (
        json.loads((tmp_path / "config.json").read_text())["text_config"]["model_type"] == "kimi_k2"
    )


# ---- Kimi-K2.5 as published: int4 (compressed-tensors) routed experts -----------------------

# The published quantization block (routed experts int4, symmetric, groups of 32; the rest bf16).
COMPRESSED_TENSORS = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "group_size": 32,
                "symmetric": True,
                "strategy": "group",
                "type": "int",
                "dynamic": False,
                "actorder": None,
                "observer": "minmax",
            },
            "input_activations": None,
            "output_activations": None,
        }
    },
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|down)_proj.*",
    ],
    "kv_cache_scheme": None,
}


def _pack_int4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """compressed-tensors' symmetric int4 (groups of 32 along the input): int32 words of 8
    nibbles (value + 8, lowest nibble first) and one scale per group."""
    out_dim, in_dim = w.shape
    g = w.reshape(out_dim, in_dim // 32, 32)
    scale = np.abs(g).max(axis=-1) / 7.0
    q = np.clip(np.round(g / scale[..., None]), -8, 7).astype(np.int64) + 8
    q = q.reshape(out_dim, in_dim // 8, 8)
    words = np.zeros((out_dim, in_dim // 8), dtype=np.uint32)
    for j in range(8):
        words |= (q[..., j].astype(np.uint32) & 0xF) << np.uint32(4 * j)
    return words.view(np.int32), scale.astype(np.float32)


def write_kimi_hf_int4(path, seed: int):
    """A Kimi-K2.5 folder as published: wrapper config with the quantization block,
    `language_model.*` torch names, kv_b_proj unsplit, per-expert int4 tensors
    (weight_packed / weight_scale / weight_shape), vision-tower tensors to be dropped."""
    cfg = copy.deepcopy(CONFIGS["kimi_k25"])
    cfg["text_config"]["quantization_config"] = COMPRESSED_TENSORS
    model = build(CONFIGS["kimi_k25"], seed)
    text = cfg["text_config"]
    H = text["num_attention_heads"]
    out = {}
    for k, v in tree_flatten(model.parameters()):
        a = np.array(v)
        if k.endswith("self_attn.embed_q.weight"):
            unembed = np.array(
                dict(tree_flatten(model.parameters()))[k.replace("embed_q", "unembed_out")]
            )
            kv_b = np.concatenate([a.swapaxes(-1, -2), unembed], axis=1)
            out[k.replace("embed_q.weight", "kv_b_proj.weight")] = kv_b.reshape(
                H * kv_b.shape[1], -1
            )
        elif k.endswith("self_attn.unembed_out.weight"):
            continue
        elif ".switch_mlp." in k:
            base, proj = k.split(".switch_mlp.")
            proj = proj.replace(".weight", "")
            for e in range(a.shape[0]):
                packed, scale = _pack_int4(a[e])
                name = f"{base}.experts.{e}.{proj}"
                out[f"{name}.weight_packed"] = packed
                out[f"{name}.weight_scale"] = scale
                out[f"{name}.weight_shape"] = np.array(a[e].shape, dtype=np.int32)
        else:
            out[k] = a
    out["vision_tower.patch_embed.proj.weight"] = np.zeros((4, 3, 2, 2), np.float32)
    out["mm_projector.proj.0.weight"] = np.zeros((8, 8), np.float32)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(path / "model.safetensors"), {k: mx.array(v) for k, v in out.items()}, {"format": "pt"}
    )
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tiny_tokenizer(path, 256)
    return path


def test_kimi_k25_published_int4_layout_loads_and_runs_exactly(tmp_path, run_cli):
    """The published layout (int4 compressed-tensors experts) loads through mlx-lm, converts
    with `dflash-mlx convert`, and DFlash / DDTree on it equal mlx-lm on the same folder."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    def make(seed):
        folder = write_kimi_hf_int4(tmp_path / f"Kimi-K2.5-{seed}", seed)
        return load_target(folder), folder

    (target, folder), ref = clear_of_ties(make, N)
    moe = target.layers[-1].mlp.switch_mlp
    assert isinstance(moe.gate_proj, QuantizedSwitchLinear) and moe.gate_proj.bits == 4
    assert not hasattr(target.layers[-1].self_attn.o_proj, "scales")  # the rest stays float
    target.set_taps([1, 3])
    for mode, budget in (("dflash", 1), ("ddtree", 8)):
        oracle = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8, corrupt=0.3, seed=2)
        out, _ = run(Session(target, oracle), PROMPT, max_tokens=N, mode=mode, budget=budget)
        assert out == ref
    out_dir = str(tmp_path / "mlx")
    code, _, err = run_cli("convert", str(folder), "--out", out_dir, "--dtype", "float32")
    assert code == 0, err
    converted = load_target(tmp_path / "mlx")
    assert isinstance(converted.layers[-1].mlp.switch_mlp.up_proj, QuantizedSwitchLinear)
    assert mlx_lm_greedy(converted, PROMPT, N) == ref


# ---- the published pair: z-lab/Kimi-K2.5-DFlash ------------------------------------------------

# Its config.json as its public descriptions give it (DFlashDraftModel, Qwen3-style layers,
# hidden 7168, 6 layers, block 8, mask token 163838, taps 1/12/24/35/47/58 of 61, yarn rope
# with factor 64). Head counts and MLP width are not stated there: assumed like z-lab's other
# exports. The pair check reads hidden size, vocabulary, taps and mask token, which are known.
KIMI_DFLASH = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "block_size": 8,
    "dflash_config": {"mask_token_id": 163838, "target_layer_ids": [1, 12, 24, 35, 47, 58]},
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "layer_types": ["full_attention"] * 6,
    "max_position_embeddings": 262144,
    "num_attention_heads": 64,
    "num_hidden_layers": 6,
    "num_key_value_heads": 8,
    "num_target_layers": 61,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 64.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
    },
    "rope_theta": 50000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 163840,
}


def test_published_kimi_pair_found_checked_and_exact(tmp_path, monkeypatch):
    """`--model <folder named Kimi-K2.5>` finds z-lab/Kimi-K2.5-DFlash through the registry,
    checks the pair from its config.json before any weight, and DFlash / DDTree with it (yarn
    rope in the drafter too) equal mlx-lm on the published int4 layout."""
    from published import _published_taps

    from mlx_dflash import load_pair
    from mlx_dflash.checkpoints import convert as convert_mod
    from mlx_dflash.checkpoints.read import check_pair
    from mlx_dflash.models.drafter_config import DrafterConfig
    from mlx_dflash.models.tiny import write_drafter_checkpoint

    target_cfg = CONFIGS["kimi_k25"]
    with pytest.raises(Exception, match="hidden size 7168 differs"):
        check_pair(DrafterConfig.from_dict(KIMI_DFLASH), target_cfg)  # real drafter, tiny target
    check_pair(DrafterConfig.from_dict(KIMI_DFLASH), KIMI_K25)  # the published pair fits

    small = copy.deepcopy(KIMI_DFLASH)
    text = target_cfg["text_config"]
    small.update(
        hidden_size=text["hidden_size"],
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        vocab_size=256,
        layer_types=["full_attention"] * 2,
        num_target_layers=text["num_hidden_layers"],
    )
    small["dflash_config"] = {
        "mask_token_id": 255,
        "target_layer_ids": _published_taps(text["num_hidden_layers"], 2),
    }
    hub = {"z-lab/Kimi-K2.5-DFlash": write_drafter_checkpoint(tmp_path / "zlab", small)}
    monkeypatch.setattr(SETTINGS, "cache", str(tmp_path / "cache"))
    monkeypatch.setattr(convert_mod, "_snapshot_download", lambda r: str(hub[r]))
    monkeypatch.setattr(convert_mod, "_download_config", lambda r: str(hub[r] / "config.json"))
    (target, runner), ref = clear_of_ties(
        lambda seed: load_pair(str(write_kimi_hf_int4(tmp_path / f"s{seed}" / "Kimi-K2.5", seed))),
        N,
    )
    assert type(runner.drafter.layers[0].self_attn.rope).__name__ == "YarnRoPE"
    assert runner.block_size == 8
    for mode in ("dflash", "ddtree"):
        out, _ = run(Session(target, runner), PROMPT, max_tokens=N, mode=mode, budget=4)
        assert out == ref
