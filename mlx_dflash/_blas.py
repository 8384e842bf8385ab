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
_lib: ctypes.CDLL | None = None
LOADED_THREADS = 0  # OpenBLAS's own thread count at load (0: not loaded)


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
    global _lib, LOADED_THREADS
    try:
        _lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    try:
        LOADED_THREADS = int(_lib.openblas_get_num_threads())
    except AttributeError:  # a DFLASH_BLAS override without OpenBLAS's thread calls
        LOADED_THREADS = 0
    loaded_blas = path
    return path


def threads() -> int:
    """OpenBLAS's thread count now (0 where it is not loaded or not OpenBLAS)."""
    return int(_lib.openblas_get_num_threads()) if _lib is not None and LOADED_THREADS else 0


def set_threads(n: int) -> None:
    """Run OpenBLAS's matmuls on n threads (models/queueing.py chooses n per target)."""
    if _lib is not None and LOADED_THREADS:
        _lib.openblas_set_num_threads(int(n))
