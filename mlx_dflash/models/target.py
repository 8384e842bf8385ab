"""The target model, driven through our own layer loop over mlx-lm's modules and weights.

Speculative decoding needs three things mlx-lm's `Model.__call__` does not give: one position
per token (tree nodes at the same depth share a position), an arbitrary attention structure
(a causal block or a tree given by parent indices), and the hidden states of the tapped
layers. Rather than patch mlx-lm's classes, we call their submodules (projections, norms,
rope, MLP/MoE) from one loop here; what differs per architecture is declared in
models/families.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..checkpoints.read import read_config, text_config
from ..distributed import LOCAL, LocalWorld, World
from ..engine import device
from ..engine.contract import Pass
from ..errors import DFlashError
from ..kernels import cpu_math
from . import compiled, queueing
from .arena import KVArena
from .cache import (
    KVCache,
    KVQuantization,
    QuantizedKVCache,
    RotatingKVCache,
    WindowedKVCache,
)
from .families import (
    ARCHITECTURES,
    architecture,
    language_model,
    layer_ffn,
    layer_windows,
    mixer,
    model_classes,
)
from .forward import forward
from .gated_deltanet import RecurrentCache
from .padding import RowPadding


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
        # Each layer's token mixer ("attention", "gated_deltanet", "mla"), read once here
        # rather than in every forward.
        self.mixers = [mixer(layer) for layer in self.layers]
        # Sliding-window layers see the newest `window` positions only (None: every position).
        self.windows = layer_windows(self.inner, self.text_config, self.family)
        self.world: World | LocalWorld = LOCAL  # a World once distributed.split shards it
        self.stage = None  # a pipeline stage (mlx_dflash.distributed.Stage): my layers only
        self.hidden_size = int(self.text_config["hidden_size"])
        self.vocab_size = int(self.text_config["vocab_size"])
        # The row count each forward's dense layers run at (models/padding.py); load_target
        # measures it on the CPU backend, None runs every forward at its own size.
        self.padding: RowPadding | None = None
        # On Metal, a quantized target's verify path per layer shape and row count
        # (models/quantized.py); a tied quantized head's stand-in takes the same choice.
        self.verify_kernel: Any = None
        self.tied_head: Any = None
        # Whether a verify and the drafter's pass queue each layer as it is built
        # (models/queueing.py): the CPU backend's choice until load_target measures a GPU's.
        self.queue_layers = device.queues_layers()
        self.queue_timings: dict[str, float] | None = None  # that measurement, for doctor
        self.blas_timings: dict[str, float] | None = None  # OpenBLAS's threads, on the CPU
        # Whether lone passes run each layer's halves compiled (models/compiled.py), their
        # compiled functions by layer, and the measurement that chose it (a GPU's).
        self.compiled = False
        self.compiled_layers: dict[int, tuple] = {}
        self.compiled_shapes: dict[int, int] = {}  # passes run by token count (SEEN)
        self.compile_timings: dict[str, float] | None = None
        self._draft_heads: dict[bytes, tuple[mx.array, mx.array]] = {}  # draft_head_rows'
        self.folder: Path | None = None  # where it was loaded from (load_target)
        self.set_taps(tap_ids)

    def padded_rows(self, n: int) -> int:
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
        padded += "-compiled" if self.compiled else ""
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
        if max_kv_size is not None and "gated_deltanet" in self.mixers:
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
            for i, kind in enumerate(self.mixers)
            if kind == "attention" and self.windows[i] is None
        ]
        return KVArena(standard)

    def layer_cache(self, i: int, kv: KVQuantization | None = None, max_kv_size=None):
        """Layer i's cache: recurrent state, a window's K/V, or all K/V (quantized with `kv`,
        at most `max_kv_size` positions with it)."""
        layer = self.layers[i]
        if self.mixers[i] == "gated_deltanet":
            return RecurrentCache()
        window = self.windows[i]
        if kv is None and max_kv_size is None:
            return KVCache() if window is None else WindowedKVCache(window)
        flag = "--kv-bits" if kv is not None else "--max-kv-size"
        why = None
        if window is not None:
            why = "sliding-window layers (mlx-lm cannot quantize its rotating cache either)"
        elif self.mixers[i] == "mla":
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

    def dense_layer(self, i: int, h: mx.array) -> mx.array:
        """Layer i around an identity token mixer: its dense work alone (models/padding.py
        times it at each row count)."""
        layer = self.layers[i]
        return self.family.block(layer, h, lambda x: x, layer_ffn(layer, cpu_math.enabled()))

    def token_embeddings(self, tokens: mx.array) -> mx.array:
        """The target's embedding module's output, as a drafter reads it: z-lab's drafters call
        the target's `embed_tokens`, not its input transform, so Muse Glimmer's embedding norm
        stays out; Gemma's sqrt(hidden) scale stays in, since Hugging Face's Gemma embedding
        module applies it itself (mlx-lm applies it after the lookup)."""
        h = self.inner.embed_tokens(tokens)
        return h * self.inner.embed_scale if self.family.embedding_scale else h

    def _untied_head(self):
        """The model's own lm_head, or None when it is tied to the embeddings."""
        return getattr(language_model(self.model), "lm_head", None)

    @property
    def vocab_sharding(self):
        """The group mlx-lm split the LM head's vocabulary over (Qwen3.5's shard), or None."""
        return getattr(language_model(self.model), "sharding_group", None)

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

    def forward(self, passes: list[Pass]) -> list[tuple[mx.array | None, mx.array | None]]:
        """As engine/contract.py's TargetModel.forward (models/forward.py): logits (T or 1, V)
        per the pass's `logits` ("all", "last", "none"), taps (T, n*H); rewindable=False
        (prefill, plain decoding) lets recurrent layers skip the verify tape."""
        return forward(self, passes)

    def head(self, h: mx.array, logits: str, real: int | None = None) -> mx.array | None:
        """Final norm and LM head over all positions, the last one, or none; `real`: how many
        of h's rows are tokens (the rest row padding, which the head runs over at its cheaper
        size, models/padding.py)."""
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
        target.queue_layers = queueing.choose(target)
        target.compiled = compiled.choose(target)
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
