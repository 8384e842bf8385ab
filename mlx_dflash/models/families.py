"""Target families: what each architecture mlx-lm runs does differently, in one table.

The layer loop (models/target.py) is the same for every family; what differs is declared here:
the attention's variant, the decoder block around the token mixer, the embedding and logit
transforms, and which layers slide. Each layer's token mixer (attention, Gated DeltaNet, MLA)
is read off mlx-lm's module (`mixer`). A new family is one entry in ARCHITECTURES plus one
fixture (tests/test_families.py checks every entry has one and decodes it exactly).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen2, qwen3

from ..checkpoints.read import is_drafter_config, text_config
from ..errors import DFlashError
from ..kernels import cpu_math
from .attention import AttentionSpec
from .gemma4 import gemma4_block, gemma4_project
from .minimax import minimax_project
from .mla import is_mla


def mixer(layer) -> str:
    """A decoder layer's token mixer: "gated_deltanet" (Qwen3.5's linear layers), "mla"
    (multi-head latent attention: DeepSeek V3, Kimi) or "attention"."""
    if getattr(layer, "is_linear", False):
        return "gated_deltanet"
    return "mla" if is_mla(layer.self_attn) else "attention"


# Sliding-window rules: whether layer i of mlx-lm's inner model slides, by its family's marker.
def no_window(inner, i: int) -> bool:
    return False


def by_layer_types(inner, i: int) -> bool:
    """The model's `layer_types` list (gpt-oss, Llama)."""
    types = getattr(inner, "layer_types", None)
    return types is not None and types[i] == "sliding_attention"


def by_attention_flag(inner, i: int) -> bool:
    """The attention module's `is_sliding` (Gemma 4, Muse Glimmer)."""
    return bool(getattr(inner.layers[i].self_attn, "is_sliding", False))


def by_layer_flag(inner, i: int) -> bool:
    """The decoder layer's `is_sliding_window` (MiMo-V2-Flash)."""
    return bool(getattr(inner.layers[i], "is_sliding_window", False))


# mlx-lm's MLP classes that compute down_proj(swiglu(gate_proj(x), up_proj(x))) (Mistral's
# checkpoints load as llama).
SWIGLU_MLPS = (llama.MLP, qwen2.MLP, qwen3.MLP)


def prenorm_block(layer, h, mix, ffn):
    """The common decoder layer: pre-norm attention and MLP (or MoE), each added back.
    `mix` runs the layer's token mixer (attention, Gated DeltaNet, MLA) under verification,
    `ffn` its feed-forward as this forward computes it (`layer_ffn`)."""
    return mlp_half(layer, h + mix(layer.input_layernorm(h)), ffn)


def mlp_half(layer, h, ffn):
    """A pre-norm layer's second half: h plus its feed-forward `ffn` of the post-attention
    norm."""
    return h + ffn(layer.post_attention_layernorm(h))


def ffn_of(layer):
    """The layer's MLP or MoE (MiniMax names its MoE block_sparse_moe). A module's children
    are its dict's items: read so, they cost a dict lookup where `layer.mlp` costs a failed
    attribute lookup first (~1 us, every layer of every forward)."""
    return layer["mlp"] if "mlp" in layer else layer["block_sparse_moe"]


def layer_ffn(layer, numpy: bool):
    """The layer's (dense) feed-forward as a forward calls it: mlx-lm's module itself, or,
    where this forward may take numpy's exponentials (`cpu_math.enabled()`, asked once a
    forward: a CPU trick), `feed_forward` over it, which asks per call."""
    ffn = ffn_of(layer)
    return partial(feed_forward, ffn) if numpy else ffn


