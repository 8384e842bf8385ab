"""Prompt cache files (mlx-lm's --prompt-cache-file): a Session's caches saved after a prompt,
the drafter's context included, so a later run starts where it stopped.

One safetensors file: every target layer's cache (`t{i}.*`) and the drafter's context per
layer (`d{i}.*`) as their `saved()` gives them, and in the metadata the tokens they hold,
what each layer's numbers are, the target and drafter they were made with (names and a hash of
each config.json), the KV quantization, and what made it: `dflash-mlx cache` (an open user
message that a later prompt continues, as mlx-lm's cache_prompt leaves it) or chat's `/save`
(the conversation's messages). A file is only ever read into caches made for the same target
in the same way; anything else is one sentence.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx

from .atomic import atomic_file
from .errors import DFlashError

FORMAT = "dflash-mlx prompt cache 1"


@dataclass
class CacheFile:
    """A prompt cache file's metadata (its arrays stay in the file until `restore`)."""

    model: str  # the target as it was given (-m), or the embedded pair's folder
    model_config: str  # sha256 of its config.json
    drafter: str | None  # the drafter folder whose context is saved, or None
    drafter_config: str | None
    tokens: list[int]
    kv: dict | None = None  # KVQuantization fields, or None for a float cache
    # "cache": an open user message (dflash-mlx cache); "chat": a conversation (chat /save)
    source: str = "cache"
    messages: list[dict] = field(default_factory=list)
    system: str | None = None
    chat_template: bool | None = None
    layers: list[dict] = field(default_factory=list)  # each target layer's saved numbers
    drafter_layers: list[dict] = field(default_factory=list)


def config_hash(folder: str | Path | None) -> str | None:
    if folder is None:
        return None
    return hashlib.sha256((Path(folder) / "config.json").read_bytes()).hexdigest()[:16]


def drafter_folder(session) -> Path | None:
    """Where the session's drafter was loaded from (None: no drafter, or one made in memory)."""
    return getattr(getattr(session.drafter, "drafter", None), "folder", None)


def _format(path: Path) -> str | None:
    """The `format` a safetensors file's header names, read from the header alone (the file
    may be gigabytes of weights); None for anything else."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size < 1 << 24:
                return None
            header = json.loads(f.read(size))
    except (OSError, ValueError):
        return None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta.get("format") if isinstance(meta, dict) else None


def check_output(path: str | Path) -> None:
    """Refuse, before any work, a path that cannot take a prompt cache: not .safetensors, in a
    folder that does not exist, or an existing file that is not a prompt cache (a model's
    weights, say), which is never overwritten. An older prompt cache there is replaced."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise DFlashError(f"{path}: a prompt cache file ends in .safetensors.")
    if not path.parent.is_dir():
        raise DFlashError(f"{path.parent} does not exist (the folder of the prompt cache file).")
    if path.exists() and _format(path) != FORMAT:
        raise DFlashError(f"{path} exists and is not a prompt cache; it is left as it is.")


def save(path: str | Path, session, model: str, **about) -> CacheFile:
    """Write the session's caches to `path` (atomically: a failed write leaves whatever was
    there), with what they are for: the target as given (`model`), what made them (`about`:
    source, messages, system, chat_template) and, read off the session, its target's and
    drafter's configs, tokens and KV settings. Returns the metadata written."""
    if session.target.stage is not None:
        raise DFlashError("A prompt cache of a target sharded over several machines is not saved.")
    folder = drafter_folder(session)
    meta = CacheFile(
        model=model,
        model_config=str(config_hash(session.target.folder)),
        drafter=None if folder is None else str(folder),
        drafter_config=config_hash(folder),
        tokens=list(session.tokens),
        kv=None if session.kv is None else asdict(session.kv),
        **about,
    )
    arrays: dict[str, mx.array] = {}
    parts = [("t", session.cache, meta.layers)]
    if session.drafter is not None and hasattr(session.drafter, "cache"):
        parts.append(("d", session.drafter.cache, meta.drafter_layers))
    for prefix, caches, layers in parts:
        for i, c in enumerate(caches):
            a, m = c.saved()
            arrays.update({f"{prefix}{i}.{k}": v for k, v in a.items()})
            layers.append({"type": type(c).__name__, **m})
    text = {"format": FORMAT, "meta": json.dumps(asdict(meta))}
    path = Path(path)
    check_output(path)
    atomic_file(path, lambda tmp: mx.save_safetensors(tmp, arrays, metadata=text))
    return meta


def read(path: str | Path) -> tuple[CacheFile, dict[str, mx.array]]:
    """The file's metadata and arrays, checked to be a prompt cache file."""
    path = Path(path)
    if not path.is_file():
        raise DFlashError(f"{path} does not exist (the --prompt-cache-file).")
    try:
        arrays, text = mx.load(str(path), return_metadata=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is one sentence
        raise DFlashError(f"{path} is not a prompt cache file ({e}).") from None
    if text.get("format") != FORMAT:
        raise DFlashError(f"{path} is not a prompt cache file of dflash-mlx (`dflash-mlx cache`).")
    return CacheFile(**json.loads(text["meta"])), arrays


def restore(session, meta: CacheFile, arrays: dict[str, mx.array], target_folder) -> None:
    """Fill a fresh session (made for the same target, with the file's KV quantization) with
    the file's caches. The drafter's context is restored only for the drafter it was saved
    with; another drafter starts empty, and the next prompt then runs again from its start
    (Session.rewind), exactly, only slower."""
    if config_hash(target_folder) != meta.model_config:
        raise DFlashError(
            f"This prompt cache was made with another target ({meta.model}): pass -m "
            f"{meta.model}, or make the cache again."
        )
    kv = None if session.kv is None else asdict(session.kv)
    if kv != meta.kv:
        raise DFlashError(
            f"This prompt cache was made with --kv-bits {_kv_flags(meta.kv)}; give the same "
            f"(here: {_kv_flags(kv)})."
        )
    if session.tokens:
        raise DFlashError("A prompt cache is read into a fresh session only.")
    _fill(session.cache, meta.layers, arrays, "t")
    drafter = session.drafter
    same = config_hash(drafter_folder(session)) == meta.drafter_config
    if drafter is not None and meta.drafter_layers and same:
        _fill(drafter.cache, meta.drafter_layers, arrays, "d")
    session.tokens = list(meta.tokens)


def _fill(caches: list, layers: list[dict], arrays: dict[str, mx.array], prefix: str) -> None:
    if len(caches) != len(layers):
        raise DFlashError("This prompt cache has another number of layers than the model.")
    for i, (c, m) in enumerate(zip(caches, layers, strict=True)):
        if type(c).__name__ != m["type"]:
            raise DFlashError(
                f"Layer {i} of this prompt cache is a {m['type']}, not the {type(c).__name__} "
                "this model makes."
            )
        own = {k.split(".", 1)[1]: v for k, v in arrays.items() if k.startswith(f"{prefix}{i}.")}
        c.restore(own, m)


def _kv_flags(kv: dict | None) -> str:
    if kv is None:
        return "off"
    return f"{kv['bits']} --kv-group-size {kv['group_size']} --quantized-kv-start {kv['start']}"
