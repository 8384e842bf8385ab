"""Where dflash-mlx keeps things: the embedded default pair, and the cache of converted hub
models, verify profiles and kernel verdicts."""

from __future__ import annotations

import os
from pathlib import Path

ASSETS = Path(__file__).parent / "assets"
DEFAULT_TARGET = ASSETS / "stories260K"
DEFAULT_DRAFTER = ASSETS / "stories260K-dflash"


def cache_root() -> Path:
    """$DFLASH_MLX_CACHE, else ~/.cache/dflash-mlx."""
    return Path(os.environ.get("DFLASH_MLX_CACHE", Path.home() / ".cache" / "dflash-mlx"))
