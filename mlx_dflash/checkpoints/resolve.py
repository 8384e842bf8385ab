"""Hub ids and local folders, alike wherever a model or drafter is accepted.

A hub id is downloaded and converted once (through `convert.convert`, so drafters are validated
and normalised exactly as `dflash-mlx convert` would) into a cache folder, and reused from there
afterwards without touching the network: a converted folder is what every loader expects.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import DFlashError
from ..paths import cache_root


def cached_path(repo_id: str) -> Path:
    return cache_root() / repo_id


def _offline() -> bool:
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except Exception:  # very old huggingface_hub: let the download decide
        return False


def resolve_model(
    id_or_path: str | Path, kind: str = "target", target: str | Path | None = None
) -> Path:
    """A local folder as is; a hub id converted into the cache on first use, then reused.

    `target` (a drafter's target folder) lets the drafter's conversion derive missing tap ids
    and check the pair.
    """
    if kind not in ("target", "drafter"):
        raise DFlashError(f"kind must be target or drafter, not {kind}.")
    path = Path(id_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise DFlashError(f"{id_or_path} is a file; pass the {kind}'s folder.")
        return path
    from .convert import _REPO_ID

    name = str(id_or_path)
    if not _REPO_ID.match(name):
        raise DFlashError(f"The {kind} folder {name} does not exist.")
    out = cached_path(name)
    if (out / "config.json").is_file():
        return out
    if out.exists():
        raise DFlashError(f"The cache folder {out} is incomplete; delete it and try again.")
    if _offline():
        raise DFlashError(
            f"{name} is not in the dflash-mlx cache ({out}) and the Hugging Face hub is "
            "offline (HF_HUB_OFFLINE); connect once to download it, or pass a local folder."
        )
    from rich.console import Console

    from .convert import convert

    Console(stderr=True).print(f"Fetching and converting {name} into {out} (first use only).")
    try:
        convert(name, out, kind=kind, target=target if kind == "drafter" else None)
    except DFlashError:
        if (out / "config.json").is_file():  # another process converted it meanwhile
            return out
        raise
    return out
