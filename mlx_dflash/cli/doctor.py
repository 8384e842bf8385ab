"""`dflash-mlx doctor`: what this machine will actually run, measured rather than assumed."""

from __future__ import annotations

import platform
import sys
import time
from importlib.metadata import PackageNotFoundError, version

from rich.console import Console
from rich.table import Table


def matmul_gflops(n: int = 1024, repeats: int = 8) -> float:
    """float32 matmul throughput on the default device (the number that makes or breaks CPU decode)."""
    import mlx.core as mx

    a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
    mx.eval(a, b)
    for _ in range(2):
        mx.eval(a @ b)
    t = time.perf_counter()
    for _ in range(repeats):
        mx.eval(a @ b)
    return 2 * n**3 * repeats / (time.perf_counter() - t) / 1e9


def _version(pkg: str) -> str:
    try:
        return version(pkg)
    except PackageNotFoundError:
        return "not installed"


def report() -> dict[str, str]:
    import mlx.core as mx

    from .. import _blas
    from ..kernels.gated_delta import gdn_backend
    from ..kernels.tree_attention import attention_backend

    metal = mx.metal.is_available()
    if sys.platform.startswith("linux"):
        blas = (
            _blas.loaded_blas
            or "MLX's bundled reference BLAS (slow: apt-get install libopenblas0-pthread)"
        )
    else:
        blas = "Accelerate" if sys.platform == "darwin" else "bundled"
    return {
        "platform": f"{platform.system()} {platform.machine()}, Python {platform.python_version()}",
        "mlx": _version("mlx"),
        "mlx-lm": _version("mlx-lm"),
        "device": f"{mx.default_device()} ({'Metal GPU' if metal else 'CPU only, no Metal'})",
        "blas": blas,
        "float32 matmul": f"{matmul_gflops():.1f} GFLOP/s (1024x1024)",
        "tree attention": attention_backend(),
        "gated deltanet": gdn_backend(),
    }


def doctor_command() -> None:
    """Print platform, MLX / mlx-lm versions, device, BLAS with measured GFLOP/s, active kernels."""
    table = Table(show_header=False, box=None)
    for k, v in report().items():
        table.add_row(f"[bold]{k}[/bold]", v)
    Console().print(table)
