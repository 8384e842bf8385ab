"""Targets of the families z-lab published DFlash drafters for beyond Qwen / Llama / Kimi:
Gemma 4, gpt-oss, MiniMax M2.x, GLM-4 MoE, MiMo-V2-Flash. Fixtures for tests/test_families.py.

No verbatim config.json of these targets was found (../shared/data/configs/SOURCES.md), so each
config below takes the field set the published checkpoints carry, as public loaders and test
fixtures spell it (each block names its sources), with the sizes the published model has where
SOURCES.md records them. `shrink` then changes only sizes and token ids; the sliding windows
shrink to 8 positions so that the tests decode well past them.

Layouts written: Gemma 4 as Google publishes it (the multimodal wrapper, `model.language_model.*`
keys, fused `experts.gate_up_proj` / `experts.down_proj` tensors of the 26B-A4B MoE); gpt-oss as
mlx-community converts it (experts in MXFP4, the rest float); the others as `mlx_lm.convert`
writes them. Weights are float32 apart from gpt-oss's MXFP4 experts.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from oracle import diversify

from mlx_dflash.models.families import model_classes
from mlx_dflash.models.tiny import write_tiny_tokenizer

WINDOW = 8  # every shrunk sliding window: the tests decode far past it
MXFP4 = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
NVFP4 = {"group_size": 16, "bits": 4, "mode": "nvfp4"}


def _is_expert(path: str, module) -> bool:
    return ".experts." in path and hasattr(module, "to_quantized")


def _alternate(n: int, period: int) -> list[str]:
    """(period - 1) sliding layers, then one full one, repeated."""
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n)]


# Gemma 4 31B-it. Sizes and ids: SOURCES.md "gemma-4-31B-it-DFlash" (60 layers, five sliding to
# one full, head_dim 256 local / 512 global, 32 heads / 16 KV heads, window 1024, vocab 262144,
# tied embeddings, final_logit_softcapping 30). Field names and the per-layer-type
# rope_parameters (global: proportional, partial_rotary_factor 0.25) as the Gemma 4 text
# configs of public loaders' fixtures spell them (a 12B gemma4_unified config and a 26B-A4B
# one, see the session note), which also carry attention_k_eq_v, num_kv_shared_layers 0,
# hidden_size_per_layer_input 0, use_double_wide_mlp false and hidden_activation.
GEMMA4_31B: dict[str, Any] = {
    "architectures": ["Gemma4ForConditionalGeneration"],
    "model_type": "gemma4",
    "text_config": {
        "model_type": "gemma4_text",
        "attention_k_eq_v": True,
        "enable_moe_block": False,
        "final_logit_softcapping": 30.0,
        "global_head_dim": 512,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 5376,
        "hidden_size_per_layer_input": 0,
        "intermediate_size": 21504,
        "layer_types": _alternate(60, 6),
        "max_position_embeddings": 262144,
        "num_attention_heads": 32,
        "num_hidden_layers": 60,
        "num_key_value_heads": 16,
        "num_kv_shared_layers": 0,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
                "rope_type": "proportional",
            },
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "sliding_window": 1024,
        "tie_word_embeddings": True,
        "use_double_wide_mlp": False,
        "vocab_size": 262144,
    },
    "tie_word_embeddings": True,
    "vocab_size": 262144,
}
# Gemma 4 26B-A4B-it: the MoE branch (128 experts, top 8, expert width 704, dense width 2112)
# and K = V global layers with 2 KV heads, from a public loader's fixture of its text_config;
# hidden 2816 from SOURCES.md's drafter table (the drafter takes the target's width).
GEMMA4_26B_A4B: dict[str, Any] = copy.deepcopy(GEMMA4_31B)
GEMMA4_26B_A4B["text_config"].update(
    enable_moe_block=True,
    hidden_size=2816,
    intermediate_size=2112,
    moe_intermediate_size=704,
    num_experts=128,
    top_k_experts=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    num_global_key_value_heads=2,
    num_hidden_layers=30,
    layer_types=_alternate(30, 6),
)
# Gemma 4 12B-it: `gemma4_unified` (encoder-free multimodal; mlx-lm reads it with gemma4's
# module), its text_config as a public loader's fixture copies it: hidden 3840, 48 layers,
# 16 heads / 8 KV (8 global), K = V global layers, proportional global RoPE with factor 1.
GEMMA4_12B: dict[str, Any] = {
    "architectures": ["Gemma4UnifiedForConditionalGeneration"],
    "model_type": "gemma4_unified",
    "text_config": {
        "model_type": "gemma4_unified_text",
        "attention_k_eq_v": True,
        "final_logit_softcapping": 30.0,
        "global_head_dim": 512,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 3840,
        "hidden_size_per_layer_input": 0,
        "intermediate_size": 15360,
        "layer_types": _alternate(48, 6),
        "num_attention_heads": 16,
        "num_global_key_value_heads": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 8,
        "num_kv_shared_layers": 0,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "full_attention": {"rope_theta": 1000000.0, "rope_type": "proportional", "factor": 1.0},
            "sliding_attention": {"rope_theta": 10000.0},
        },
        "sliding_window": 1024,
    },
    "vocab_size": 262144,
}
# gpt-oss-20b: the release's config fields (GptOssForCausalLM; public loaders' fixtures spell
# the same set: attention_bias, head_dim 64, layer_types alternating sliding / full,
# sliding_window 128, experts_per_token, swiglu_limit 7, yarn rope_scaling, mxfp4
# quantization_config). Sizes: 24 layers, hidden 2880, 64 heads / 8 KV, 32 experts, top 4;
# ids from SOURCES.md "gpt-oss-20b-DFlash" (eos 200002, rope_theta 150000).
GPT_OSS_20B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "pad_token_id": 199999,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "vocab_size": 201088,
}
# MiniMax-M2.x: MiniMaxM2ForCausalLM as public fixtures of the released config spell it
# (62 layers, hidden 3072, 48 heads / 8 KV, head_dim 128, rotary_dim 64, 256 experts top 8,
# sigmoid routing with a bias, qk norm over all heads, rope_theta 5e6, vocab 200064).
MINIMAX_M2: dict[str, Any] = {
    "architectures": ["MiniMaxM2ForCausalLM"],
    "model_type": "minimax_m2",
    "attention_dropout": 0.0,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "intermediate_size": 1536,
    "max_position_embeddings": 196608,
    "num_attention_heads": 48,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 62,
    "num_key_value_heads": 8,
    "num_local_experts": 256,
    "num_mtp_modules": 3,
    "qk_norm_type": "per_layer",
    "rms_norm_eps": 1e-06,
    "rope_theta": 5000000,
    "rotary_dim": 64,
    "scoring_func": "sigmoid",
    "shared_intermediate_size": 0,
    "tie_word_embeddings": False,
    "use_mtp": True,
    "use_qk_norm": True,
    "use_routing_bias": True,
    "vocab_size": 200064,
}
# GLM-4.5-class MoE (glm4_moe): the fields mlx-lm's ModelArgs requires, as GLM's config names
# them (biased q/k/v, partial_rotary_factor 0.5, first_k_dense_replace, shared expert,
# sigmoid noaux_tc routing). No DFlash drafter targets it; it is tested because the
# architecture table accepts it.
GLM4_MOE: dict[str, Any] = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "attention_bias": True,
    "first_k_dense_replace": 1,
    "head_dim": 128,
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "max_position_embeddings": 131072,
    "moe_intermediate_size": 1408,
    "n_group": 1,
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 46,
    "num_key_value_heads": 8,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "routed_scaling_factor": 1.0,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "use_qk_norm": True,
    "vocab_size": 151552,
}
# MiMo-V2-Flash (mimo_v2_flash): hybrid_layer_pattern (1 = sliding), swa_* head shapes, value
# heads narrower than key heads, sink logits on the sliding layers, attention_value_scale,
# partial RoPE, noaux_tc routing, as public loaders' fixtures of the hub configs spell them.
MIMO_V2_FLASH: dict[str, Any] = {
    "architectures": ["MiMoV2FlashForCausalLM"],
    "model_type": "mimo_v2_flash",
    "add_full_attention_sink_bias": False,
    "add_swa_attention_sink_bias": True,
    "attention_bias": False,
    "attention_value_scale": 0.707,
    "head_dim": 192,
    "hidden_size": 4096,
    "hybrid_layer_pattern": [0, 1, 1, 1, 1, 0] * 8,
    "intermediate_size": 16384,
    "layernorm_epsilon": 1e-05,
    "max_position_embeddings": 262144,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": [0] + [1] * 47,
    "n_group": 1,
    "n_routed_experts": 256,
    "n_shared_experts": None,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "partial_rotary_factor": 0.334,
    "rope_theta": 5000000.0,
    "routed_scaling_factor": None,
    "scoring_func": "sigmoid",
    "sliding_window": 128,
    "sliding_window_size": 128,
    "swa_head_dim": 192,
    "swa_num_attention_heads": 64,
    "swa_num_key_value_heads": 8,
    "swa_rope_theta": 10000.0,
    "swa_v_head_dim": 128,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "v_head_dim": 128,
    "vocab_size": 152576,
}

FAMILIES: dict[str, dict[str, Any]] = {
    "gemma4-31b": GEMMA4_31B,
    "gemma4-26b-a4b": GEMMA4_26B_A4B,
    "gemma4-12b": GEMMA4_12B,
    "gpt-oss-20b": GPT_OSS_20B,
    "minimax-m2": MINIMAX_M2,
    "glm4-moe": GLM4_MOE,
    "mimo-v2-flash": MIMO_V2_FLASH,
}
# Sliding-window families and sink families (gpt-oss and MiMo have both).
SLIDING = ("gemma4-31b", "gemma4-26b-a4b", "gemma4-12b", "gpt-oss-20b", "mimo-v2-flash")
SINKS = ("gpt-oss-20b", "mimo-v2-flash")

_SIZES = {
    "hidden_size": 64,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
}


def _shrink_text(t: dict[str, Any], layers: int) -> dict[str, Any]:
    t = copy.deepcopy(t)
    for key, value in _SIZES.items():
        if key in t or key in ("hidden_size", "num_attention_heads", "vocab_size"):
            t[key] = value
    t["num_hidden_layers"] = layers
    if "layer_types" in t:
        period = 2 if t.get("model_type") == "gpt_oss" else 6
        t["layer_types"] = _alternate(layers, period)
    for key in ("sliding_window", "sliding_window_size"):
        if key in t:
            t[key] = WINDOW
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if key in t:
            t[key] = 8
    for key in ("num_experts_per_tok", "top_k_experts", "experts_per_token"):
        if key in t:
            t[key] = 2
    if "global_head_dim" in t:
        t["global_head_dim"] = 32
    if "num_global_key_value_heads" in t:
        t["num_global_key_value_heads"] = 1
    if "rotary_dim" in t:
        t["rotary_dim"] = 8
    if "hybrid_layer_pattern" in t:  # MiMo: its own head shapes on sliding layers
        t["hybrid_layer_pattern"] = [0, 1, 1, 1, 1, 0][:layers]
        t["moe_layer_freq"] = [0] + [1] * (layers - 1)
        t.update(swa_num_attention_heads=4, swa_num_key_value_heads=2)
        t.update(head_dim=24, swa_head_dim=24, v_head_dim=16, swa_v_head_dim=16)
    for key, value in (("eos_token_id", 2), ("bos_token_id", 1), ("pad_token_id", 0)):
        if key in t:
            t[key] = value
    return t


def shrink(cfg: dict[str, Any], layers: int = 6) -> dict[str, Any]:
    """The published config with only sizes and token ids changed."""
    if "text_config" not in cfg:
        return _shrink_text(cfg, layers)
    out = copy.deepcopy(cfg)
    out["text_config"] = _shrink_text(cfg["text_config"], layers)
    if "vocab_size" in out:
        out["vocab_size"] = out["text_config"]["vocab_size"]
    return out


def build(cfg: dict[str, Any], seed: int):
    """mlx-lm's own model for `cfg`, with weights far enough from uniform that greedy decoding
    moves, and MoE routers with real choices."""
    model_cls, args_cls = model_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    diversify(model, gain=2.0, seed=seed)
    params = dict(tree_flatten(model.parameters()))
    for k, v in params.items():
        if k.endswith(("e_score_correction_bias", "per_expert_scale")):
            params[k] = 1.0 + 0.5 * mx.random.normal(v.shape)
        elif k.endswith(("sinks", "attention_sink_bias")):
            params[k] = mx.random.normal(v.shape)  # sinks that take real attention mass
        elif k.endswith("embed_tokens.weight") and "text_config" in cfg:
            # Gemma scales embeddings by sqrt(hidden): keep them from drowning every layer
            params[k] = v / cfg["text_config"]["hidden_size"] ** 0.5
        elif k.endswith("layer_scalar"):
            params[k] = 0.5 + mx.random.uniform(shape=v.shape)
    model.update(tree_unflatten(list(params.items())))
    mx.eval(model.parameters())
    return model


def _hf_gemma4(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """mlx-lm's Gemma 4 names back to Google's: `model.language_model.*`, fused experts."""
    out = {}
    for k, v in weights.items():
        k = k.replace("language_model.model.", "model.language_model.")
        if k.endswith("experts.switch_glu.up_proj.weight"):
            continue
        if k.endswith("experts.switch_glu.gate_proj.weight"):
            up = weights[
                k.replace("model.language_model.", "language_model.model.").replace(
                    "gate_proj", "up_proj"
                )
            ]
            out[k.replace("switch_glu.gate_proj.weight", "gate_up_proj")] = mx.concatenate(
                [v, up], axis=-2
            )
        elif k.endswith("experts.switch_glu.down_proj.weight"):
            out[k.replace("switch_glu.down_proj.weight", "down_proj")] = v
        else:
            out[k] = v
    return out


def _hf_gpt_oss(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """mlx-lm's MXFP4 gpt-oss experts back to OpenAI's release: gate and up interleaved row by
    row in `gate_up_proj_{blocks,scales,bias}`, the 4-bit codes as bytes (16 per block of 32)."""
    out = {}
    for k, v in weights.items():
        if ".experts." not in k:
            out[k] = v
            continue
        base, proj, kind = k.rsplit(".", 2)  # ...experts, gate_proj, weight|scales|bias
        if proj == "up_proj":
            continue
        if proj == "gate_proj":  # rows gate 0, up 0, gate 1, up 1, ...
            up = weights[f"{base}.up_proj.{kind}"]
            rows = v.ndim - (1 if kind == "bias" else 2)
            v = mx.stack([v, up], axis=rows + 1)
            v = v.reshape(*v.shape[:rows], -1, *v.shape[rows + 2 :])
            proj = "gate_up_proj"
        if kind == "weight":  # uint32 words of 8 codes -> (..., blocks, 16 bytes)
            v = v.view(mx.uint8).reshape(*v.shape[:-1], -1, 16)
        out[f"{base}.{proj}_{dict(weight='blocks').get(kind, kind)}"] = v
    return out


# MiniMax's own release: FP8 (e4m3) weights in 128 x 128 blocks with an inverse scale each,
# as the published quantization_config declares it (copied from a public vLLM test fixture of
# MiniMax-M2's config); the router, its bias and the head stay in bf16.
MINIMAX_FP8 = {
    "activation_scheme": "dynamic",
    "fmt": "float8_e4m3fn",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
    "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"],
}


def _fp8_blocks(w: mx.array, block: int = 128) -> tuple[mx.array, mx.array]:
    """(e4m3 codes as bytes, inverse scales per block): w ~ codes * scale, block by block."""
    m, n = w.shape
    bm, bn = -(-m // block), -(-n // block)
    padded = mx.pad(w, ((0, bm * block - m), (0, bn * block - n)))
    blocks = padded.reshape(bm, block, bn, block)
    scale = mx.maximum(mx.abs(blocks).max(axis=(1, 3)), 1e-12) / 448.0
    codes = mx.to_fp8(blocks / scale[:, None, :, None]).reshape(bm * block, bn * block)
    return codes[:m, :n], scale


def _hf_minimax_fp8(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """mlx-lm's MiniMax names back to the release: experts one by one as w1 (gate), w3 (up),
    w2 (down), and every projection in FP8 blocks."""
    out: dict[str, mx.array] = {}
    names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    for k, v in weights.items():
        if ".switch_mlp." in k:
            base, proj = k.split(".switch_mlp.")
            for e in range(v.shape[0]):
                out[f"{base}.experts.{e}.{names[proj.split('.')[0]]}.weight"] = v[e]
        else:
            out[k] = v
    for k in [k for k in out if k.endswith("proj.weight") or ".experts." in k]:
        out[k], out[k + "_scale_inv"] = _fp8_blocks(out[k])
    return out


def write_family(path: str | Path, name: str, seed: int = 0, layout: str = "") -> Path:
    """A target folder of family `name`, shrunk, in the layout its users download;
    layout="hf": OpenAI's own gpt-oss release (MXFP4 `_blocks` / `_scales` tensors), MiniMax's
    own FP8 release; layout="nvfp4": an MLX conversion in NVFP4 (not for Gemma 4's layout)."""
    from mlx_lm.utils import save_config, save_model

    path = Path(path)
    cfg = shrink(FAMILIES[name])
    model = build(cfg, seed)
    if layout == "hf" and name == "minimax-m2":
        path.mkdir(parents=True, exist_ok=True)
        weights = _hf_minimax_fp8(dict(tree_flatten(model.parameters())))
        mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
        cfg["quantization_config"] = MINIMAX_FP8
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
    elif layout == "hf" and name == "gpt-oss-20b":
        nn.quantize(model, **MXFP4, class_predicate=_is_expert)
        path.mkdir(parents=True, exist_ok=True)
        weights = _hf_gpt_oss(dict(tree_flatten(model.parameters())))
        mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
        cfg["quantization_config"] = {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        }
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
    elif name.startswith("gemma4"):
        path.mkdir(parents=True, exist_ok=True)
        weights = _hf_gemma4(dict(tree_flatten(model.parameters())))
        mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
    else:
        if layout == "nvfp4":  # `mlx_lm.convert --q-mode nvfp4`: every linear layer in NVFP4
            nn.quantize(model, **NVFP4)
            cfg["quantization"] = cfg["quantization_config"] = dict(NVFP4)
        elif name == "gpt-oss-20b":  # mlx-community's MXFP4 copies: the experts quantized
            nn.quantize(model, **MXFP4, class_predicate=_is_expert)
            cfg["quantization"] = cfg["quantization_config"] = dict(MXFP4)
        save_model(path, model)
        save_config(cfg, path / "config.json")
    write_tiny_tokenizer(path, 256)
    return path


def attention_target(kind: str, path: Path):
    """A loaded target of one attention family, taps on its first and last layers: "llama",
    "qwen3_5" (Gated DeltaNet), "deepseek_v3" (MLA), or a FAMILIES name (sliding windows,
    sinks). For the tests that run every family's attention (packed forwards, batched rows)."""
    from mlx_dflash.models.target import load_target
    from mlx_dflash.models.tiny import write_tiny_target

    if kind == "deepseek_v3":
        from test_mla import CONFIGS, build, save_folder

        cfg = CONFIGS[kind]
        folder = save_folder(path, build(cfg), cfg)
    elif kind in FAMILIES:
        folder = write_family(path, kind)
    else:
        folder = write_tiny_target(path, kind)
    target = load_target(folder)
    if kind in ("llama", "qwen3_5"):
        diversify(target.model)
    target.set_taps([0, target.num_layers - 1])
    return target


def _tiny(kind: str, **overrides: Any):
    from mlx_dflash.models.tiny import write_tiny_target

    return lambda path: write_tiny_target(path, kind, **overrides)


def _mistral(path: Path) -> Path:
    """Mistral's config names its own type over Llama's layers (mlx-lm builds it as llama)."""
    _tiny("llama")(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"])
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def _named(name: str):
    return lambda path: write_family(path, name)


def _mla(model_type: str):
    def write(path: Path) -> Path:
        from test_mla import CONFIGS, build, save_folder

        return save_folder(path, build(CONFIGS[model_type]), CONFIGS[model_type])

    return write


def _muse(path: Path) -> Path:
    from published import write_published

    return write_published(path, "meta-models/Muse-Glimmer-30B", "hf")


def _text_only(name: str):
    """A text-only export: the wrapper's text_config as the whole config.json."""

    def write(path: Path) -> Path:
        from mlx_lm.utils import save_config, save_model

        cfg = shrink(FAMILIES[name])["text_config"]
        save_model(path, build(cfg, 0))
        save_config(cfg, path / "config.json")
        write_tiny_tokenizer(path, 256)
        return path

    return write


# Every target family models/families.py registers, and the fixture that writes one: a new
# family is one entry there and one line here (tests/test_families.py checks that every entry
# has its fixture and that each fixture's forward is mlx-lm's).
FIXTURES = {
    "llama": _tiny("llama"),
    "mistral": _mistral,
    "qwen2": _tiny("qwen2"),
    "qwen3": _tiny("qwen3"),
    "qwen3_moe": _tiny("qwen3_moe"),
    "qwen3_5": _tiny("qwen3_5"),
    "qwen3_5_moe": _tiny("qwen3_5_moe"),
    "qwen3_next": _tiny("qwen3_next"),
    "deepseek_v3": _mla("deepseek_v3"),
    "kimi_k25": _mla("kimi_k25"),
    "muse_glimmer": _muse,
    "gemma4": _named("gemma4-31b"),
    "gemma4_text": _text_only("gemma4-31b"),
    "gpt_oss": _named("gpt-oss-20b"),
    "minimax": _named("minimax-m2"),
    "glm4_moe": _named("glm4-moe"),
    "mimo_v2_flash": _named("mimo-v2-flash"),
}
