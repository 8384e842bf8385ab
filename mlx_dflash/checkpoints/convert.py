"""`dflash-mlx convert`: Hugging Face checkpoints (targets and DFlash drafters) to MLX folders.

Targets go through mlx-lm's own loading, casting and quantization, so the result is exactly what
`mlx_lm.convert` would write. Drafters are not mlx-lm models: their config is normalised with
`DrafterConfig`, their tensors validated against it (and against the target, when given) and
optionally quantized into the layout `nn.QuantizedLinear` loads. Output is staged in a hidden
sibling folder and renamed into place only when complete.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path
from typing import Any

from ..atomic import atomic_folder
from ..errors import DFlashError
from ..models.drafter_config import DrafterConfig
from ..progress import progress
from .read import (
    INDEX_FILE,
    check_drafter_weights,
    is_drafter_config,
    load_safetensors,
    quantizable_base,
    read_config,
    resolve_drafter,
    weight_files,
)

DTYPES = ("float16", "bfloat16", "float32")
Q_BITS = (2, 3, 4, 5, 6, 8)
Q_GROUP_SIZES = (32, 64, 128)
# Shards stay below this size (a single larger tensor gets a shard of its own).
MAX_SHARD_BYTES = 2 << 30
# Only these are fetched from the hub: never pickles, never code.
HUB_PATTERNS = [
    "*.json",
    "*.safetensors",
    "tokenizer*",
    "*.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
]
# Tokenizer and generation files copied next to a converted target.
TOKENIZER_PATTERNS = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


# --------------------------------------------------------------------------------------------
# Sources and output folders


def _snapshot_download(repo_id: str) -> str:
    """Indirection so tests can simulate the hub without a network."""
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id=repo_id, allow_patterns=HUB_PATTERNS)


def _download_config(repo_id: str) -> str:
    """config.json alone (a few KB): read before any weight is fetched. Tests replace it."""
    from huggingface_hub import hf_hub_download

    return hf_hub_download(repo_id=repo_id, filename="config.json")


def _from_hub(fetch, repo_id: str) -> Path:
    """Run a hub download, turning its many failure types into one sentence each."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        return Path(fetch(repo_id))
    except GatedRepoError as e:
        raise DFlashError(
            f"The hub model {repo_id} is gated; accept its terms and log in with `hf auth login`."
        ) from e
    except RepositoryNotFoundError as e:
        raise DFlashError(
            f"{repo_id} is neither a local folder nor a model on the Hugging Face hub."
        ) from e
    except Exception as e:  # offline, DNS, timeouts, proxies: all mean the same to the user
        raise DFlashError(
            f"Could not reach the Hugging Face hub to fetch {repo_id} (and no local folder of "
            "that name exists); pass a local folder instead."
        ) from e


def resolve_source(source: str | Path, kind: str = "auto") -> Path:
    """A local folder as is; anything shaped like `org/name` that is not one comes from the hub,
    whose config.json is fetched and checked before any weight: a target's architecture runs
    here, a drafter is a DFlash drafter."""
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise DFlashError(f"{source} is a file; pass the checkpoint's folder.")
        return path
    if not _REPO_ID.match(str(source)):
        raise DFlashError(f"The source folder {source} does not exist.")
    from ..models.families import architecture

    config = _from_hub(_download_config, str(source))
    try:
        cfg = read_config(config.parent)
        if detect_kind(cfg, kind) == "target":
            architecture(cfg)
        elif not is_drafter_config(cfg):
            raise DFlashError(
                "This is not a DFlash drafter (its config.json architectures do not list "
                "DFlashDraftModel); pass a drafter to --drafter."
            )
    except DFlashError as e:
        raise DFlashError(f"{source}: {e}") from None
    return _from_hub(_snapshot_download, str(source))


# --------------------------------------------------------------------------------------------
# Writing


def _shards(weights: dict[str, Any], max_bytes: int) -> list[dict[str, Any]]:
    shards: list[dict[str, Any]] = []
    size = 0
    for k, v in weights.items():
        if not shards or size + v.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += v.nbytes
    return shards


