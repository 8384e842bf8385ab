"""The registry's targets and drafters as they are published, shrunk: fixtures for layout tests.

Each config below is the published config.json with every field it carries (transcribed from the
Hugging Face repos; the Qwen3.5 ones keep the multimodal wrapper, `text_config` and
`vision_config`). `shrink` changes only sizes (and token ids, which must fit the shrunk
vocabulary), so whatever loads here meets the same fields, nesting and key names as what users
download. Writers produce each layout users have:

- `hf`: the original checkpoint: torch key names (`model.language_model.*`, `lm_head.weight` at
  the top, per-expert or fused expert tensors, torch conv layout, zero-centred norms for
  Qwen3.5), vision-tower and MTP tensors that must be dropped;
- `hf-text`: a text-only export of a Qwen3.5 model (`model_type: qwen3_5_text`, flat config);
- `mlx-lm-4bit` / `mlx-lm-8bit`: what `mlx_lm.convert -q` writes (mlx-community's MLX repos);
- `mlx-vlm-4bit`: mlx-vlm's conversion of a Qwen3.5 model (`language_model.` prefixes, vision
  tower kept, its `vision_config`).

Weights are float32 (the one departure from the published bf16), because greedy exactness is
only defined in float32 (docs/dflash.md). The HF layouts are written by inverting what
mlx-lm's `sanitize` undoes, so they do not depend on the code under test.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlx_dflash.models.tiny import _published_taps, _unstack_experts, write_tiny_tokenizer

# --------------------------------------------------------------------------------------------
# Published config.json files


def _hybrid_layer_types(n: int, interval: int = 4) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_4B = {
    **QWEN3_8B,
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "tie_word_embeddings": True,
}
QWEN3_CODER_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5472,
    "max_position_embeddings": 262144,
    "max_window_layers": 28,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "qkv_bias": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000000,
    "router_aux_loss_coef": 0.0,
    "shared_expert_intermediate_size": 0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_qk_norm": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
LLAMA_3_1_8B_INSTRUCT = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.42.3",
    "use_cache": True,
    "vocab_size": 128256,
}

_QWEN3_5_VISION = {
    "deepstack_visual_indexes": [],
    "depth": 27,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "in_channels": 3,
    "initializer_range": 0.02,
    "intermediate_size": 4304,
    "model_type": "qwen3_5",
    "num_heads": 16,
    "num_position_embeddings": 2304,
    "out_hidden_size": 4096,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}


def _qwen3_5_text(
    hidden: int, layers: int, heads: int, kv: int, inter: int, v_heads: int, tie: bool
) -> dict[str, Any]:
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": 248044,
        "dtype": "bfloat16",
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": inter,
        "layer_types": _hybrid_layer_types(layers),
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": v_heads,
        "linear_value_head_dim": 128,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144,
        "model_type": "qwen3_5_text",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv,
        "pad_token_id": None,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "tie_word_embeddings": tie,
        "use_cache": True,
        "vocab_size": 248320,
    }


def _qwen3_5_wrapper(model_type: str, arch: str, text: dict[str, Any]) -> dict[str, Any]:
    return {
        "architectures": [arch],
        "image_token_id": 248056,
        "model_type": model_type,
        "text_config": text,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "transformers_version": "4.57.1",
        "video_token_id": 248057,
        "vision_config": {**_QWEN3_5_VISION, "out_hidden_size": text["hidden_size"]},
        "vision_end_token_id": 248054,
        "vision_start_token_id": 248053,
    }


QWEN3_5_4B = _qwen3_5_wrapper(
    "qwen3_5",
    "Qwen3_5ForConditionalGeneration",
    _qwen3_5_text(2560, 32, 16, 4, 9216, 32, tie=True),
)
QWEN3_5_9B = _qwen3_5_wrapper(
    "qwen3_5",
    "Qwen3_5ForConditionalGeneration",
    _qwen3_5_text(4096, 32, 16, 4, 12288, 32, tie=False),
)
QWEN3_5_27B = _qwen3_5_wrapper(
    "qwen3_5",
    "Qwen3_5ForConditionalGeneration",
    _qwen3_5_text(5120, 64, 24, 4, 17408, 48, tie=False),
)
_moe_text = _qwen3_5_text(2048, 40, 16, 2, 0, 32, tie=False)
del _moe_text["intermediate_size"]
_moe_text.update(
    {
        "mlp_only_layers": [],
        "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": 512,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512,
    }
)
QWEN3_5_35B_A3B = _qwen3_5_wrapper(
    "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", dict(sorted(_moe_text.items()))
)
QWEN3_5_35B_A3B["vision_config"]["model_type"] = "qwen3_5_moe"

# Qwen3.8-27B: no verbatim copy was found; this is the text_config of a verbatim community
# quant's config (SOURCES.md, "Targets of DFlash2"), on the wrapper of the Qwen3.5 exports.
_qwen3_8_text = _qwen3_5_text(5120, 64, 24, 4, 17408, 48, tie=False)
_qwen3_8_text["output_gate_type"] = "swish"
_qwen3_8_text["rope_parameters"] = {
    "mrope_interleaved": True,
    "mrope_section": [11, 11, 10],
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000000,
    "rope_type": "default",
}
QWEN3_8_27B = _qwen3_5_wrapper("qwen3_5", "Qwen3_5ForConditionalGeneration", _qwen3_8_text)
QWEN3_8_27B["transformers_version"] = "5.15.0"

# Muse-Glimmer-30B: the fields SOURCES.md lists ("Targets of DFlash2"; no complete published
# copy was found), in the nested layout mlx-lm's muse_glimmer reads; token ids from the
# verbatim assistant config beside it.
MUSE_GLIMMER_30B = {
    "architectures": ["MuseGlimmerForConditionalGeneration"],
    "model_type": "muse_glimmer",
    "text_config": {
        "model_type": "muse_glimmer_text",
        "hidden_size": 6656,
        "num_hidden_layers": 52,
        "intermediate_size": 19968,
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "vocab_size": 202048,
        "rms_norm_eps": 1e-05,
        "post_norm_eps": 1e-08,
        "sliding_window": 2048,
        "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 13,
        "layer_rope_theta": ([500000.0] * 3 + [0.0]) * 13,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "qk_scale_factor": 3.87,
        "output_multiplier": 0.19611613513818404,
        "final_logit_softcapping": 20.0,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "bos_token_id": 200000,
        "eos_token_id": 200001,
        "pad_token_id": 200018,
    },
    "vision_config": {"depth": 50, "hidden_size": 1536},
    "tie_word_embeddings": False,
}
MUSE_WINDOW = 10  # the shrunk sliding_window (2048 published): the tests decode past it

TARGETS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-4B": QWEN3_4B,
    "Qwen/Qwen3-8B": QWEN3_8B,
    "Qwen/Qwen3-Coder-30B-A3B-Instruct": QWEN3_CODER_30B_A3B,
    "meta-llama/Llama-3.1-8B-Instruct": LLAMA_3_1_8B_INSTRUCT,
    "Qwen/Qwen3.5-4B": QWEN3_5_4B,
    "Qwen/Qwen3.5-9B": QWEN3_5_9B,
    "Qwen/Qwen3.5-27B": QWEN3_5_27B,
    "Qwen/Qwen3.5-35B-A3B": QWEN3_5_35B_A3B,
    "Qwen/Qwen3.8-27B": QWEN3_8_27B,
    "meta-models/Muse-Glimmer-30B": MUSE_GLIMMER_30B,
}


def drafter_config(target_id: str) -> dict[str, Any]:
    """A z-lab drafter's config.json for `target_id` (field set of the published exports:
    Qwen3-style layers, `dflash_config` with the mask token and tapped layers)."""
    t = text_of(TARGETS[target_id])
    n_target = t["num_hidden_layers"]
    qwen3_5 = "rope_parameters" in t
    cfg: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": 16,
        "bos_token_id": t.get("bos_token_id"),
        "dflash_config": {
            "mask_token_id": {151936: 151669, 248320: 248070, 128256: 128002}[t["vocab_size"]],
            "target_layer_ids": _published_taps(n_target, 5),
        },
        "dtype": "bfloat16",
        "eos_token_id": t.get("eos_token_id"),
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": t["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": 3 * t["hidden_size"],
        "layer_types": ["full_attention"] * 5,
        "max_position_embeddings": t["max_position_embeddings"],
        "max_window_layers": 5,
        "model_type": "qwen3",
        "num_attention_heads": 32,
        "num_hidden_layers": 5,
        "num_key_value_heads": 8,
        "num_target_layers": n_target,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "transformers_version": "4.57.1",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": t["vocab_size"],
    }
    if qwen3_5:  # transformers 5 exports: rope_parameters, block size inside dflash_config
        del cfg["rope_scaling"], cfg["rope_theta"], cfg["block_size"]
        cfg["rope_parameters"] = {"rope_theta": 10000000, "rope_type": "default"}
        cfg["dflash_config"]["block_size"] = 16
    return cfg


def text_of(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg.get("text_config", cfg)


# --------------------------------------------------------------------------------------------
# Shrinking: sizes (and the token ids that must fit the vocabulary) only

VOCAB = 256
_SIZES = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": VOCAB,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "max_window_layers": None,  # follows the layer count
}
# Token ids of the tiny tokenizer (mlx_dflash.models.tiny.write_tiny_tokenizer): <s> = 1, </s> = 2.
_BOS, _EOS = 1, 2


def _shrink_ids(key: str, value: Any) -> Any:
    if value is None:
        return None
    if key == "bos_token_id":
        return _BOS
    if key == "eos_token_id":
        return [_EOS, VOCAB - 3, VOCAB - 4][: len(value)] if isinstance(value, list) else _EOS
    if key == "pad_token_id":
        return VOCAB - 2
    return (
        VOCAB
        - 5
        - ["image", "video", "vision_start", "vision_end"].index(key.removesuffix("_token_id"))
    )


def _shrink_text(t: dict[str, Any], layers: int) -> dict[str, Any]:
    t = copy.deepcopy(t)
    for key, size in _SIZES.items():
        if key in t:
            t[key] = layers if key == "max_window_layers" else size
    t["num_hidden_layers"] = layers
    if t.get("shared_expert_intermediate_size"):
        t["shared_expert_intermediate_size"] = 64
    if t.get("model_type") == "muse_glimmer_text":  # 3 sliding layers to 1 global NoPE one
        t["layer_types"] = t["layer_types"][:layers]
        t["layer_rope_theta"] = t["layer_rope_theta"][:layers]
        t["sliding_window"] = MUSE_WINDOW
    elif "layer_types" in t:
        t["layer_types"] = _hybrid_layer_types(layers, t.get("full_attention_interval", 4))
    rope = t.get("rope_parameters")
    if rope and "mrope_section" in rope:  # halves of the rotary dims: 16 * 0.25 / 2 = 2
        rope["mrope_section"] = [1, 1, 0]
    for key in list(t):
        if key.endswith("_token_id"):
            t[key] = _shrink_ids(key, t[key])
    return t


def shrink(cfg: dict[str, Any]) -> dict[str, Any]:
    """The published config with tiny sizes: 6 layers (8 for hybrids: two full-attention ones)."""
    hybrid = "text_config" in cfg
    layers = 8 if hybrid else 6
    if not hybrid:
        return _shrink_text(cfg, layers)
    out = copy.deepcopy(cfg)
    out["text_config"] = _shrink_text(cfg["text_config"], layers)
    vision = out["vision_config"]
    if cfg["model_type"] == "muse_glimmer":
        vision.update(depth=1, hidden_size=32)
    else:
        vision.update(depth=1, hidden_size=32, intermediate_size=64, num_heads=2)
        vision.update(out_hidden_size=64, num_position_embeddings=16)
    for key in list(out):
        if key.endswith("_token_id"):
            out[key] = _shrink_ids(key, out[key])
    return out


def shrink_drafter(cfg: dict[str, Any], target: dict[str, Any]) -> dict[str, Any]:
    """A published drafter config shrunk to fit a shrunk target (taps by the published rule)."""
    t = text_of(target)
    out = copy.deepcopy(cfg)
    n_target = t["num_hidden_layers"]
    out.update(
        hidden_size=t["hidden_size"],
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_window_layers=2,
        layer_types=["full_attention"] * 2,
        num_target_layers=n_target,
        bos_token_id=_shrink_ids("bos_token_id", out.get("bos_token_id")),
        eos_token_id=_shrink_ids("eos_token_id", out.get("eos_token_id")),
    )
    out["dflash_config"]["mask_token_id"] = VOCAB - 1
    out["dflash_config"]["target_layer_ids"] = _published_taps(n_target, 2)
    return out


# --------------------------------------------------------------------------------------------
# Writers

LAYOUTS = ("hf", "hf-text", "mlx-lm-4bit", "mlx-lm-8bit", "mlx-vlm-4bit")
HYBRID_ONLY = ("hf-text", "mlx-vlm-4bit")


def _random_model(cfg: dict[str, Any], seed: int):
    """mlx-lm's model for `cfg`, with weights that give varied greedy continuations."""
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(copy.deepcopy(cfg)))
    mx.random.seed(seed)
    new = []
    for k, v in tree_flatten(model.parameters()):
        if k.endswith("A_log"):
            new.append((k, mx.random.uniform(0.0, 1.0, v.shape)))
        elif v.ndim == 1:
            new.append((k, 1.0 + 0.1 * mx.random.normal(v.shape)))
        elif "embed" in k:
            new.append((k, mx.random.normal(v.shape)))
        else:
            fan_in = v.shape[-1]
            new.append((k, mx.random.normal(v.shape) * 2.0 / fan_in**0.5))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())
    return model