def feed_forward(ffn, x: mx.array) -> mx.array:
    """The layer's MLP or MoE over x. mlx-lm's SwiGLU MLPs compute the same function with the
    product's exponentials in numpy where MLX's CPU backend is slow at them (kernels/cpu_math.py:
    at a 16-token verify, most of the MLP's cost on x86)."""
    if numpy_mlp(ffn, x.size // x.shape[-1], x.dtype):
        return ffn.down_proj(cpu_math.silu_mul(ffn.gate_proj(x), ffn.up_proj(x)))
    return ffn(x)


def numpy_mlp(ffn, rows: int, dtype: mx.Dtype) -> bool:
    """Whether `ffn` over `rows` tokens takes numpy's exponentials (a CPU trick that syncs)."""
    return type(ffn) in SWIGLU_MLPS and cpu_math.applies(
        rows * ffn["gate_proj"]["weight"].shape[0], dtype
    )


def sandwich_block(layer, h, mix, ffn):
    """Muse Glimmer: a norm after attention and after the MLP too."""
    h = h + layer.post_attention_layernorm(mix(layer.input_layernorm(h)))
    return h + layer.post_feedforward_layernorm(ffn(layer.pre_feedforward_layernorm(h)))


@dataclass(frozen=True)
class Family:
    """What an architecture does differently: in attention, and around the layer stack."""

    attention: AttentionSpec = AttentionSpec()
    block: Callable = prenorm_block  # one decoder layer around its token mixer
    # Muse Glimmer: a weightless RMSNorm on the token embeddings. Gemma: embeddings times
    # sqrt(hidden_size) (mlx-lm's embed_scale).
    embedding_norm: bool = False
    embedding_scale: bool = False
    # Logits times output_multiplier (Muse Glimmer) where the model has one, then soft-capped:
    # cap * tanh(logits / cap) with final_logit_softcapping (Muse Glimmer, Gemma).
    logit_softcap: bool = False
    # Which layers slide (see a window of the newest `sliding_window` positions), by the
    # marker mlx-lm's module for this family sets; `no_window` where none slides.
    sliding: Callable[[Any, int], bool] = no_window


_GATED = Family(AttentionSpec(qk_norm=True, gated=True))
_GEMMA4 = Family(
    AttentionSpec(project=gemma4_project),
    block=gemma4_block,
    embedding_scale=True,
    logit_softcap=True,
    sliding=by_attention_flag,
)
ARCHITECTURES: dict[str, Family] = {
    # Llama's layer_types may mark sliding layers (Ministral); Mistral loads as llama.
    "llama": Family(sliding=by_layer_types),
    "mistral": Family(sliding=by_layer_types),
    "qwen2": Family(),
    "qwen3": Family(AttentionSpec(qk_norm=True)),
    "qwen3_moe": Family(AttentionSpec(qk_norm=True)),
    # Hybrid: 3 of 4 layers are Gated DeltaNet (models/gated_deltanet.py); partial RoPE comes
    # with the rope module mlx-lm builds. Qwen3.8 is qwen3_5 (see _check_gate_type).
    "qwen3_5": _GATED,
    "qwen3_5_moe": _GATED,
    "qwen3_next": _GATED,
    # Multi-head latent attention (models/mla.py) and DeepSeek MoE; Kimi-K2.5 wraps it.
    "deepseek_v3": Family(),
    "kimi_k25": Family(),
    # Three sliding-window layers to one global NoPE layer; everything else as described above.
    "muse_glimmer": Family(
        AttentionSpec(scaleless_qk=True, gate_proj=True),
        block=sandwich_block,
        embedding_norm=True,
        logit_softcap=True,
        sliding=by_attention_flag,
    ),
    # Gemma 4 (models/gemma4.py): sliding and global layers with their own head sizes and
    # RoPE (proportional, partial on global layers), K = V on global layers, a sandwich block
    # with a MoE branch (26B-A4B) and a layer scalar; the wrapper and a text-only export.
    "gemma4": _GEMMA4,
    "gemma4_text": _GEMMA4,
    # gpt-oss: alternating sliding and full layers, per-head attention sinks, biased
    # projections, a MoE of SwiGLU experts (MXFP4 as published, read by mlx-lm).
    "gpt_oss": Family(sliding=by_layer_types),
    # MiniMax M2.x: RMSNorm over all heads' q and k at once, partial RoPE, a sparse MoE.
    "minimax": Family(AttentionSpec(project=minimax_project)),
    # GLM-4.5 / 4.6 / 4.7 MoE: biased q/k/v, optional per-head qk norm, partial RoPE.
    "glm4_moe": Family(AttentionSpec(qk_norm=True)),
    # MiMo-V2-Flash: sliding and full layers with their own heads and RoPE, sink logits,
    # wider values than keys, a value scale.
    "mimo_v2_flash": Family(sliding=by_layer_flag),
}
# Families mlx-lm runs that cannot be verified exactly here, with the reason.
_DSA = (
    "{}'s DSA sparse attention picks each query's keys with an indexer's top-k, which a draft "
    "tree's verify cannot reproduce exactly yet"
)
REFUSED = {"glm_moe_dsa": _DSA.format("GLM-5"), "deepseek_v32": _DSA.format("DeepSeek-V3.2")}
# Text-only exports of the multimodal Qwen3.5 / 3.6 checkpoints name their language model's own
# type; mlx-lm builds both layouts from the wrapper's module (its ModelArgs accepts a flat config).
TEXT_MODEL_TYPES = {
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "kimi_k2": "deepseek_v3",  # Kimi-K2's (and Kimi-K2.5's text_config's) own type
    "muse_glimmer_text": "muse_glimmer",
    "minimax_m2": "minimax",  # MiniMax M2.x's own type (mlx-lm remaps it the same way)
    "gemma4_unified": "gemma4",  # Gemma 4 12B: encoder-free multimodal, the same text model
}


def architecture(config: dict) -> str:
    """The ARCHITECTURES key (and mlx-lm module) for a raw config.json, or one sentence why not.

    Published Qwen3.5 / 3.6 checkpoints wrap the language model (`model_type: qwen3_5`, its
    fields under `text_config`, whose own type is `qwen3_5_text`); either spelling maps here.
    """
    if is_drafter_config(config):
        raise DFlashError(
            "This is a DFlash drafter, not a target model: pass it with --drafter, and the "
            "model it drafts for with --model."
        )
    names = [config.get("model_type"), text_config(config).get("model_type")]
    for name in filter(None, names):
        name = TEXT_MODEL_TYPES.get(name, name)
        if name in REFUSED:
            raise DFlashError(f"Target architecture '{name}' is refused: {REFUSED[name]}.")
        if name in ARCHITECTURES:
            _check_gate_type(text_config(config))
            _check_gemma4(name, text_config(config))
            return name
    shown = next((n for n in names if n), "unknown")
    supported = ", ".join(sorted(ARCHITECTURES))
    raise DFlashError(f"Target architecture '{shown}' is not supported (supported: {supported}).")


# `output_gate_type` (Qwen3.8 writes "swish"; Qwen3.5 omits it) names the activation of the
# Gated DeltaNet layers' gated output norm, in flash-linear-attention's spelling (its
# FusedRMSNormGated takes activation="swish" | "silu" | "sigmoid"). Swish is SiLU, which is what
# mlx-lm's qwen3_5 / qwen3_next norm already computes, so these load unchanged. The gate of the
# full-attention layers stays sigmoid in the reference code whatever the field says. A value
# we have no computation for (sigmoid included: mlx-lm's module, our baseline, cannot run it)
# is refused, since a wrong gate still runs and only the tokens show it.
SILU_GATE_TYPES = (None, "swish", "silu")


def _check_gate_type(text: dict) -> None:
    gate = text.get("output_gate_type")
    if gate not in SILU_GATE_TYPES:
        raise DFlashError(
            f"output_gate_type '{gate}' is not supported: only the swish (SiLU) gate of "
            "Qwen3.5 and Qwen3.8 is."
        )


def _check_gemma4(name: str, text: dict) -> None:
    """The small Gemma 4 models (E2B, E4B) share K/V between layers and add per-layer token
    inputs; no DFlash drafter exists for them, and this loop does not run either."""
    if not name.startswith("gemma4"):
        return
    if text.get("num_kv_shared_layers", 20) or text.get("hidden_size_per_layer_input", 256):
        raise DFlashError(
            "Gemma 4 models with KV-shared layers or per-layer inputs (E2B, E4B) are not "
            "supported: only the 12B, 26B-A4B and 31B layouts are."
        )


def model_classes(config: dict):
    """mlx-lm's (Model, ModelArgs) for a config, text-only Qwen3.5 exports included."""
    from mlx_lm.utils import _get_classes

    return _get_classes({**config, "model_type": architecture(config)})


def layer_windows(inner, text: dict, family: Family) -> list[int | None]:
    """Each layer's sliding window, None for a global layer."""
    window = int(text.get("sliding_window") or text.get("sliding_window_size") or 0) or None
    return [window if family.sliding(inner, i) else None for i in range(len(inner.layers))]


def language_model(model: nn.Module) -> Any:
    """The text model inside a multimodal wrapper (Gemma 4, Qwen3.5), else the model itself."""
    return model["language_model"] if "language_model" in model else model