def save_weights(folder: Path, weights: dict[str, Any]) -> None:
    """model.safetensors (or model-0000i-of-0000n shards) plus the index mlx-lm writes."""
    import mlx.core as mx

    shards = _shards(weights, MAX_SHARD_BYTES)
    n = len(shards)
    index: dict[str, Any] = {
        "metadata": {"total_size": sum(v.nbytes for v in weights.values())},
        "weight_map": {},
    }
    with progress() as bar:
        task = bar.add_task("Writing weights", total=n)
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors"
            mx.save_safetensors(str(folder / name), shard, metadata={"format": "mlx"})
            index["weight_map"].update({k: name for k in shard})
            bar.advance(task)
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=4))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=4) + "\n")


def _pick_dtype(dtype: str | None, cfg: dict[str, Any]) -> str | None:
    """--dtype, else the checkpoint's declared dtype (as mlx_lm.convert does), else unchanged."""
    if dtype is not None:
        if dtype not in DTYPES:
            raise DFlashError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype}.")
        return dtype
    for c in (cfg, cfg.get("text_config") or {}):
        for key in ("torch_dtype", "dtype"):
            if c.get(key) in DTYPES:
                return c[key]
    return None


# --------------------------------------------------------------------------------------------
# Drafters


def quantize_drafter_weights(weights: dict[str, Any], group_size: int, bits: int) -> dict[str, Any]:
    """Affine-quantize the linear layers (and DFlash 2's selector codebooks, as embeddings are:
    at 200K tokens they are the drafter's biggest tensors) in MLX's layout; norms and the
    convolutions' static kernels stay float.

    A layer whose input size is not a multiple of the group size stays float (as in mlx-lm);
    loaders tell the two apart by the presence of `X.scales`.
    """
    import mlx.core as mx

    out: dict[str, Any] = {}
    for name, w in weights.items():
        base = quantizable_base(name)
        if base is None or w.shape[-1] % group_size:
            out[name] = w
            continue
        wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
        out[name], out[f"{base}.scales"], out[f"{base}.biases"] = wq, scales, biases
    return out


def _cast(tree: Any, dtype: str | None, keep=lambda _: True) -> Any:
    """Weights (a flat dict, or a model's parameters) with every floating one whose name `keep`
    accepts cast to `dtype`; all unchanged without a dtype."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path

    if dtype is None:
        return tree
    dt = getattr(mx, dtype)

    def cast(k, v):
        return v.astype(dt) if keep(k) and mx.issubdtype(v.dtype, mx.floating) else v

    return tree_map_with_path(cast, tree)


def convert_drafter(
    source: Path,
    out: Path,
    *,
    dtype: str | None = None,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    target: str | Path | None = None,
) -> DrafterConfig:
    """Validate a DFlash drafter folder and write its MLX form into `out` (an existing folder)."""
    import mlx.core as mx

    from ..models.drafter import read_draft_vocab, write_draft_vocab

    raw = read_config(source, "drafter")
    source_quant = raw.get("quantization")
    if quantize and source_quant:
        raise DFlashError(f"The drafter in {source} is already quantized.")
    target_cfg = None if target is None else read_config(Path(target), "target")
    cfg, weights = resolve_drafter(source, raw, target_cfg)
    vocab = read_draft_vocab(source, cfg.vocab_size)  # checked before anything is written

    dtype = _pick_dtype(dtype, raw)
    weights = _cast(weights, dtype)
    quant = source_quant
    if quantize:
        quant = {"group_size": q_group_size, "bits": q_bits}
        with progress() as bar:
            bar.add_task("Quantizing drafter", total=None)
            weights = quantize_drafter_weights(weights, q_group_size, q_bits)
            mx.eval(weights)
        check_drafter_weights(cfg, weights, quant)

    config = cfg.to_dict()
    if dtype is not None:
        config["torch_dtype"] = dtype
    if quant:
        config["quantization"] = {"group_size": quant["group_size"], "bits": quant["bits"]}
    save_weights(out, dict(sorted(weights.items())))
    _write_json(out / "config.json", config)
    if vocab is not None:
        write_draft_vocab(out, vocab)
    return cfg


# --------------------------------------------------------------------------------------------
# Targets


def _load_target(source: Path):
    from mlx_lm.utils import load_model

    from ..models.families import model_classes

    try:
        return load_model(source, lazy=True, get_model_classes=model_classes)
    except (ValueError, KeyError, TypeError, FileNotFoundError, AttributeError) as e:
        msg = " ".join(str(e).split()).rstrip(".") or type(e).__name__
        if len(msg) > 200:
            msg = msg[:200] + "..."
        raise DFlashError(f"mlx-lm could not load {source} as a target model: {msg}.") from e


def convert_target(
    source: Path,
    out: Path,
    *,
    dtype: str | None = None,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    dequantize: bool = False,
) -> dict[str, Any]:
    """Load with mlx-lm, cast and quantize as mlx_lm.convert does, and write into `out`."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import quantize_model, save_config

    from ..models.families import architecture

    cfg = read_config(source, "target")
    if is_drafter_config(cfg):
        raise DFlashError(f"{source} is a DFlash drafter, not a target; drop --kind target.")
    architecture(cfg)
    for f in weight_files(source):  # a corrupt file is named before any work is done
        load_safetensors(f)
    with progress() as bar:
        bar.add_task("Loading target with mlx-lm", total=None)
        model, config = _load_target(source)

    if dequantize:
        # Float weights for the CPU, where BLAS makes float32 matmuls far faster than 4-bit.
        if "quantization" not in config:
            raise DFlashError(f"The target in {source} is not quantized; drop --dequantize.")
        from mlx_lm.utils import dequantize_model

        model = dequantize_model(model)
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    dtype = _pick_dtype(dtype, config)
    if dtype is not None:
        keep = getattr(model, "cast_predicate", lambda _: True)
        model.update(_cast(model.parameters(), dtype, keep))

    if quantize:
        if "quantization" in config:
            raise DFlashError(f"The target in {source} is already quantized.")
        with progress() as bar, contextlib.redirect_stdout(io.StringIO()):
            bar.add_task("Quantizing target", total=None)
            model, config = quantize_model(model, config, q_group_size, q_bits)

    save_weights(out, dict(tree_flatten(model.parameters())))
    save_config(config, out / "config.json")
    for pattern in TOKENIZER_PATTERNS:
        for f in source.glob(pattern):
            shutil.copy2(f, out / f.name)
    if not (out / "tokenizer_config.json").exists() and not (out / "tokenizer.json").exists():
        from rich.console import Console

        Console(stderr=True).print(
            f"[yellow]warning:[/] {source} has no tokenizer files; mlx_lm.load will need them."
        )
    return config