# mlx-lm adds 1 to these (Qwen3.5 stores RMSNorm weights zero-centred) and moves conv axes.
_ZERO_CENTRED = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


def _hf_qwen3_5(weights: dict[str, mx.array], text_only: bool, moe: bool) -> dict[str, mx.array]:
    """mlx-lm's Qwen3.5 parameters back into the published torch tensors."""
    out: dict[str, mx.array] = {}
    for k, v in weights.items():
        k = k.removeprefix("language_model.")
        if "conv1d.weight" in k:
            v = v.moveaxis(1, 2)  # MLX (C, K, 1) -> torch (C, 1, K)
        if v.ndim == 1 and any(k.endswith(s) for s in _ZERO_CENTRED):
            v = v - 1.0
        if ".mlp.switch_mlp." in k:
            prefix, rest = k.split(".mlp.switch_mlp.")
            if rest.startswith("down_proj"):
                out[f"{prefix}.mlp.experts.down_proj"] = v
            elif rest.startswith("gate_proj"):
                up = weights[f"language_model.{prefix}.mlp.switch_mlp.up_proj.weight"]
                out[f"{prefix}.mlp.experts.gate_up_proj"] = mx.concatenate([v, up], axis=-2)
            continue
        if k.startswith("model.") and not text_only:
            k = "model.language_model." + k.removeprefix("model.")
        out[k] = v
    # Published extras that loaders must drop: the vision tower and the MTP head.
    h = int(weights["language_model.model.embed_tokens.weight"].shape[-1])
    out["mtp.fc.weight"] = mx.random.normal((h, 2 * h))
    out["mtp.layers.0.input_layernorm.weight"] = mx.zeros((h,))
    if not text_only:
        out["model.visual.patch_embed.proj.weight"] = mx.random.normal((32, 3, 2, 16, 16))
        out["model.visual.blocks.0.attn.qkv.weight"] = mx.random.normal((96, 32))
        out["model.visual.merger.linear_fc2.weight"] = mx.random.normal((h, 128))
    return out


