"""Reading and validating checkpoint folders: shared by `convert` and the engine's loader.

A drafter's tensors are checked against its resolved config (docs/checkpoints.md) and against
its target, so a mismatched pair fails with one sentence naming the culprit instead of a shape
error deep inside a forward pass.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..errors import DFlashError
from ..models.drafter_config import (
    DRAFTER2_ARCHITECTURE,
    DRAFTER_ARCHITECTURE,
    DrafterConfig,
    architecture_of,
)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
INDEX_FILE = "model.safetensors.index.json"

# The drafter's linear layers: the only tensors worth quantizing (norms stay float).
DRAFTER_LINEARS = (
    "fc",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    # DFlash 2
    "attention_conv.kernel_projection",
    "mlp_conv.kernel_projection",
    "candidate_selector.hidden_projection",
)
# DFlash 2's selector codebooks: [V, r] tables published without a `.weight` suffix (and kept
# so in our folders, where z-lab's loader reads them); quantized like embeddings, the packed
# table keeps the bare name beside `X.scales` / `X.biases`.
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
DFLASH2_PARTS = ("attention_conv", "mlp_conv", "candidate_selector")
# Tensors that belong to a drafter that brings its own vocabulary, which DFlash never does.
FOREIGN_TENSORS = ("lm_head", "embed_tokens")
# Other published names of the same tensors: Muse-Glimmer-30B-assistant's context projection
# and its norm (its safetensors header; vLLM's qwen3_dflash maps them the same way).
TENSOR_ALIASES = {"encoder.fc.": "fc.", "encoder.output_norm_enc.": "hidden_norm."}
# Files beside a drafter's weights that change what it computes but that we never load: MiMo's
# drafter ships its mask token's embedding as a PyTorch pickle (vLLM PR #46104 reads it in
# place of the target's row, which is near zero for that token).
PICKLED_SIDECARS = ("mask_embedding.pt",)


# --------------------------------------------------------------------------------------------
# Folders and files


def read_config(folder: str | Path, what: str = "model") -> dict[str, Any]:
    """config.json of a folder, with one-sentence errors for a missing or unparsable file."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise DFlashError(f"The {what} folder {folder} has no config.json.")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DFlashError(f"Could not parse {path}: {e}.") from e
    if not isinstance(cfg, dict):
        raise DFlashError(f"{path} does not hold a JSON object.")
    return cfg


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's own fields: mlx-lm / VLM configs nest them under `text_config`."""
    inner = cfg.get("text_config")
    if isinstance(inner, dict) and "num_hidden_layers" in inner and "hidden_size" in inner:
        return inner
    return cfg


def is_drafter_config(cfg: dict[str, Any]) -> bool:
    """A DFlash (1 or 2) drafter's config.json: decided by `architectures` alone."""
    return architecture_of(cfg) is not None


def weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a folder: those its index names, else every *.safetensors.

    Pickled weights are never loaded (unpickling can run arbitrary code), so a folder that only
    has .bin/.pt files is refused with a sentence saying why.
    """
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise DFlashError(f"Could not parse {index}: {e}.") from e
        files = [folder / n for n in names]
        for f in files:
            if not f.is_file():
                raise DFlashError(f"{index.name} names {f.name}, which is missing from {folder}.")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise DFlashError(
            f"{folder} holds only PyTorch pickle weights ({pickles[0]}); safetensors is "
            "required, because loading a pickle can run arbitrary code."
        )
    raise DFlashError(f"{folder} has no *.safetensors weights.")


def load_safetensors(path: str | Path) -> dict[str, mx.array]:
    """One safetensors file, with a corrupt or truncated file reported by name."""
    try:
        weights = mx.load(str(path))
    except Exception as e:  # mx.load raises RuntimeError/ValueError for bad headers and data
        raise DFlashError(
            f"Could not read {path}: it is not a valid safetensors file ({e})."
        ) from e
    if not isinstance(weights, dict):
        raise DFlashError(f"{path} is not a safetensors file.")
    return weights


def load_weights(folder: str | Path) -> dict[str, mx.array]:
    """Every tensor of a folder's safetensors files (lazily: nothing is read until evaluated)."""
    weights: dict[str, mx.array] = {}
    for f in weight_files(folder):
        weights.update(load_safetensors(f))
    return weights


def _canonical(name: str) -> str:
    for alias, canonical in TENSOR_ALIASES.items():
        if name.startswith(alias):
            return canonical + name[len(alias) :]
    return name


