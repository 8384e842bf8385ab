"""Tiny random checkpoints: mlx-lm targets and z-lab-style DFlash drafters, for the tests, the
overhead case (scripts/overhead_case.py) and anyone trying the engine on a new architecture
without downloading it.

Everything is built from scratch (no network): targets with mlx-lm's own model classes so that
`mlx_lm.load` reads them back, drafters with the exact z-lab tensor names and torch `[out, in]`
shapes of ../shared/docs/algorithm.md §1, written independently of the code under test.
"""

from __future__ import annotations

import copy
import importlib
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map, tree_unflatten

TARGET_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
HYBRID_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
ARCHS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_next": "Qwen3NextForCausalLM",
}
DRAFTER_VARIANTS = (
    "toplevel_block_size",
    "dflash_config_block_size",
    "rope_parameters",
    "no_target_layer_ids",
    "sliding",
    "is_causal",
    "embedding_scale_softcap",
    "use_swa_sinks",
    "attention_bias",
    "assistant",
    "yarn",
    "tied_softcap",
)

# Tokenizer layout: specials, then byte-level symbols for printable ASCII, then letter-pair merges.
UNK, BOS, EOS = "<unk>", "<s>", "</s>"
_SPECIALS = (UNK, BOS, EOS)
_CHARS = "\n\t" + "".join(chr(c) for c in range(32, 127))


def _dtype(dtype: str | mx.Dtype) -> mx.Dtype:
    return getattr(mx, dtype) if isinstance(dtype, str) else dtype


def _merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Shallow-merge overrides; a value of None deletes the key (to build variants lacking it)."""
    out = copy.deepcopy(base)
    for k, v in overrides.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = copy.deepcopy(v)
    return out


# --------------------------------------------------------------------------------------------
# Targets


_MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
}


def tiny_target_config(model_type: str, **overrides: Any) -> dict[str, Any]:
    """A small valid config.json for an mlx-lm model type; kwargs override (None deletes)."""
    if model_type not in ARCHS:
        raise ValueError(
            f"tiny targets exist for {TARGET_TYPES + HYBRID_TYPES}, not {model_type!r}"
        )
    cfg: dict[str, Any] = {
        "architectures": [ARCHS[model_type]],
        "model_type": model_type,
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "vocab_size": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        # Both tied and untied heads get exercised across the types.
        "tie_word_embeddings": model_type in ("qwen2", "qwen3"),
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    if model_type == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    if model_type in HYBRID_TYPES:
        # Gated DeltaNet layers (3 of every 4) + gated full attention with partial RoPE.
        cfg.update(
            num_hidden_layers=8,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            full_attention_interval=4,
            partial_rotary_factor=0.5,
            tie_word_embeddings=model_type != "qwen3_next",
        )
        if model_type.startswith("qwen3_5"):
            cfg["rope_parameters"] = {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            }
    if model_type == "qwen3_moe":
        cfg.update(_MOE, moe_intermediate_size=64)
    if model_type in ("qwen3_5_moe", "qwen3_next"):
        cfg.update(_MOE, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    return _merge(cfg, overrides)


def _byte_symbol(ch: str) -> str:
    """GPT-2's byte-to-unicode map for one ASCII character (space -> 'Ġ', newline -> 'Ċ')."""
    b = ord(ch)
    if 33 <= b <= 126:
        return ch
    return chr(256 + [*range(0, 33), 127].index(b))


