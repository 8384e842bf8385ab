"""Load a real BLAS before MLX on Linux.

The `mlx[cpu]` wheel bundles a reference BLAS (float32 matmul near 4 GFLOP/s). MLX resolves
`sgemm` and friends dynamically, so a system OpenBLAS loaded with RTLD_GLOBAL *before* mlx is
imported takes over every matmul (10-30x faster). This must run before the first `import mlx`.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

from .settings import SETTINGS

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

loaded_blas: str | None = None


def find_openblas() -> str | None:
    override = SETTINGS.blas
    if override and override.lower() != "auto":
        return override if os.path.exists(override) else None
    for path in CANDIDATES:
        if os.path.exists(path):
            return path
    hits = sorted(glob.glob("/usr/lib*/**/libopenblas*.so*", recursive=True))
    return hits[0] if hits else None


def load_openblas() -> str | None:
    """Load OpenBLAS globally on Linux; return its path, or None when absent or disabled."""
    global loaded_blas
    if loaded_blas or not sys.platform.startswith("linux") or SETTINGS.blas.lower() == "off":
        return loaded_blas
    path = find_openblas()
    if path is None:
        return None
    if "mlx.core" in sys.modules:
        import warnings

        warnings.warn(
            "mlx was imported before mlx_dflash, so OpenBLAS cannot take over float32 matmul "
            "(10-30x slower on Linux): import mlx_dflash first.",
            stacklevel=3,
        )
        return None
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    loaded_blas = path
    return path
