"""The DFlash drafter's configuration, resolved from every published config.json variant.

Released drafters disagree on where fields live (top-level `block_size` vs
`dflash_config.block_size`, `rope_theta` vs `rope_parameters`, missing `target_layer_ids`, ...).
`DrafterConfig.from_dict` accepts all of them and `to_dict` writes one normalised form with
every resolved field explicit, so the rest of the code never guesses.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import DFlashError

DRAFTER_ARCHITECTURE = "DFlashDraftModel"
# DFlash 2 (../shared/docs/dflash2.md): a dynamic convolution around each sublayer and a
# candidate selector whose drafts are a first-order chain over the top-k candidates.
DRAFTER2_ARCHITECTURE = "DFlash2DraftModel"
DRAFTER_ARCHITECTURES = (DRAFTER_ARCHITECTURE, DRAFTER2_ARCHITECTURE)
# DFlash 1 drafters published under their own architecture name: Meta's Muse-Glimmer-30B
# "assistant" (../shared/data/configs/meta-models__Muse-Glimmer-30B-assistant.*) is the same
# drafter with top-level block_size / mask_token_id / target_layer_ids and `encoder.*` tensor
# names (checkpoints/read.py renames them, as vLLM's qwen3_dflash weight mapper does).
DFLASH1_ALIASES = ("MuseGlimmerAssistantModel",)
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# dflash_config fields of XiaomiMiMo/MiMo-V2.5-Pro-FP4-DFlash that no inference code reads:
# `num_anchors` (blocks sampled per training sequence) and `loss_decay_gamma` (the per-slot
# loss decay) are training settings. `backbone_rotary_base` (5e6, the MiMo target's
# full-attention RoPE base) has no established meaning for the drafter: vLLM's qwen3_dflash
# (the MiMo DFlash support of vllm-project/vllm PR #46104) ignores it and rotates context and
# block alike with `rope_theta`, ik_llama.cpp PR #2048 rotates only the context keys with it,
# and one deployment note applies it to both. We follow vLLM; whichever is right, only the
# acceptance rate can change, never the output.
UNUSED_DFLASH_FIELDS = ("num_anchors", "loss_decay_gamma", "backbone_rotary_base")
ACTIVATIONS = (None, "silu")
# Optional numbers, read from dflash_config (or the top level) and written there when set.
OPTIONAL_FLOATS = (
    "input_embedding_scale",
    "output_multiplier",
    "final_logit_softcapping",
    "attention_value_scale",
)


def architecture_of(cfg: dict[str, Any]) -> str | None:
    """The drafter architecture a config.json declares (never guessed from a hub id); a DFlash
    1 drafter published under its own name counts as DFlashDraftModel."""
    archs = cfg.get("architectures") or ()
    if isinstance(archs, str):
        archs = (archs,)
    for arch in (DRAFTER2_ARCHITECTURE, DRAFTER_ARCHITECTURE, *DFLASH1_ALIASES):
        if arch in archs:
            return DRAFTER_ARCHITECTURE if arch in DFLASH1_ALIASES else arch
    return None


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """The published rule for drafters whose config does not list the tapped layers."""
    if num_taps < 1:
        raise DFlashError("A DFlash drafter needs at least one tapped target layer.")
    if num_taps == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_taps - 1))) for i in range(num_taps)]


def _tapped_layers(cfg: dict, dcfg: dict, n_target, n_layers: int) -> list[int]:
    """The target layers the drafter reads: listed, or derived as z-lab does from the target's
    depth and the number of taps."""
    taps = dcfg.get("target_layer_ids", cfg.get("target_layer_ids"))
    if taps is None:
        if n_target is None:
            raise DFlashError(
                "The drafter config lists no target_layer_ids and no num_target_layers, "
                "so its tapped layers cannot be derived; pass the target."
            )
        n_taps = int(dcfg.get("num_taps", cfg.get("num_taps", n_layers)))
        taps = default_target_layer_ids(int(n_target), n_taps)
    return [int(t) for t in taps]


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either the flat fields or `rope_parameters`."""
    rope_params = cfg.get("rope_parameters") or {}
    rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    rope_scaling = cfg.get("rope_scaling")
    if rope_scaling is None and rope_params.get("rope_type", "default") not in ("default", None):
        rope_scaling = {
            k: v for k, v in rope_params.items() if k not in ("rope_theta", "partial_rotary_factor")
        }
    return float(rope_theta), rope_scaling


