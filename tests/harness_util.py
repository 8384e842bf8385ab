"""Helpers shared by the Metal-kernel tests (test_tree_attention.py, test_gdn_kernels.py):
the CPU harness (metal/harness/run_kernel.py, loaded by the `harness` fixture in conftest.py),
tree shapes, and the checks both kernel modules get."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
HARNESS_PY = REPO / "metal" / "harness" / "run_kernel.py"


def load_harness() -> ModuleType:
    """metal/harness/run_kernel.py as a module; skips the test where there is no C++ compiler."""
    name = "mlx_dflash_metal_harness"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HARNESS_PY)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    mod = sys.modules[name]
    try:
        mod.compiler()
    except mod.HarnessUnavailable as exc:
        pytest.skip(str(exc))
    return mod


# ---------------------------------------------------------------------------------------------
# Trees (parent arrays)


def random_tree(rng: np.random.Generator, t: int, window: int | None = None) -> np.ndarray:
    """Parents drawn among all earlier nodes, or the last `window` ones (deeper trees)."""
    lo = (lambda i: 0) if window is None else (lambda i: max(0, i - window))
    return np.array([-1] + [int(rng.integers(lo(i), i)) for i in range(1, t)], dtype=np.int32)


def chain(t: int) -> np.ndarray:
    return np.arange(-1, t - 1, dtype=np.int32)


def star(t: int) -> np.ndarray:
    return np.array([-1] + [0] * (t - 1), dtype=np.int32)


# ---------------------------------------------------------------------------------------------
# Checks both kernel modules get


def check_sources_in_wheel_layout(
    monkeypatch, tmp_path: Path, module: ModuleType, metal_file: str, kernels: Sequence[str]
) -> None:
    """In a wheel the .metal file sits in mlx_dflash/metal; `module.kernel_sources` finds it
    there and splits it into the header and `kernels`, section markers gone."""
    from mlx_dflash.kernels import dispatch as metal_kernels

    pkg = tmp_path / "mlx_dflash"
    (pkg / "metal").mkdir(parents=True)
    (pkg / "metal" / metal_file).write_text((REPO / "metal" / metal_file).read_text())
    monkeypatch.setattr(metal_kernels, "__file__", str(pkg / "kernels" / "dispatch.py"))
    module.kernel_sources.cache_clear()
    try:
        assert metal_kernels.metal_dir(metal_file) == pkg / "metal"
        sources = module.kernel_sources()
        assert set(sources) >= {"header", *kernels}
        assert "simd_sum" in sources[kernels[0]]
        assert "//// [" not in "".join(sources.values())
    finally:
        module.kernel_sources.cache_clear()


def check_generated_source(
    harness: ModuleType, path: Path, run: Callable[..., Any], *args: mx.array
) -> list[str]:
    """Trace `run(*args, kernel_factory=...)` through the real mx.fast.metal_kernel (export
    needs no GPU) and find the harness's rendering of each launch, byte for byte, in the
    exported graph. Returns the launched kernels' names."""
    launches = []

    def recording_factory(**spec):
        kernel = mx.fast.metal_kernel(**spec)

        def call(**kw):
            launches.append((spec, kw))
            return kernel(**kw)

        return call

    def fn(*xs):
        return run(*xs, kernel_factory=recording_factory)

    try:
        mx.export_function(str(path), fn, *args)
    except RuntimeError as exc:  # older MLX cannot trace custom kernels without Metal
        pytest.skip(f"this MLX cannot export metal kernels here: {exc}")
    blob = path.read_bytes()
    for spec, kw in launches:
        text = harness.generate_source(
            name=spec["name"],
            input_names=spec["input_names"],
            output_names=spec["output_names"],
            source=spec["source"],
            header=spec["header"],
            inputs=kw["inputs"],
            template=kw["template"],
            output_dtypes=kw["output_dtypes"],
        )
        assert text.encode() in blob
    return [spec["name"] for spec, _ in launches]
