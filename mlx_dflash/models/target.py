"""The target model, driven through our own layer loop over mlx-lm's modules and weights.

Speculative decoding needs three things mlx-lm's `Model.__call__` does not give: one position
per token (tree nodes at the same depth share a position), an arbitrary attention structure
(a causal block or a tree given by parent indices), and the hidden states of the tapped
layers. Rather than patch mlx-lm's classes, we call their submodules (projections, norms,
rope, MLP/MoE) from one loop here; what differs per architecture is declared in ARCHITECTURES.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..checkpoints.read import is_drafter_config, read_config, text_config
from ..distributed import LOCAL, LocalWorld, World
from ..errors import DFlashError
from ..kernels import cpu_math
from ..kernels.tree_attention import tree_depths
from .arena import KVArena
from .attention import AttentionSpec, attention
from .cache import (
    KVCache,
    KVQuantization,
    QuantizedKVCache,
    RotatingKVCache,
    WindowedKVCache,
)
from .gated_deltanet import RecurrentCache, gdn_forward
from .gemma4 import gemma4_block, gemma4_project
from .minimax import minimax_project
from .mla import is_mla, mla_attention
from .packed import forward_packed
from .rows import RowPadding, on_real_rows, pad_rows

# mlx-lm's MLP classes that compute down_proj(swiglu(gate_proj(x), up_proj(x))) (Mistral's
# checkpoints load as llama).
SWIGLU_MLPS = ("mlx_lm.models.llama.MLP", "mlx_lm.models.qwen2.MLP", "mlx_lm.models.qwen3.MLP")


def prenorm_block(layer, h, mix):
    """The common decoder layer: pre-norm attention and MLP (or MoE), each added back.
    `mix` runs the layer's token mixer (attention, Gated DeltaNet, MLA) under verification."""
    h = h + mix(layer.input_layernorm(h))
    ffn = layer.mlp if "mlp" in layer else layer.block_sparse_moe  # MiniMax names its MoE so
    return h + feed_forward(ffn, layer.post_attention_layernorm(h))


def feed_forward(ffn, x: mx.array) -> mx.array:
    """The layer's MLP or MoE over x. mlx-lm's SwiGLU MLPs compute the same function with the
    product's exponentials in numpy where MLX's CPU backend is slow at them (kernels/cpu_math.py:
    at a 16-token verify, most of the MLP's cost on x86)."""
    name = f"{type(ffn).__module__}.{type(ffn).__qualname__}"
    if name in SWIGLU_MLPS and cpu_math.applies(
        x.size // x.shape[-1] * ffn.gate_proj.weight.shape[0], x.dtype
    ):
        return ffn.down_proj(cpu_math.silu_mul(ffn.gate_proj(x), ffn.up_proj(x)))
    return ffn(x)


def sandwich_block(layer, h, mix):
    """Muse Glimmer: a norm after attention and after the MLP too."""
    h = h + layer.post_attention_layernorm(mix(layer.input_layernorm(h)))
    return h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))


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


_GATED = Family(AttentionSpec(qk_norm=True, gated=True))
_GEMMA4 = Family(
    AttentionSpec(project=gemma4_project),
    block=gemma4_block,
    embedding_scale=True,
    logit_softcap=True,
)
ARCHITECTURES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
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
    ),
    # Gemma 4 (models/gemma4.py): sliding and global layers with their own head sizes and
    # RoPE (proportional, partial on global layers), K = V on global layers, a sandwich block
    # with a MoE branch (26B-A4B) and a layer scalar; the wrapper and a text-only export.
    "gemma4": _GEMMA4,
    "gemma4_text": _GEMMA4,
    # gpt-oss: alternating sliding and full layers, per-head attention sinks, biased
    # projections, a MoE of SwiGLU experts (MXFP4 as published, read by mlx-lm).
    "gpt_oss": Family(),
    # MiniMax M2.x: RMSNorm over all heads' q and k at once, partial RoPE, a sparse MoE.
    "minimax": Family(AttentionSpec(project=minimax_project)),
    # GLM-4.5 / 4.6 / 4.7 MoE: biased q/k/v, optional per-head qk norm, partial RoPE.
    "glm4_moe": Family(AttentionSpec(qk_norm=True)),
    # MiMo-V2-Flash: sliding and full layers with their own heads and RoPE, sink logits,
    # wider values than keys, a value scale.
    "mimo_v2_flash": Family(),
}
# Families mlx-lm runs that cannot be verified exactly here, with the reason.
REFUSED = {
    "glm_moe_dsa": (
        "GLM-5's DSA sparse attention picks each query's keys with an indexer's top-k, which a "
        "draft tree's verify cannot reproduce exactly yet"
    ),
    "deepseek_v32": (
        "DeepSeek-V3.2's DSA sparse attention picks each query's keys with an indexer's top-k, "
        "which a draft tree's verify cannot reproduce exactly yet"
    ),
}
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