# --------------------------------------------------------------------------------------------
# Entry points


def detect_kind(cfg: dict[str, Any], kind: str = "auto") -> str:
    """'drafter' when config.json's architectures list DFlashDraftModel, else 'target'."""
    if kind not in ("auto", "target", "drafter"):
        raise DFlashError(f"--kind must be auto, target or drafter, not {kind}.")
    if kind != "auto":
        return kind
    return "drafter" if is_drafter_config(cfg) else "target"


def convert(
    source: str | Path,
    out: str | Path,
    kind: str = "auto",
    dtype: str | None = None,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    target: str | Path | None = None,
    force: bool = False,
    dequantize: bool = False,
) -> Path:
    """Convert a target or DFlash drafter checkpoint into the MLX folder `out`; returns `out`.

    `source` is a local folder or a hub id. Nothing is written unless the whole conversion
    succeeds; an existing `out` is replaced only with `force`, and only at the very end.
    """
    out = Path(out).expanduser()
    if (out.exists() or out.is_symlink()) and not force:
        raise DFlashError(f"The output folder {out} already exists; pass --force to replace it.")
    if quantize and q_bits not in Q_BITS:
        raise DFlashError(f"--q-bits must be one of {Q_BITS}, not {q_bits}.")
    if quantize and q_group_size not in Q_GROUP_SIZES:
        raise DFlashError(f"--q-group-size must be one of {Q_GROUP_SIZES}, not {q_group_size}.")
    if dtype is not None:
        dtype = _pick_dtype(dtype, {})
    src = resolve_source(source, kind)
    if out.resolve() in (src.resolve(), *src.resolve().parents):
        raise DFlashError(f"The output folder {out} must not be the source folder or contain it.")
    kind = detect_kind(read_config(src), kind)
    if kind == "target" and target is not None:
        raise DFlashError("--target only applies when converting a drafter.")
    if dequantize and (kind != "target" or quantize):
        raise DFlashError("--dequantize applies to quantized targets, without --quantize.")
    opts = dict(dtype=dtype, quantize=quantize, q_bits=q_bits, q_group_size=q_group_size)
    with atomic_folder(out, force) as tmp:
        if kind == "drafter":
            convert_drafter(src, tmp, target=target, **opts)
        else:
            convert_target(src, tmp, dequantize=dequantize, **opts)
    return out