def _layer_types(cfg: dict, dcfg: dict, n_layers: int) -> tuple[list[str], int | None, bool]:
    """(each layer's attention kind, the sliding window, whether `dflash_config.use_swa` made
    every layer sliding), checked.

    MiMo's drafter says `use_swa` / `swa_window_size` instead of layer_types: every layer is a
    non-causal sliding window (vLLM's `_resolve_layer_attention`, which names that
    checkpoint); `use_swa` only overrides a layer_types list without sliding entries.
    """
    layer_types = cfg.get("layer_types") or ["full_attention"] * n_layers
    if len(layer_types) != n_layers:
        raise DFlashError(
            f"The drafter config lists {len(layer_types)} layer_types for {n_layers} layers."
        )
    for t in layer_types:
        if t not in ("full_attention", "sliding_attention"):
            raise DFlashError(f"Unknown drafter layer type '{t}'.")
    use_swa = bool(dcfg.get("use_swa")) and "sliding_attention" not in layer_types
    if use_swa:
        layer_types = ["sliding_attention"] * n_layers
    sliding_window = dcfg.get("swa_window_size", cfg.get("sliding_window"))
    if "sliding_attention" in layer_types and not sliding_window:
        raise DFlashError("The drafter has sliding-attention layers but no sliding_window.")
    window = None if sliding_window is None else int(sliding_window)
    return list(layer_types), window, use_swa


def _causality(cfg: dict, dcfg: dict, use_swa: bool) -> bool | None:
    """An explicit causality for every layer, or None (sliding layers causal, full ones not).
    `dflash_config.causal` is how vLLM and ModelOpt exports spell it; use_swa layers are
    non-causal unless told otherwise."""
    is_causal = cfg.get("is_causal", dcfg.get("is_causal", dcfg.get("causal")))
    if is_causal is None and use_swa:
        return False
    return None if is_causal is None else bool(is_causal)


def _attention_fields(cfg: dict, dcfg: dict, head_dim: int) -> dict[str, Any]:
    """The attention variants beyond Qwen3's: q/k/v/o biases (gpt-oss drafters), per-head sink
    logits (MiMo's, as its target's sliding layers and mlx-lm's mimo_v2_flash use them; its
    value scale is one of OPTIONAL_FLOATS), a value head size and partial RoPE. Checked."""
    if cfg.get("hidden_act") not in ACTIVATIONS:
        raise DFlashError(
            f"The drafter's hidden_act '{cfg['hidden_act']}' is not supported: its MLP is SiLU-gated."
        )
    factor = cfg.get(
        "partial_rotary_factor",
        (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0),
    )
    factor = float(1.0 if factor is None else factor)
    rotary = int(head_dim * factor)
    if not 0 < factor <= 1 or rotary % 2:
        raise DFlashError(
            f"The drafter's partial_rotary_factor {factor} does not give an even number of "
            f"rotated dimensions out of its head_dim {head_dim}."
        )
    sinks = dcfg.get("attention_sink_bias", cfg.get("attention_sink_bias"))
    v_head_dim = cfg.get("v_head_dim")
    return {
        "v_head_dim": None if v_head_dim in (None, head_dim) else int(v_head_dim),
        "partial_rotary_factor": factor,
        "attention_bias": bool(cfg.get("attention_bias")),
        "attention_sink_bias": bool(sinks),
    }


def _optional_floats(cfg: dict, dcfg: dict) -> dict[str, Any]:
    """OPTIONAL_FLOATS as numbers, None where the config has none."""
    out = {}
    for k in OPTIONAL_FLOATS:
        v = dcfg.get(k, cfg.get(k))
        try:
            out[k] = None if v is None else float(v)
        except (TypeError, ValueError):
            raise DFlashError(f"The drafter's {k} must be a number, not {v!r}.") from None
    return out


def _dflash2_fields(cfg: dict, dcfg: dict, hidden: int) -> dict[str, int]:
    """The DFlash 2 sizes, checked; {} for a DFlash 1 config."""
    if architecture_of(cfg) != DRAFTER2_ARCHITECTURE:
        return {}
    out = {}
    for key in DFLASH2_FIELDS:
        v = dcfg.get(key, cfg.get(key))
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise DFlashError(
                f"The DFlash 2 drafter config needs a positive dflash_config.{key}, not {v}."
            )
        out[key] = v
    if hidden % out["conv_group_size"]:
        raise DFlashError(
            f"The DFlash 2 drafter's hidden size {hidden} is not a multiple of its "
            f"conv_group_size {out['conv_group_size']}."
        )
    return out


