"""Where dflash-mlx keeps things: the embedded default pair, and the cache of converted hub
models, verify profiles and kernel verdicts."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from .settings import SETTINGS

ASSETS = Path(__file__).parent / "assets"
DEFAULT_TARGET = ASSETS / "stories260K"
DEFAULT_DRAFTER = ASSETS / "stories260K-dflash"
T = TypeVar("T")


def cache_root() -> Path:
    """$DFLASH_MLX_CACHE (settings.py), else ~/.cache/dflash-mlx."""
    return Path(SETTINGS.cache or Path.home() / ".cache" / "dflash-mlx")


def profile_key(target) -> str:
    """The name of what is measured once per model and machine (verify profile, row padding):
    the model's config, the CPU architecture, GPU or CPU, how many machines share it, and
    whether numpy computes the exponentials (kernels/cpu_math.py: it changes every cost)."""

    from .engine.device import device_class
    from .kernels import cpu_math

    device = {"metal": "gpu", "gpu": "cuda"}.get(device_class(), "cpu")
    ident = json.dumps(target.config, sort_keys=True, default=str)
    h = hashlib.sha1(ident.encode()).hexdigest()[:12]
    size = target.world.size
    shards = f"-tp{size}" if size > 1 else ""
    numpy = "-np" if cpu_math.enabled() else ""
    return f"{target.model_type}-{h}-{platform.machine()}-{device}{shards}{numpy}"


def read_profile(name: str, parse: Callable[[Any], T]) -> T | None:
    """parse() of a measurement cached per model and machine (profiles/NAME.json in the
    cache): the verify profile, the row-padding table, the verify kernel's calibration.
    None where it is absent or damaged: the caller measures again."""
    try:
        return parse(json.loads((cache_root() / "profiles" / f"{name}.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def measured(
    name: str, parse: Callable[[Any], T], measure: Callable[[], T], dump: Callable[[T], Any]
) -> T:
    """The measurement cached as NAME (read_profile), else measure() now, cached as dump() of
    it: each of these is measured once per model and machine."""
    value = read_profile(name, parse)
    if value is None:
        value = measure()
        write_profile(name, dump(value))
    return value


def write_profile(name: str, data: Any) -> None:
    """Cache a measurement (JSON) for read_profile, whole or not at all (a temporary file
    renamed); a read-only cache loses nothing but the time of measuring again."""
    path = cache_root() / "profiles" / f"{name}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError:
        pass
