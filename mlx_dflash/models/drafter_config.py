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
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def architecture_of(cfg: dict[str, Any]) -> str | None:
    """The drafter architecture a config.json declares (never guessed from a hub id)."""
    archs = cfg.get("architectures") or ()
    if isinstance(archs, str):
        archs = (archs,)
    for arch in (DRAFTER2_ARCHITECTURE, DRAFTER_ARCHITECTURE):
        if arch in archs:
            return arch
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
        rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    return float(rope_theta), rope_scaling


def _layer_types(cfg: dict, n_layers: int) -> tuple[list[str], int | None]:
    """(each layer's attention kind, the sliding window), checked."""
    layer_types = cfg.get("layer_types") or ["full_attention"] * n_layers
    if len(layer_types) != n_layers:
        raise DFlashError(
            f"The drafter config lists {len(layer_types)} layer_types for {n_layers} layers."
        )
    for t in layer_types:
        if t not in ("full_attention", "sliding_attention"):
            raise DFlashError(f"Unknown drafter layer type '{t}'.")
    sliding_window = cfg.get("sliding_window")
    if "sliding_attention" in layer_types and not sliding_window:
        raise DFlashError("The drafter has sliding-attention layers but no sliding_window.")
    return list(layer_types), None if sliding_window is None else int(sliding_window)


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
    vocab_size: int
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
    # DFlash 2 only (all 0 for DFlash 1): the dynamic convolution and the candidate selector.
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    @property
    def kind(self) -> str:
        """ "dflash2" or "dflash": which drafter generation this is (doctor and --json say)."""
        return "dflash2" if self.selector_top_k else "dflash"

    def describe(self) -> dict[str, Any]:
        """What runs, for `doctor` and `--json`: the drafter generation and its shape."""
        out: dict[str, Any] = {
            "kind": self.kind,
            "architecture": DRAFTER2_ARCHITECTURE
            if self.kind == "dflash2"
            else DRAFTER_ARCHITECTURE,
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
            if key not in cfg:
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
        layer_types, sliding_window = _layer_types(cfg, n_layers)

        def opt_float(key: str) -> float | None:
            v = dcfg.get(key, cfg.get(key))
            return None if v is None else float(v)

        is_causal = cfg.get("is_causal", dcfg.get("is_causal"))
        dflash2 = _dflash2_fields(cfg, dcfg, hidden)
        return cls(
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            intermediate_size=int(need("intermediate_size")),
            vocab_size=int(need("vocab_size")),
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
            is_causal=None if is_causal is None else bool(is_causal),
            input_embedding_scale=opt_float("input_embedding_scale"),
            output_multiplier=opt_float("output_multiplier"),
            final_logit_softcapping=opt_float("final_logit_softcapping"),
            **dflash2,
        )

    def to_dict(self) -> dict[str, Any]:
        """The normalised config.json: z-lab's layout, every resolved field explicit. Optional
        transforms that are off are left out, as z-lab's published configs do: its reference
        loader reads an explicit null as a number (`float(None)`) and fails."""
        d = asdict(self)
        dflash = {k: d.pop(k) for k in ("block_size", "mask_token_id", "target_layer_ids")}
        is_causal = d.pop("is_causal")
        for k in DFLASH2_FIELDS:
            v = d.pop(k)
            if self.kind == "dflash2":
                dflash[k] = v
        for k in (
            "input_embedding_scale",
            "output_multiplier",
            "final_logit_softcapping",
        ):
            v = d.pop(k)
            if v is not None:
                dflash[k] = v
        arch = DRAFTER2_ARCHITECTURE if self.kind == "dflash2" else DRAFTER_ARCHITECTURE
        out = {"architectures": [arch], "model_type": "qwen3", **d}
        if is_causal is not None:  # top level, where the published configs and z-lab read it
            out["is_causal"] = is_causal
        out["block_size"] = dflash["block_size"]
        out["dflash_config"] = dflash
        out["tie_word_embeddings"] = False
        out["attention_bias"] = False
        return out