def _tokenizer_model(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    tokens = list(_SPECIALS) + [_byte_symbol(c) for c in _CHARS]
    if vocab_size < len(tokens):
        raise ValueError(f"the tiny tokenizer needs vocab_size >= {len(tokens)}")
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    pairs = [(a, b) for a in ("Ġ", *letters) for b in letters]
    merges = pairs[: vocab_size - len(tokens)]
    tokens += [a + b for a, b in merges]
    return {t: i for i, t in enumerate(tokens)}, merges


def write_tiny_tokenizer(path: str | Path, vocab_size: int) -> Path:
    """A byte-level BPE tokenizer (the Llama-3 / Qwen kind) whose ids fill exactly `vocab_size`.

    Every printable ASCII character, newline and tab is a base token, so English prompts encode
    without loss; letter-pair merges pad the vocabulary, so every id decodes to real text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab, merges = _tokenizer_model(vocab_size)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([UNK, BOS, EOS])
    tok.save(str(path / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "TokenizersBackend",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "add_bos_token": False,
        "model_max_length": 4096,
        "chat_template": (
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}"
        ),
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    special = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK}
    (path / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    return path


def _randomize(params: dict, std: float) -> dict:
    """Normal(0, std) for matrices, 1 + small noise for norm (1-D) weights, zeros for biases."""
    flat = []
    for name, v in cast(list[tuple[str, mx.array]], tree_flatten(params)):
        if v.ndim == 1 and name.endswith("bias"):
            new = mx.zeros(v.shape)
        elif v.ndim == 1:
            new = 1.0 + 0.05 * mx.random.normal(v.shape)
        else:
            new = std * mx.random.normal(v.shape)
        flat.append((name, new))
    return dict(flat)


def write_tiny_target(
    path: str | Path,
    model_type: str,
    seed: int = 0,
    dtype: str | mx.Dtype = "float32",
    hf_layout: bool = False,
    **overrides: Any,
) -> Path:
    """A random model folder (config, weights, tokenizer) that `mlx_lm.load` accepts.

    By default the weights are written by mlx-lm's own `save_model`, so the folder is a ready
    MLX target. With `hf_layout` they are written as a Hugging Face export would hold them
    (MoE experts unstacked into `experts.{e}.*`, torch_dtype metadata "pt"), which exercises
    mlx-lm's `sanitize` on the way in. Weight std 0.1 keeps the logits far from uniform, so
    greedy decoding is not constant. Other kwargs override config fields.
    """
    from mlx_lm.utils import _get_classes, save_config, save_model

    path = Path(path)
    cfg = tiny_target_config(model_type, **overrides)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(cfg))
    model.update(tree_unflatten(list(_randomize(model.parameters(), std=0.1).items())))
    dt = _dtype(dtype)
    model.update(tree_map(lambda v: v.astype(dt), model.parameters()))
    mx.eval(model.parameters())
    if hf_layout:
        path.mkdir(parents=True, exist_ok=True)
        weights = _unstack_experts(dict(tree_flatten(model.parameters())))
        mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    else:
        save_model(path, model)
    cfg["torch_dtype"] = str(dt).split(".")[-1]
    save_config(cfg, path / "config.json")
    write_tiny_tokenizer(path, cfg["vocab_size"])
    return path


def _unstack_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """mlx-lm's stacked `switch_mlp.X.weight` [E, out, in] back to HF's per-expert tensors."""
    out = {}
    for k, v in weights.items():
        if ".mlp.switch_mlp." in k:
            prefix, rest = k.split(".mlp.switch_mlp.")
            for e in range(v.shape[0]):
                out[f"{prefix}.mlp.experts.{e}.{rest}"] = v[e]
        else:
            out[k] = v
    return out


# --------------------------------------------------------------------------------------------
# Drafters


def _published_taps(num_target_layers: int, n: int) -> list[int]:
    """../shared/docs/algorithm.md §1 rule, restated here so the tests do not trust the code under test."""
    if n == 1:
        return [num_target_layers // 2]
    return [int(round(1 + i * (num_target_layers - 4) / (n - 1))) for i in range(n)]


def drafter_config_dict(
    variant: str,
    target_cfg: Mapping[str, Any],
    n_layers: int = 2,
    block_size: int = 16,
    **overrides: Any,
) -> dict[str, Any]:
    """A raw z-lab-style drafter config.json for `target_cfg`, in one published variant of
    DRAFTER_VARIANTS (the newer drafters' fields: `_published_variant`). Top-level kwargs
    override (None deletes a key); a `dflash_config={...}` kwarg is merged into the nested block
    the same way. The mask token is the target's last vocabulary id.
    """
    if variant not in DRAFTER_VARIANTS:
        raise ValueError(f"unknown drafter variant {variant!r}; use one of {DRAFTER_VARIANTS}")
    t = dict(target_cfg.get("text_config", target_cfg))
    n_target = int(t["num_hidden_layers"])
    hidden = int(t["hidden_size"])
    n_heads = int(t["num_attention_heads"])
    cfg: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(t.get("num_key_value_heads") or n_heads),
        "head_dim": int(t.get("head_dim") or hidden // n_heads),
        "intermediate_size": int(t.get("intermediate_size", 2 * hidden)),
        "rms_norm_eps": 1e-6,
        "vocab_size": int(t["vocab_size"]),
        "max_position_embeddings": 4096,
        "rope_theta": float(t.get("rope_theta", 10000.0)),
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "num_target_layers": n_target,
        "block_size": block_size,
        "dflash_config": {
            "mask_token_id": int(t["vocab_size"]) - 1,
            "target_layer_ids": _published_taps(n_target, n_layers),
        },
    }
    dflash = cfg["dflash_config"]
    if variant == "dflash_config_block_size":
        del cfg["block_size"]
        dflash["block_size"] = block_size
    elif variant == "rope_parameters":
        del cfg["rope_theta"], cfg["rope_scaling"]
        cfg["rope_parameters"] = {"rope_theta": 1000000.0, "rope_type": "default"}
    elif variant == "no_target_layer_ids":
        del dflash["target_layer_ids"]
    elif variant == "sliding":
        cfg["layer_types"] = ["sliding_attention"] * (n_layers - 1) + ["full_attention"]
        cfg["sliding_window"] = 8
        cfg["use_sliding_window"] = True
    elif variant == "is_causal":
        dflash["is_causal"] = True
    elif variant == "embedding_scale_softcap":
        dflash["input_embedding_scale"] = math.sqrt(hidden)
        dflash["final_logit_softcapping"] = 30.0
        dflash["output_multiplier"] = 0.5
    else:
        _published_variant(variant, cfg, n_target)
    dflash_overrides = overrides.pop("dflash_config", None) or {}
    cfg = _merge(cfg, overrides)
    if "dflash_config" in cfg or dflash_overrides:
        cfg["dflash_config"] = _merge(cfg.get("dflash_config", {}), dflash_overrides)
    return cfg


def _published_variant(variant: str, cfg: dict[str, Any], n_target: int) -> None:
    """The fields newer published drafters add, in place (values as published; sizes fit the
    tiny target). Sources: ../shared/data/configs/SOURCES.md and the verbatim configs there."""
    dflash = cfg["dflash_config"]
    if variant == "use_swa_sinks":  # XiaomiMiMo/MiMo-V2.5-Pro-FP4-DFlash (verbatim config)
        cfg.update(v_head_dim=cfg["head_dim"], partial_rotary_factor=0.5, sliding_window=8)
        dflash.update(use_swa=True, swa_window_size=8, attention_sink_bias=True)
        dflash.update(attention_value_scale=0.612, num_anchors=4096, loss_decay_gamma=7.0)
        dflash.update(backbone_rotary_base=5000000)
        dflash["target_layer_ids"] = [0, n_target // 2, n_target - 1]  # the last layer too
    elif variant == "attention_bias":  # gpt-oss-20b-DFlash
        cfg.update(model_type="gpt_oss", attention_bias=True, rope_theta=150000.0)
    elif variant == "assistant":  # meta-models/Muse-Glimmer-30B-assistant (verbatim config)
        cfg.update(architectures=["MuseGlimmerAssistantModel"], model_type="muse_glimmer_assistant")
        del cfg["vocab_size"], cfg["num_target_layers"], cfg["dflash_config"]
        cfg.update(
            mask_token_id=dflash["mask_token_id"], target_layer_ids=dflash["target_layer_ids"]
        )
    elif variant == "yarn":  # Kimi-K2.6-DFlash: yarn in rope_parameters
        del cfg["rope_theta"], cfg["rope_scaling"]
        cfg["rope_parameters"] = {
            "rope_theta": 50000.0,
            "rope_type": "yarn",
            "factor": 64.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        }
    elif variant == "tied_softcap":  # gemma-4-31B-it-DFlash
        cfg.update(tie_word_embeddings=True, final_logit_softcapping=30.0, rope_theta=1000000.0)


def drafter_tensor_shapes(cfg_dict: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The published tensor names and torch [out, in] shapes for a raw drafter config: z-lab's,
    plus the biases (`attention_bias`) and sink logits (`dflash_config.attention_sink_bias`)
    of the variants that have them, and Muse Glimmer's assistant's `encoder.*` names."""
    d = cfg_dict.get("dflash_config") or {}
    hidden = int(cfg_dict["hidden_size"])
    n_heads = int(cfg_dict["num_attention_heads"])
    n_kv = int(cfg_dict.get("num_key_value_heads") or n_heads)
    hd = int(cfg_dict.get("head_dim") or hidden // n_heads)
    vd = int(cfg_dict.get("v_head_dim") or hd)
    inter = int(cfg_dict["intermediate_size"])
    n_layers = int(cfg_dict["num_hidden_layers"])
    taps = d.get("target_layer_ids") or cfg_dict.get("target_layer_ids") or []
    n_taps = len(taps) or int(d.get("num_taps", n_layers))
    assistant = "MuseGlimmerAssistantModel" in (cfg_dict.get("architectures") or ())
    shapes: dict[str, tuple[int, ...]] = {
        "encoder.fc.weight" if assistant else "fc.weight": (hidden, n_taps * hidden),
        "encoder.output_norm_enc.weight" if assistant else "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
    }
    for i in range(n_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (n_heads * hd, hidden),
                p + "self_attn.k_proj.weight": (n_kv * hd, hidden),
                p + "self_attn.v_proj.weight": (n_kv * vd, hidden),
                p + "self_attn.o_proj.weight": (hidden, n_heads * vd),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
            }
        )
        if cfg_dict.get("attention_bias"):
            sizes = {"q": n_heads * hd, "k": n_kv * hd, "v": n_kv * vd, "o": hidden}
            shapes.update({f"{p}self_attn.{k}_proj.bias": (n,) for k, n in sizes.items()})
        if d.get("attention_sink_bias"):
            shapes[p + "self_attn.attention_sink_bias"] = (n_heads,)
    return shapes


def _random_tensor(name: str, shape: tuple[int, ...]) -> mx.array:
    if len(shape) == 1 and "norm" in name:
        return 1.0 + 0.05 * mx.random.normal(shape)
    if name.endswith("attention_sink_bias"):  # logits of the order of the scores: they matter
        return mx.random.normal(shape)
    return 0.05 * mx.random.normal(shape)


def write_drafter_checkpoint(
    path: str | Path,
    cfg_dict: Mapping[str, Any],
    seed: int = 0,
    dtype: str | mx.Dtype = "float32",
    extra_keys: Iterable[str] | Mapping[str, tuple[int, ...]] = (),
    drop_keys: Iterable[str] = (),
    bad_shape_key: str | None = None,
    prefix: str = "",
) -> Path:
    """A z-lab-style drafter folder: config.json + model.safetensors with random weights.

    Hooks for rejection tests: `extra_keys` adds tensors (a name list, shapes guessed: lm_head /
    embed_tokens get [vocab, hidden], others [hidden]; or a name -> shape mapping), `drop_keys`
    removes tensors, `bad_shape_key` gets one extra row, `prefix` (e.g. "model.") is prepended
    to every name as some exports do.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shapes = drafter_tensor_shapes(cfg_dict)
    hidden, vocab = int(cfg_dict["hidden_size"]), int(cfg_dict.get("vocab_size") or 256)
    if isinstance(extra_keys, Mapping):
        extra = {k: tuple(v) for k, v in extra_keys.items()}
    else:
        extra = {
            k: (vocab, hidden) if ("lm_head" in k or "embed_tokens" in k) else (hidden,)
            for k in extra_keys
        }
    shapes.update(extra)
    for k in drop_keys:
        del shapes[k]
    if bad_shape_key is not None:
        s = shapes[bad_shape_key]
        shapes[bad_shape_key] = (s[0] + 1, *s[1:])
    mx.random.seed(seed)
    dt = _dtype(dtype)
    weights = {prefix + k: _random_tensor(k, s).astype(dt) for k, s in shapes.items()}
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    return path


def load_module(model_type: str):
    """mlx-lm's model module for a type (handy for building targets in engine tests)."""
    return importlib.import_module(f"mlx_lm.models.{model_type}")
