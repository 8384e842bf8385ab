"""Multi-head latent attention targets (DeepSeek-V3, Kimi-K2.5): DFlash and DDTree token for
token against mlx-lm's own greedy decoding, on shrunk configs that keep every MLA, MoE and yarn
field of the published ones."""

from __future__ import annotations

import copy
import json

import mlx.core as mx
import numpy as np
import pytest
from factories import write_tiny_tokenizer
from mlx.utils import tree_flatten, tree_unflatten
from oracle import OracleDrafter, diversify
from test_engine import PROMPT, mlx_lm_greedy, random_drafter, run

from mlx_dflash.engine import Session
from mlx_dflash.models.cache import KVCache
from mlx_dflash.models.mla import mla_attention
from mlx_dflash.models.target import Target, load_target

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

    from mlx_dflash.models.target import model_classes

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


def well_routed(cfg: dict, n: int = 96) -> Target:
    """The first seed whose greedy continuation keeps clear of routing ties (see above)."""
    for seed in range(20):
        target = Target(build(cfg, seed), None, cfg)
        ref = mlx_lm_greedy(target, PROMPT, n)
        if router_margin(target, PROMPT + ref, len(PROMPT)) > 1e-3:
            return target
    raise AssertionError("no seed gave a continuation clear of routing ties")


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
    [("dflash", 1, None), ("ddtree", 4, None), ("ddtree", 16, None), ("ddtree", 8, 1)],
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
    from mlx_lm.utils import save_config, save_model

    cfg = CONFIGS["kimi_k25"]
    model = build(cfg)
    save_model(tmp_path, model)
    save_config(cfg, tmp_path / "config.json")
    write_tiny_tokenizer(tmp_path, 256)
    target = load_target(tmp_path)
    assert target.model_type == "kimi_k25" and target.num_layers == 4
    ref = mlx_lm_greedy(target, PROMPT, 24)
    target.set_taps([1, 3])
    oracle = OracleDrafter(PROMPT + ref, target.vocab_size, block_size=8, corrupt=0.3, seed=3)
    out, _ = run(Session(target, oracle), PROMPT, max_tokens=24, mode="ddtree", budget=6)
    assert out == ref
    assert (
        json.loads((tmp_path / "config.json").read_text())["text_config"]["model_type"] == "kimi_k2"
    )