class Target:
    """A loaded mlx-lm model plus the bits the engine needs: taps, caches, a flexible forward."""

    def __init__(self, model: nn.Module, tokenizer: Any, config: dict, tap_ids=()):
        """`config` is the folder's config.json as written (nested or flat)."""
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.text_config = text_config(config)
        self.model_type = architecture(config)
        self.family = ARCHITECTURES[self.model_type]
        self.inner = language_model(model).model
        self.layers = self.inner.layers
        self.num_layers = len(self.layers)
        # Sliding-window layers see the newest `window` positions only (None: every position).
        self.windows = layer_windows(self.inner, self.text_config)
        self.world: World | LocalWorld = LOCAL  # a World once distributed.split shards it
        self.stage = None  # a pipeline stage (mlx_dflash.distributed.Stage): my layers only
        self.hidden_size = int(self.text_config["hidden_size"])
        self.vocab_size = int(self.text_config["vocab_size"])
        # The row count each forward's dense layers run at (models/rows.py); load_target
        # measures it on the CPU backend, None runs every forward at its own size.
        self.padding: RowPadding | None = None
        # On Metal, a quantized target's verify path per layer shape and row count
        # (models/quantized.py); a tied quantized head's stand-in takes the same choice.
        self.verify_kernel: Any = None
        self.tied_head: Any = None
        self._draft_heads: dict[bytes, tuple[mx.array, mx.array]] = {}  # draft_head_rows'
        self.folder: Path | None = None  # where it was loaded from (load_target)
        self.set_taps(tap_ids)

    def rows(self, n: int) -> int:
        """The row count n tokens' dense layers run at."""
        return n if self.padding is None else self.padding(n)

    @property
    def runs_alone(self) -> bool:
        """Unsharded (a sharded target's ranks agree every token: engine/contract.py)."""
        return not self.world.sharded

    @property
    def batcher(self) -> None:
        return None  # its forwards run alone (engine/batch.py's BatchedTarget joins a batch)

    @property
    def unbatched(self) -> Target:
        return self

    @property
    def forward_paths(self) -> str:
        padded = "-padded" if self.padding is not None else ""
        return padded + (self.verify_kernel.key if self.verify_kernel is not None else "")

    def set_taps(self, tap_ids) -> None:
        tap_ids = [int(t) for t in tap_ids]
        for t in tap_ids:
            if not 0 <= t < self.num_layers:
                raise DFlashError(
                    f"Tapped layer {t} does not exist in a target with {self.num_layers} layers."
                )
        self.tap_ids = tap_ids

    def make_cache(self, kv: KVQuantization | None = None, max_kv_size: int | None = None) -> list:
        """Every layer's cache; with `kv`, the standard attention layers' are quantized once
        the context reaches kv.start (mlx-lm's --kv-bits); with `max_kv_size`, they hold at
        most that many positions (mlx-lm's --max-kv-size, a rotating cache)."""
        if self.stage is not None:
            if kv is not None or max_kv_size is not None:
                raise DFlashError("--kv-bits and --max-kv-size run on one machine, not on a "
                                  "target sharded over several.")  # fmt: skip
            return self.stage.make_cache(self)
        if kv is not None and max_kv_size is not None:
            raise DFlashError("--kv-bits and --max-kv-size do not go together (mlx-lm cannot "
                              "quantize its rotating cache either).")  # fmt: skip
        if max_kv_size is not None and any(_is_linear(layer) for layer in self.layers):
            raise DFlashError("--max-kv-size applies to targets of attention layers alone, "
                              "not to this one's linear-attention layers.")  # fmt: skip
        caches = [self.layer_cache(i, kv, max_kv_size) for i in range(self.num_layers)]
        if kv is not None:
            t = self.text_config
            head_dim = int(t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"])
            if head_dim % kv.group_size:
                raise DFlashError(
                    f"--kv-group-size {kv.group_size} does not divide this target's head "
                    f"dimension of {head_dim} (quantization groups run along it)."
                )
        return caches

    def new_arena(self) -> KVArena | None:
        """A KV buffer the rows of a batch share (models/arena.py) for the standard attention
        layers (MLA's latent cache, windows and recurrences stay per row); none for a sharded
        target, which runs one request at a time."""
        if self.stage is not None:
            return None
        standard = [
            i
            for i, layer in enumerate(self.layers)
            if not _is_linear(layer) and not is_mla(layer.self_attn) and self.windows[i] is None
        ]
        return KVArena(standard)

    def layer_cache(self, i: int, kv: KVQuantization | None = None, max_kv_size=None):
        """Layer i's cache: recurrent state, a window's K/V, or all K/V (quantized with `kv`,
        at most `max_kv_size` positions with it)."""
        layer = self.layers[i]
        if _is_linear(layer):
            return RecurrentCache()
        window = self.windows[i]
        if kv is None and max_kv_size is None:
            return KVCache() if window is None else WindowedKVCache(window)
        flag = "--kv-bits" if kv is not None else "--max-kv-size"
        why = None
        if window is not None:
            why = "sliding-window layers (mlx-lm cannot quantize its rotating cache either)"
        elif is_mla(layer.self_attn):
            why = "multi-head latent attention, whose cache holds a latent, not keys and values"
        elif any(getattr(layer.self_attn, a, None) is not None
                 for a in ("sinks", "attention_sink_bias")):  # fmt: skip
            why = "attention sinks"
        if why is not None:
            raise DFlashError(f"{flag} does not apply to this target's {why}.")
        return QuantizedKVCache(kv) if kv is not None else RotatingKVCache(max_kv_size)

    def embed(self, tokens: mx.array) -> mx.array:
        """The first layer's input: the token embeddings and what the family does to them."""
        h = self.inner.embed_tokens(tokens)
        if self.family.embedding_norm:
            h = mx.fast.rms_norm(h, None, self.inner.embed_eps)
        if self.family.embedding_scale:
            h = h * self.inner.embed_scale
        return h

    def token_embeddings(self, tokens: mx.array) -> mx.array:
        """The target's embedding module's output, as a drafter reads it: z-lab's drafters call
        the target's `embed_tokens`, not its input transform, so Muse Glimmer's embedding norm
        stays out; Gemma's sqrt(hidden) scale stays in, since Hugging Face's Gemma embedding
        module applies it itself (mlx-lm applies it after the lookup)."""
        h = self.inner.embed_tokens(tokens)
        return h * self.inner.embed_scale if self.family.embedding_scale else h

    def _untied_head(self):
        """The model's own lm_head, or None when it is tied to the embeddings."""
        owner = getattr(self.model, "language_model", self.model)
        return getattr(owner, "lm_head", None)

    @property
    def vocab_sharding(self):
        """The group mlx-lm split the LM head's vocabulary over (Qwen3.5's shard), or None."""
        owner = getattr(self.model, "language_model", self.model)
        return getattr(owner, "sharding_group", None)

    def lm_head(self, h: mx.array) -> mx.array:
        head = self._untied_head()
        if head is None:
            if self.tied_head is not None:
                return self.tied_head(h)
            return self.inner.embed_tokens.as_linear(h)
        group = self.vocab_sharding
        if group is not None:
            from mlx_lm.models.base import gather_last_axis

            return gather_last_axis(head(h), group)
        return head(h)

    def lm_head_rows(self, ids: mx.array) -> mx.array:
        """The LM head's rows for `ids` (len(ids), H), dequantized: logits over a sub-vocabulary."""
        head = self._untied_head() or self.inner.embed_tokens
        if not hasattr(head, "scales"):
            return head.weight[ids]
        biases = head.biases[ids] if getattr(head, "biases", None) is not None else None
        return mx.dequantize(
            head.weight[ids],
            head.scales[ids],
            biases,
            group_size=head.group_size,
            bits=head.bits,
            mode=getattr(head, "mode", "affine"),
        )

    def draft_head_rows(self, ids) -> mx.array:
        """`lm_head_rows` of a drafter's draft vocabulary, gathered once per vocabulary (and
        head weight) and shared: serve keeps a drafter runner per pooled session, and each
        gathered a copy of its own (36 MB for the SmolLM2 drafter in float32, which the pool's
        byte bound did not see)."""
        ids = np.asarray(ids, dtype=np.int32)
        weight = (self._untied_head() or self.inner.embed_tokens).weight
        held = self._draft_heads.get(key := ids.tobytes())
        if held is None or held[0] is not weight:
            rows = self.lm_head_rows(mx.array(ids))
            mx.eval(rows)
            held = self._draft_heads[key] = (weight, rows)
        return held[1]

    def forward(
        self,
        tokens: mx.array,
        cache: list[KVCache],
        start: int,
        parents: np.ndarray | None = None,
        logits: str = "all",
        taps: bool = True,
        rewindable: bool = True,
    ) -> tuple[mx.array | None, mx.array | None]:
        """Run T tokens after `start` cached positions.

        parents=None: a causal block at positions start..start+T-1. Otherwise a tree: token i
        sits at start + depth(i) and sees the prefix, itself and its ancestors.
        Returns (logits (T or 1, V) per `logits` in {"all", "last", "none"}, taps (T, n*H)).
        rewindable=False (prefill, plain decoding) lets recurrent layers skip the verify tape.
        """
        positions = mx_parents = None
        if parents is not None:
            positions = mx.array(start + tree_depths(parents), dtype=mx.int32)
            mx_parents = mx.array(parents, dtype=mx.int32)
        tree = (positions, mx_parents, parents)
        if self.stage is not None:
            return self.stage.forward(self, tokens, cache, start, tree, logits, taps, rewindable)
        n = int(tokens.shape[0])
        h, tapped = self.run_layers(
            pad_rows(self.embed(tokens[None]), self.rows(n)),
            range(self.num_layers),
            cache,
            start,
            tree,
            set(self.tap_ids) if taps else set(),
            rewindable,
            real=n,
        )
        out_taps = None
        if tapped:  # config order, not layer order
            out_taps = mx.concatenate([tapped[t][:n] for t in self.tap_ids], axis=-1)
        return self.head(h, logits, real=n), out_taps

    def forward_rows(self, passes: list) -> list[tuple[mx.array | None, mx.array | None]]:
        """Several sessions' forwards (models/packed.py Pass) as one packed forward: each
        row's (logits, taps), as `forward` gives it alone."""
        return forward_packed(self, passes)

    def head(self, h: mx.array, logits: str, real: int | None = None) -> mx.array | None:
        """Final norm and LM head over all positions, the last one, or none; `real`: how many
        of h's rows are tokens (the rest row padding, which the head runs over at its cheaper
        size, models/rows.py)."""
        if logits == "none":
            return None
        n = h.shape[1] if real is None else real
        if logits == "last":
            return self.output_logits(self.inner.norm(h[:, n - 1 : n]))[0]
        return self.output_logits(self.inner.norm(h))[0, :n]

    def output_logits(self, h: mx.array) -> mx.array:
        """The target's logits of final-normed hidden states: its LM head and, for Muse
        Glimmer and Gemma, the output multiplier (if any) then the soft cap (mlx-lm's order)."""
        logits = self.lm_head(h)
        if self.family.logit_softcap:
            args = language_model(self.model).args
            cap = args.final_logit_softcapping
            multiplier = getattr(args, "output_multiplier", None)
            if multiplier is not None:
                logits = logits * multiplier
            if cap:
                logits = mx.tanh(logits / cap) * cap
        return logits

    def run_layers(
        self, h, layers, cache, start, tree, tap_set, rewindable, real=None
    ) -> tuple[mx.array, dict[int, mx.array]]:
        """Layers `layers` over hidden states h (1, T, H); the tapped ones' outputs by index.
        `tree`: (positions, parents as mx, parents as numpy), all None for a causal block.
        `real`: how many of the T rows are tokens, the rest row padding (models/rows.py)."""
        real = h.shape[1] if real is None else real
        positions, parents, np_parents = tree
        # The tree's ancestor mask, built by the first attention layer; whether this forward is
        # a verify (its rows stand for steps of their own: models/attention.py, quantized KV).
        masks: dict = {"verify": rewindable}
        tapped = {}
        for i in layers:
            layer, c = self.layers[i], cache[i]

            def mix(x, layer=layer, c=c, i=i):
                if _is_linear(layer):
                    gdn = layer.linear_attn
                    return on_real_rows(
                        lambda y: gdn_forward(gdn, y, c, start, np_parents, rewindable), x, real
                    )
                if is_mla(layer.self_attn):
                    mla = layer.self_attn
                    return on_real_rows(
                        lambda y: mla_attention(mla, y, c, start, positions, parents, masks),
                        x,
                        real,
                    )
                spec = self.family.attention
                window = self.windows[i]
                return attention(
                    layer.self_attn, spec, x, c, start, positions, parents, masks, window, real
                )

            h = self.family.block(layer, h, mix)
            if i in tap_set:
                tapped[i] = h[0]
        return h, tapped


def layer_windows(inner, text: dict) -> list[int | None]:
    """Each layer's sliding window, None for a global layer, as mlx-lm's modules mark them:
    `is_sliding` (Gemma 4, Muse Glimmer), `is_sliding_window` (MiMo), the model's
    `layer_types` (gpt-oss)."""
    window = int(text.get("sliding_window") or text.get("sliding_window_size") or 0) or None
    types = getattr(inner, "layer_types", None)
    out: list[int | None] = []
    for i, layer in enumerate(inner.layers):
        attn = getattr(layer, "self_attn", None)
        sliding = bool(
            getattr(attn, "is_sliding", False)
            or getattr(layer, "is_sliding_window", False)
            or (types is not None and types[i] == "sliding_attention")
        )
        out.append(window if sliding else None)
    return out


def language_model(model: nn.Module) -> Any:
    """The text model inside a multimodal wrapper (Gemma 4, Qwen3.5), else the model itself."""
    return model["language_model"] if "language_model" in model else model


def _is_linear(layer) -> bool:
    return bool(getattr(layer, "is_linear", False))


def load_target(path: str | Path, lazy: bool = False) -> Target:
    """Load a target folder with mlx-lm (any published layout, quantized or not) and wrap it.

    The architecture is checked from config.json before any weight is read, so an unsupported
    model or a drafter passed as the target fails in one sentence.
    """
    from mlx_lm.utils import load_model, load_tokenizer

    path = Path(path)
    if not path.is_dir():
        raise DFlashError(f"Target model folder '{path}' does not exist.")
    config = read_config(path, "target")
    try:
        architecture(config)
    except DFlashError as e:
        raise DFlashError(f"{path}: {e}") from None
    try:
        model, config = load_model(path, lazy=lazy, get_model_classes=model_classes)
        tokenizer = load_tokenizer(path, eos_token_ids=text_eos(config))
    except (FileNotFoundError, ValueError, RuntimeError, OSError) as e:
        msg = " ".join(str(e).split())
        if len(msg) > 300:
            msg = msg[:300] + "..."
        raise DFlashError(f"Could not load the target model from '{path}': {msg}") from None
    target = Target(model, tokenizer, config)
    target.folder = path
    if not lazy:  # a lazy load is sharded next (distributed.py): no padding there
        target.padding = RowPadding.for_target(target)
        verify_kernel(target)
    return target


def verify_kernel(target: Target) -> None:
    """On Metal, a quantized target's linear layers take the small-M verify kernel where this
    machine's calibration chose it (models/quantized.py; measured once, then cached)."""
    from ..engine.device import on_metal
    from .quantized import install, load_or_calibrate, quantized_layers

    if on_metal() and quantized_layers(target.model):
        install(target, load_or_calibrate(target))


def text_eos(config: dict):
    """The end-of-sequence id(s): top level, else the wrapped language model's."""
    eos = config.get("eos_token_id")
    return eos if eos is not None else text_config(config).get("eos_token_id")


# mypy checks Target against the engine's TargetModel protocol (engine/contract.py)
if TYPE_CHECKING:
    from ..engine.contract import TargetModel

    _conforms_target: type[TargetModel] = Target