def _hf_muse_glimmer(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """mlx-lm's Muse Glimmer parameters under Meta's nesting, with a vision tensor to drop."""
    out = {
        ("model.language_model." + k.removeprefix("model.") if k.startswith("model.") else k): v
        for k, v in weights.items()
    }
    out["vision_tower.blocks.0.attn.qkv.weight"] = mx.random.normal((96, 32))
    return out


def write_published(path: str | Path, target_id: str, layout: str, seed: int = 0) -> Path:
    """A shrunk copy of `target_id` in `layout` (see the module docstring) at `path`."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}")
    path = Path(path)
    cfg = shrink(TARGETS[target_id])
    hybrid = "text_config" in cfg
    if layout in HYBRID_ONLY and not cfg["model_type"].startswith("qwen3_5"):
        raise ValueError(f"{layout} exists only for Qwen3.5 targets")
    if layout.startswith("mlx-"):
        hf = write_published(path.parent / f".{path.name}-hf", target_id, "hf", seed)
        return _mlx_conversion(hf, path, layout, cfg)
    model = _random_model(cfg, seed)
    weights = dict(tree_flatten(model.parameters()))
    if cfg["model_type"] == "muse_glimmer":
        weights = _hf_muse_glimmer(weights)
    elif hybrid:
        weights = _hf_qwen3_5(weights, layout == "hf-text", "num_experts" in cfg["text_config"])
        if layout == "hf-text":
            cfg = {
                "architectures": [
                    cfg["architectures"][0].replace("ForConditionalGeneration", "ForCausalLM")
                ],
                **cfg["text_config"],
            }
    else:
        weights = _unstack_experts(weights)
    path.mkdir(parents=True, exist_ok=True)
    # Two shards and an index, as large checkpoints are published.
    names = sorted(weights)
    half = len(names) // 2
    index = {"metadata": {"total_size": 0}, "weight_map": {}}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        mx.save_safetensors(str(path / fname), {k: weights[k] for k in part}, {"format": "pt"})
        index["weight_map"].update({k: fname for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tiny_tokenizer(path, VOCAB)
    return path


def _mlx_conversion(hf: Path, path: Path, layout: str, cfg: dict[str, Any]) -> Path:
    """mlx-community's MLX repos: mlx_lm.convert's output (mlx-vlm adds its vision tower)."""
    import contextlib
    import io

    from mlx_lm import convert as mlx_lm_convert

    bits = int(layout.split("-")[-1].removesuffix("bit"))
    with contextlib.redirect_stdout(io.StringIO()):
        mlx_lm_convert(str(hf), str(path), quantize=True, q_bits=bits, dtype="float32")
    if layout.startswith("mlx-vlm"):
        saved = json.loads((path / "config.json").read_text())
        saved["vision_config"] = cfg["vision_config"]
        (path / "config.json").write_text(json.dumps(saved, indent=2))
        vision = {
            "vision_tower.patch_embed.proj.weight": mx.random.normal((32, 2, 16, 16, 3)),
            "vision_tower.blocks.0.attn.qkv.weight": mx.random.normal((96, 32)),
            "vision_tower.merger.linear_fc2.weight": mx.random.normal((64, 128)),
        }
        mx.save_safetensors(str(path / "model-vision.safetensors"), vision, {"format": "mlx"})
        index_file = path / "model.safetensors.index.json"
        if index_file.exists():
            index = json.loads(index_file.read_text())
            index["weight_map"].update({k: "model-vision.safetensors" for k in vision})
            index_file.write_text(json.dumps(index, indent=2))
    return path


def write_published_drafter(path: str | Path, target_id: str, seed: int = 1) -> Path:
    """The z-lab drafter for `target_id`, shrunk to fit `shrink(TARGETS[target_id])`."""
    from mlx_dflash.checkpoints.registry import DRAFTERS
    from mlx_dflash.models.tiny import write_drafter_checkpoint

    small = shrink(TARGETS[target_id])
    if DRAFTERS[target_id] in DFLASH2_DRAFTERS:
        return write_dflash2_drafter(
            path, shrink_dflash2(dflash2_config(DRAFTERS[target_id]), small), seed
        )
    cfg = shrink_drafter(drafter_config(target_id), small)
    return write_drafter_checkpoint(path, cfg, seed=seed)


# --------------------------------------------------------------------------------------------
# DFlash 2 drafters: the verbatim published configs in ../shared/data/configs (see SOURCES.md)

DFLASH2_DRAFTERS = {
    # drafter -> the registry target whose shrunk fixture it drafts for in tests
    "z-lab/Qwen3.8-27B-DFlash2": "Qwen/Qwen3.8-27B",
    "z-lab/Muse-Glimmer-30B-DFlash2": "meta-models/Muse-Glimmer-30B",
}
DFLASH2_WINDOW = 12  # the shrunk sliding_window (2048 published): tests run past it


def shared_configs() -> Path:
    import os

    root = Path(os.environ.get("DFLASH_SHARED", Path(__file__).parents[1] / ".." / "shared"))
    return root.resolve() / "data" / "configs"


def published_file(name: str) -> dict[str, Any]:
    """A verbatim published config (or header) by file name; skips the test where absent."""
    path = shared_configs() / name
    if not path.exists():
        import pytest

        pytest.skip(f"needs {path} (the project's shared/ material), which is absent")
    return json.loads(path.read_text())


def dflash2_config(drafter_id: str) -> dict[str, Any]:
    return published_file(drafter_id.replace("/", "__") + ".config.json")


def shrink_dflash2(cfg: dict[str, Any], target: dict[str, Any], layers: int = 2) -> dict[str, Any]:
    """A published DFlash 2 config with tiny sizes for a shrunk target: every field and its
    nesting stays (top-level is_causal, rope_parameters only, bos_token_id null)."""
    t = text_of(target)
    out = copy.deepcopy(cfg)
    n_target = t["num_hidden_layers"]
    out.update(
        hidden_size=t["hidden_size"],
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,  # attention width 96 != hidden 64, as published (4096 vs 5120 / 6656)
        intermediate_size=128,
        vocab_size=VOCAB,
        max_window_layers=layers,
        layer_types=["sliding_attention"] * layers,
        sliding_window=DFLASH2_WINDOW,
        num_target_layers=n_target,
        bos_token_id=_shrink_ids("bos_token_id", out.get("bos_token_id")),
        eos_token_id=_shrink_ids("eos_token_id", out.get("eos_token_id")),
        pad_token_id=_shrink_ids("pad_token_id", out.get("pad_token_id")),
    )
    d = out["dflash_config"]
    d.update(
        mask_token_id=VOCAB - 1,
        target_layer_ids=_published_taps(n_target, len(d["target_layer_ids"])),
        selector_rank=32,
    )
    return out


def dflash2_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a DFlash 2 drafter under its published name (the Muse header's 81 at
    full size), shaped from the config alone."""
    from mlx_dflash.models.tiny import drafter_tensor_shapes

    d = cfg["dflash_config"]
    hidden, k, g = cfg["hidden_size"], d["conv_kernel_size"], d["conv_group_size"]
    shapes = drafter_tensor_shapes(cfg)
    for i in range(cfg["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            shapes[f"layers.{i}.{conv}.base_kernel"] = (2, k, hidden)
            shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * k * hidden // g, hidden)
    r, vocab = d["selector_rank"], cfg["vocab_size"]
    shapes["candidate_selector.predecessor_codebook"] = (vocab, r)
    shapes["candidate_selector.successor_codebook"] = (vocab, r)
    shapes["candidate_selector.hidden_projection.weight"] = (r, hidden)
    return shapes


def write_dflash2_drafter(
    path: str | Path, cfg: dict[str, Any], seed: int = 1, drop: tuple[str, ...] = ()
) -> Path:
    """A DFlash 2 drafter folder with random weights in the published layout. The selector's
    scales are set so that its pairwise term moves the drafts (random codebooks of std 0.05
    would leave the chain equal to the argmax, and the tests could not tell them apart)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    weights = {}
    for name, shape in dflash2_shapes(cfg).items():
        if name in drop:
            continue
        if len(shape) == 1 and "norm" in name:
            w = 1.0 + 0.05 * mx.random.normal(shape)
        elif "codebook" in name:
            w = mx.random.normal(shape)
        elif "hidden_projection" in name:
            w = 0.5 * mx.random.normal(shape)
        else:
            w = 0.05 * mx.random.normal(shape)
        weights[name] = w
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path