@dataclass
class DrafterConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    # None: the config does not say (Muse's assistant); the target's, once paired with one.
    vocab_size: int | None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    block_size: int = 16
    mask_token_id: int = 0
    target_layer_ids: list[int] = field(default_factory=list)
    num_target_layers: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    is_causal: bool | None = None
    input_embedding_scale: float | None = None
    output_multiplier: float | None = None
    final_logit_softcapping: float | None = None
    # Attention variants (see _attention_fields); the defaults are z-lab's Qwen3 layers.
    v_head_dim: int | None = None  # None: head_dim
    partial_rotary_factor: float = 1.0
    attention_bias: bool = False
    attention_sink_bias: bool = False
    attention_value_scale: float | None = None
    # DFlash 2 only (all 0 for DFlash 1): the dynamic convolution and the candidate selector.
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    @property
    def kind(self) -> str:
        """ "dflash2" or "dflash": which drafter generation this is (doctor and --json say)."""
        return "dflash2" if self.selector_top_k else "dflash"

    @property
    def architecture(self) -> str:
        return DRAFTER2_ARCHITECTURE if self.kind == "dflash2" else DRAFTER_ARCHITECTURE

    def describe(self) -> dict[str, Any]:
        """What runs, for `doctor` and `--json`: the drafter generation and its shape."""
        out: dict[str, Any] = {
            "kind": self.kind,
            "architecture": self.architecture,
            "layers": self.num_hidden_layers,
            "block_size": self.block_size,
            "taps": list(self.target_layer_ids),
            "sliding_window": self.sliding_window,
        }
        if self.kind == "dflash2":
            out["selector"] = {"top_k": self.selector_top_k, "rank": self.selector_rank}
            out["conv"] = {"kernel": self.conv_kernel_size, "group": self.conv_group_size}
        return out

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def rotary_dims(self) -> int:
        """The leading dimensions of each query/key head that RoPE rotates (all by default)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_is_causal(self, i: int) -> bool:
        """Sliding layers are causal inside the block unless `is_causal` says otherwise."""
        if self.is_causal is not None:
            return bool(self.is_causal)
        return self.layer_types[i] == "sliding_attention"

    def layer_window(self, i: int) -> int | None:
        if self.layer_types[i] == "sliding_attention":
            return self.sliding_window
        return None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], num_target_layers: int | None = None) -> DrafterConfig:
        """Resolve a raw config.json (any published variant) into explicit fields."""
        dcfg = cfg.get("dflash_config") or {}

        def need(key: str) -> Any:
            if cfg.get(key) is None:
                raise DFlashError(f"The drafter config.json has no '{key}' field.")
            return cfg[key]

        hidden = int(need("hidden_size"))
        n_layers = int(need("num_hidden_layers"))
        n_heads = int(need("num_attention_heads"))
        n_kv = int(cfg.get("num_key_value_heads") or n_heads)
        head_dim = int(cfg.get("head_dim") or hidden // n_heads)
        block_size = dcfg.get("block_size", cfg.get("block_size", 16))
        if block_size is None or int(block_size) < 2:
            raise DFlashError(f"The drafter's block size must be at least 2, not {block_size}.")

        n_target = (
            num_target_layers or cfg.get("num_target_layers") or dcfg.get("num_target_layers")
        )
        taps = _tapped_layers(cfg, dcfg, n_target, n_layers)

        mask_token_id = dcfg.get("mask_token_id", cfg.get("mask_token_id"))
        if mask_token_id is None:
            raise DFlashError(
                "The drafter config has no mask_token_id (dflash_config.mask_token_id)."
            )

        rope_theta, rope_scaling = _rope(cfg)
        layer_types, sliding_window, use_swa = _layer_types(cfg, dcfg, n_layers)

        is_causal = _causality(cfg, dcfg, use_swa)
        dflash2: dict[str, Any] = _dflash2_fields(cfg, dcfg, hidden)
        vocab = cfg.get("vocab_size")
        if vocab is None and dflash2:
            raise DFlashError("The DFlash 2 drafter config has no 'vocab_size' field.")
        return cls(
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            intermediate_size=int(need("intermediate_size")),
            vocab_size=None if vocab is None else int(vocab),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 40960)),
            block_size=int(block_size),
            mask_token_id=int(mask_token_id),
            target_layer_ids=taps,
            num_target_layers=None if n_target is None else int(n_target),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            layer_types=layer_types,
            sliding_window=sliding_window,
            is_causal=is_causal,
            **_optional_floats(cfg, dcfg),
            **_attention_fields(cfg, dcfg, head_dim),
            **dflash2,
        )

    def to_dict(self) -> dict[str, Any]:
        """The normalised config.json: z-lab's layout, every resolved field explicit. Optional
        transforms that are off are left out, as z-lab's published configs do: its reference
        loader reads an explicit null as a number (`float(None)`) and fails."""
        d = asdict(self)
        dflash = {k: d.pop(k) for k in ("block_size", "mask_token_id", "target_layer_ids")}
        is_causal = d.pop("is_causal")
        dflash2 = {k: d.pop(k) for k in DFLASH2_FIELDS}
        if self.kind == "dflash2":
            dflash.update(dflash2)
        floats = {k: d.pop(k) for k in OPTIONAL_FLOATS}
        dflash.update({k: v for k, v in floats.items() if v is not None})
        if d.pop("attention_sink_bias"):  # where MiMo's config has it
            dflash["attention_sink_bias"] = True
        if d["v_head_dim"] is None:
            del d["v_head_dim"]
        if d["partial_rotary_factor"] == 1.0:
            del d["partial_rotary_factor"]
        out = {"architectures": [self.architecture], "model_type": "qwen3", **d}
        if is_causal is not None:  # top level, where the published configs and z-lab read it
            out["is_causal"] = is_causal
        out["block_size"] = dflash["block_size"]
        out["dflash_config"] = dflash
        out["tie_word_embeddings"] = False
        return out