def strip_model_prefix(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Drafter tensors under z-lab's names: a `model.` prefix some exports put on them
    dropped, other published names of the same tensors (`TENSOR_ALIASES`) mapped. A selector
    codebook saved under an embedding's own name (`X.weight`) gets its published bare name
    back."""
    if weights and all(k.startswith("model.") for k in weights):
        weights = {k[len("model.") :]: v for k, v in weights.items()}
    if any(_canonical(k) != k for k in weights):
        weights = {_canonical(k): v for k, v in weights.items()}
    renamed = {f"{c}.weight": c for c in CODEBOOKS if f"{c}.weight" in weights and c not in weights}
    if renamed:
        weights = {renamed.get(k, k): v for k, v in weights.items()}
    return weights


# --------------------------------------------------------------------------------------------
# Drafter tensors


def quantizable_base(name: str) -> str | None:
    """`X` for a tensor quantization may pack (a linear's `X.weight`, or a codebook `X`)."""
    if name in CODEBOOKS:
        return name
    base = name.removesuffix(".weight")
    linear = any(base == lin or base.endswith("." + lin) for lin in DRAFTER_LINEARS)
    return base if base != name and linear else None


def drafter_weight_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a drafter checkpoint must hold, with its torch [out, in] shape."""
    h, inter, hd, nh = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_attention_heads
    q, kv, vo = nh * hd, cfg.num_key_value_heads * hd, cfg.value_head_dim
    v = cfg.num_key_value_heads * vo
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, cfg.num_taps * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        a = p + "self_attn."
        shapes.update({a + "q_proj.weight": (q, h), a + "k_proj.weight": (kv, h)})
        shapes.update({a + "v_proj.weight": (v, h), a + "o_proj.weight": (h, nh * vo)})
        shapes.update({a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)})
        if cfg.attention_bias:  # and the variants' biases and sink logits
            for proj, size in (("q", q), ("k", kv), ("v", v), ("o", h)):
                shapes[f"{a}{proj}_proj.bias"] = (size,)
        if cfg.attention_sink_bias:
            shapes[a + "attention_sink_bias"] = (nh,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
        if cfg.kind == "dflash2":
            k, groups = cfg.conv_kernel_size, h // cfg.conv_group_size
            for conv in ("attention_conv", "mlp_conv"):
                shapes[f"{p}{conv}.base_kernel"] = (2, k, h)
                shapes[f"{p}{conv}.kernel_projection.weight"] = (2 * k * groups, h)
    if cfg.kind == "dflash2":
        vocab = cfg.vocab_size
        assert vocab is not None  # DrafterConfig.from_dict refuses a DFlash 2 config without it
        for name in CODEBOOKS:
            shapes[name] = (vocab, cfg.selector_rank)
        shapes["candidate_selector.hidden_projection.weight"] = (cfg.selector_rank, h)
    return shapes


def check_drafter_weights(
    cfg: DrafterConfig,
    weights: dict[str, Any],
    quantization: dict[str, Any] | None = None,
) -> None:
    """Raise a one-sentence DFlashError unless `weights` is exactly the drafter `cfg` describes.

    `weights` maps names to anything with a `.shape`. With `quantization` ({"group_size",
    "bits"}), a linear layer may be stored in MLX's quantized layout (`X.weight` packed uint32,
    `X.scales`, `X.biases`); a layer without `X.scales` must still be float.
    """
    for name in sorted(weights):
        if any(part in FOREIGN_TENSORS for part in name.split(".")):
            raise DFlashError(
                f"The drafter checkpoint carries its own '{name}', so it belongs to a different "
                "drafter family; a DFlash drafter borrows the target's embeddings and LM head."
            )
    if cfg.kind == "dflash":
        for name in sorted(weights):
            if any(part in DFLASH2_PARTS for part in name.split(".")):
                raise DFlashError(
                    f"The drafter checkpoint holds the DFlash 2 tensor '{name}' but its "
                    f"config.json declares {DRAFTER_ARCHITECTURE}, not {DRAFTER2_ARCHITECTURE}."
                )
    expected = dict(drafter_weight_shapes(cfg))
    if quantization:
        gs, bits = int(quantization["group_size"]), int(quantization["bits"])
        for name, shape in list(expected.items()):
            base = quantizable_base(name)
            if base is not None and f"{base}.scales" in weights:  # MLX's affine layout
                out_dim, in_dim = shape
                expected[name] = (out_dim, in_dim * bits // 32)
                expected[f"{base}.scales"] = expected[f"{base}.biases"] = (out_dim, in_dim // gs)
    for name, shape in expected.items():
        if name not in weights:
            raise DFlashError(f"The drafter checkpoint is missing tensor '{name}'.")
        got = tuple(weights[name].shape)
        if got != shape:
            raise DFlashError(
                f"Drafter tensor '{name}' has shape {list(got)} but its config implies "
                f"{list(shape)}."
            )
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise DFlashError(
            f"The drafter checkpoint has an unexpected tensor '{extra[0]}' that its config "
            "does not describe."
        )


def check_pair(drafter_cfg: DrafterConfig, target_cfg: dict[str, Any]) -> None:
    """Raise a one-sentence DFlashError unless the drafter fits the target (raw config.json)."""
    t = text_config(target_cfg)
    keys = ("hidden_size", "vocab_size", "num_hidden_layers")
    for key in keys:
        if key not in t:
            raise DFlashError(f"The target config.json has no '{key}' field.")
    hidden, vocab, n_layers = (int(t[k]) for k in keys)
    if drafter_cfg.hidden_size != hidden:
        raise DFlashError(
            f"The drafter's hidden size {drafter_cfg.hidden_size} differs from the target's "
            f"{hidden}, so it was trained for another target."
        )
    if drafter_cfg.vocab_size is not None and drafter_cfg.vocab_size != vocab:
        raise DFlashError(
            f"The drafter's vocabulary size {drafter_cfg.vocab_size} differs from the target's "
            f"{vocab}, so it was trained for another target."
        )
    bad = [i for i in drafter_cfg.target_layer_ids if not 0 <= i < n_layers]
    if bad:
        raise DFlashError(
            f"The drafter taps target layer {bad[0]} but the target has only {n_layers} layers."
        )
    if not 0 <= drafter_cfg.mask_token_id < vocab:
        raise DFlashError(
            f"The drafter's mask_token_id {drafter_cfg.mask_token_id} is outside the target's "
            f"vocabulary of {vocab} tokens."
        )


def with_target_vocab(cfg: DrafterConfig, target_cfg: dict[str, Any]) -> DrafterConfig:
    """`cfg` with the target's vocabulary size where its config.json gives none (a DFlash 1
    drafter has no vocabulary-sized tensor; Muse's assistant omits the field)."""
    if cfg.vocab_size is not None:
        return cfg
    return dataclasses.replace(cfg, vocab_size=int(text_config(target_cfg)["vocab_size"]))


def check_sidecars(folder: str | Path) -> None:
    """Refuse a drafter folder whose pickled side files would change its drafts."""
    for name in PICKLED_SIDECARS:
        if (Path(folder) / name).exists():
            raise DFlashError(
                f"The drafter in {folder} ships {name}, a PyTorch pickle that replaces its "
                "mask token's embedding; dflash-mlx never unpickles files (that can run "
                "arbitrary code), so it cannot run this drafter as it was trained."
            )


def read_drafter(
    folder: str | Path,
    target_cfg: dict[str, Any] | None = None,
    num_target_layers: int | None = None,
) -> tuple[DrafterConfig, dict[str, mx.array]]:
    """Resolve and validate a drafter folder (z-lab export or `convert` output).

    With `target_cfg` (the target's raw config.json) missing tap ids are derived from its
    layer count and the pair is checked; `num_target_layers` alone only derives the taps.
    Weights stay lazy and keep their stored dtype.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise DFlashError(f"The drafter folder {folder} does not exist.")
    raw = read_config(folder, "drafter")
    if not is_drafter_config(raw):
        raise DFlashError(
            f"{folder} is not a DFlash drafter (its config.json architectures list neither "
            f"{DRAFTER_ARCHITECTURE} nor {DRAFTER2_ARCHITECTURE}); pass a drafter folder to "
            "--drafter."
        )
    return resolve_drafter(folder, raw, target_cfg, num_target_layers)


def resolve_drafter(
    folder: Path,
    raw: dict[str, Any],
    target_cfg: dict[str, Any] | None = None,
    num_target_layers: int | None = None,
) -> tuple[DrafterConfig, dict[str, mx.array]]:
    """`read_drafter` once the folder's config.json (`raw`) is read, taken as a drafter's
    whatever its architectures say (`convert --kind drafter` takes any)."""
    check_sidecars(folder)
    n_target = num_target_layers
    if target_cfg is not None:
        n_target = text_config(target_cfg).get("num_hidden_layers")
    cfg = DrafterConfig.from_dict(raw, num_target_layers=n_target)
    if target_cfg is not None:
        check_pair(cfg, target_cfg)
        cfg = with_target_vocab(cfg, target_cfg)
    weights = strip_model_prefix(load_weights(folder))
    check_drafter_weights(cfg, weights, raw.get("quantization"))
    return cfg, weights
