"""`dflash-mlx doctor`: what this machine will actually run, measured rather than assumed."""

from __future__ import annotations

import platform
import sys
import time

from rich.console import Console
from rich.table import Table

from . import options as opts


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


def memory_bytes() -> tuple[int | None, int | None]:
    """(this machine's memory, what the GPU may hold: Metal's recommended working set, else
    None). Either None where the system does not say."""
    import contextlib
    import os

    import mlx.core as mx

    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = None
    gpu = None
    if mx.metal.is_available():
        with contextlib.suppress(Exception):  # an older MLX without device_info: not shown
            gpu = int(mx.device_info().get("max_recommended_working_set_size") or 0) or None
    return total, gpu


def memory_line() -> str:
    total, gpu = memory_bytes()
    if total is None:
        return "not known"
    line = f"{total / 1e9:.1f} GB"
    if gpu is not None:
        line += f" ({gpu / 1e9:.1f} GB for the GPU: Metal's recommended working set)"
    return line


def disk_line() -> str:
    """Free space where downloaded models go (the Hugging Face hub cache)."""
    import shutil
    from pathlib import Path

    from huggingface_hub.constants import HF_HUB_CACHE

    where = Path(HF_HUB_CACHE)
    existing = where
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
        return f"not known ({where})"
    return f"{free / 1e9:.1f} GB free for models ({where})"


def next_step(model: str | None, drafter: str | None, blas_ok: bool) -> str:
    """The one thing to do next: fix what would make decoding slow, else run something that
    fits this machine (the largest published target whose 4-bit weights fit in half of what
    the GPU may hold, on a Mac)."""
    from ..checkpoints.registry import support_rows

    if not blas_ok:
        return "sudo apt-get install libopenblas0-pthread (float32 matmul is far slower without)"
    if model is not None:
        return f"dflash-mlx chat -m {model}" + (f" -d {drafter}" if drafter else "")
    room = memory_bytes()[1] or 0  # (on a CPU: nothing published is worth running)
    fits = [r for r in support_rows() if r["runs"] and r["weights_gb"] and r["default"]
            and r["weights_gb"]["4bit"] * 1e9 <= room / 2]  # fmt: skip
    if not fits:
        return (
            "dflash-mlx generate -p 'Once upon a time' (the embedded pair), then pick a target "
            "with dflash-mlx models"
        )
    best = max(fits, key=lambda r: r["weights_gb"]["4bit"])
    return (
        f"{best['command']} (a 4-bit copy's weights, {best['weights_gb']['4bit']:g} GB, "
        f"fit this Mac's GPU memory)"
    )


def report() -> dict[str, str]:
    import mlx.core as mx

    from .. import _blas
    from ..benchmark.runner import package_version
    from ..engine.device import device_class
    from ..kernels import cpu_math
    from ..kernels.gated_delta import gdn_backend
    from ..kernels.tree_attention import attention_backend
    from ..settings import SETTINGS

    metal = mx.metal.is_available()
    blas = "Accelerate" if sys.platform == "darwin" else "bundled"
    if sys.platform.startswith("linux"):
        slow = "MLX's bundled reference BLAS (slow: apt-get install libopenblas0-pthread)"
        blas = _blas.loaded_blas or slow
    return {
        "dflash-mlx": package_version("mlx-dflash") or "not installed",
        "platform": f"{platform.system()} {platform.machine()}, Python {platform.python_version()}",
        "memory": memory_line(),
        "disk": disk_line(),
        "mlx": package_version("mlx") or "not installed",
        "mlx-lm": package_version("mlx-lm") or "not installed",
        "device": f"{mx.default_device()} ({'Metal GPU' if metal else 'CPU only, no Metal'})",
        "device class": {
            "metal": "metal: Metal kernels, measured choices",
            "gpu": "gpu (MLX's CUDA backend): stock MLX, no Metal kernels, no CPU tricks",
            "cpu": "cpu: CPU tricks (numpy exponentials, BLAS row padding, attention), no kernels",
        }[device_class()],
        "blas": blas,
        "float32 matmul": f"{matmul_gflops():.1f} GFLOP/s (1024x1024)",
        "tree attention": attention_backend(),
        "gated deltanet": gdn_backend(),
        "exponentials": cpu_math.describe(),
        "settings": SETTINGS.line(),
        "quantized verify": "small-M kernel where this Mac's calibration chose it (per model)"
        if metal
        else "stock mx.quantized_matmul (the small-M verify kernel is Metal-only)",
    }


def pair_report(model: str | None, drafter: str | None) -> dict[str, str]:
    """The target and the drafter that would run (the embedded pair by default), read from
    their config.json files: which drafter generation it is, never guessed from a name."""
    from ..checkpoints.read import read_config, text_config
    from ..checkpoints.registry import find_drafter
    from ..checkpoints.resolve import resolve_model
    from ..errors import NoDrafterKnown
    from ..models.drafter_config import DrafterConfig
    from ..paths import DEFAULT_DRAFTER, DEFAULT_TARGET

    if model is None:
        model, drafter = str(DEFAULT_TARGET), drafter or str(DEFAULT_DRAFTER)
    target_path = resolve_model(model, "target")
    tcfg = read_config(target_path, "target")
    t = text_config(tcfg)
    out = {"target": f"{target_path} ({t.get('model_type', tcfg.get('model_type'))}, "
           f"{t.get('num_hidden_layers')} layers)"}  # fmt: skip
    if drafter is None:
        try:
            drafter = find_drafter(model)
        except NoDrafterKnown:  # as generate does: prompt lookup alone
            return {**out, "drafter": "none known for this target: it runs prompt lookup alone "
                    "(--drafter names one)"}  # fmt: skip
    drafter_path = resolve_model(drafter, "drafter", target=target_path)
    d = DrafterConfig.from_dict(
        read_config(drafter_path, "drafter"), num_target_layers=t.get("num_hidden_layers")
    ).describe()
    kind = "DFlash 2" if d["kind"] == "dflash2" else "DFlash"
    extra = ""
    if d["kind"] == "dflash2":
        extra = f", selector top-{d['selector']['top_k']} rank {d['selector']['rank']}"
    window = f", sliding window {d['sliding_window']}" if d["sliding_window"] else ""
    out["drafter"] = (
        f"{drafter_path}: {kind} ({d['architecture']}), {d['layers']} layers, block "
        f"{d['block_size']}{window}{extra}"
    )
    return out


def verify_report(model: str | None) -> dict[str, str]:
    """How a verify runs on this machine: whether it is queued layer by layer (models/queueing.py:
    the CPU backend's choice, a GPU's measured per target), and on Metal a quantized target's
    kernel calibration (models/quantized.py): per row count, the whole model's stock and
    kernel cost in one-row steps and the layers on the kernel."""
    from ..engine.device import on_cpu, on_metal

    cpu = {"verify queueing": "layer by layer (the CPU backend's choice)"} if on_cpu() else {}
    if model is None:
        return cpu
    from ..checkpoints.resolve import resolve_model
    from ..models.target import load_target

    target = load_target(resolve_model(model, "target"))  # (measures once, then cached)
    if cpu:
        return {
            **cpu,
            "blas threads": threads_line(target),
            "compiled layers": compile_line(target),
        }
    out = {"verify queueing": queueing_line(target), "compiled layers": compile_line(target)}
    if not on_metal():
        return out
    cal = target.verify_kernel
    if cal is None:
        kernel = "none: no quantized linear layer the kernel takes"
    elif not cal.agreed:
        kernel = f"not used: it disagreed with stock MLX here ({cal.reason})"
    else:
        kernel = "\n".join(f"M={r['rows']:>2}: stock {r['stock_steps']:.2f} / kernel "
                           f"{r['kernel_steps']:.2f} steps, kernel on {r['kernel_layers']} of "
                           f"{r['shapes']} shapes" for r in cal.rows())  # fmt: skip
    return {**out, "verify kernel": kernel}


def queueing_line(target) -> str:
    """The measured choice between a verify queued whole and layer by layer."""
    from ..models.queueing import TOKENS

    t = target.queue_timings
    if t is None:
        return "whole (not measured: a sharded target)"
    way = "layer by layer" if target.queue_layers else "whole"
    return (
        f"{way}: a {TOKENS}-token verify {1e3 * t['by_layer']:.2f} ms by layer, "
        f"{1e3 * t['whole']:.2f} ms whole (measured at first load)"
    )


def compile_line(target) -> str:
    """Whether lone passes run each layer's halves compiled (models/compiled.py)."""
    from ..settings import SETTINGS

    t, way = target.compile_timings, "on" if target.compiled else "off"
    if t is None:
        why = "a sharded target" if target.world.sharded else "the CPU's choice"
        why = "DFLASH_MLX_COMPILE" if SETTINGS.compile in ("0", "1") else why
        return f"{way} ({why}; a GPU measures it at a target's first load)"
    if t["compiled"] == float("inf"):
        return f"{way}: compiled layers disagreed with plain ones on this device (never used)"
    return (
        f"{way}: a verify {1e3 * t['compiled']:.2f} ms compiled, {1e3 * t['plain']:.2f} ms "
        "plain (measured at first load)"
    )


def threads_line(target) -> str:
    """OpenBLAS's threads for this target's forwards, and what chose them (models/queueing.py)."""
    from .. import _blas

    t, n = target.blas_timings, _blas.threads()
    if t is None:
        return f"{n} (OpenBLAS's own: not a float32 target, or one thread)" if n else "no OpenBLAS"
    timed = ", ".join(f"{1e3 * sec:.2f} ms on {k}" for k, sec in t.items())
    return f"{n}: two block rounds {timed} (measured at first load)"


def pairs_summary() -> dict[str, str]:
    """One line on the published pairs: how many this build runs (computed by the loaders)."""
    from ..checkpoints.registry import support_rows

    rows = support_rows()
    runs = sum(bool(r["runs"]) for r in rows)
    return {"published pairs": f"{runs} of {len(rows)} run in this build; see dflash-mlx models"}


def doctor_command(model: str = opts.MODEL, drafter: str = opts.DRAFTER) -> None:
    """Check this machine and the pair that would run, and say what to do next.

    Platform, versions, memory and disk, device, BLAS with measured GFLOP/s, active kernels,
    the model pair that would run (which drafter kind: DFlash or DFlash 2), and how many
    published pairs this build runs."""
    from .. import _blas

    table = Table(show_header=False, box=None)
    blas_ok = not sys.platform.startswith("linux") or bool(_blas.loaded_blas)
    rows = {**report(), **pair_report(model, drafter), **verify_report(model), **pairs_summary()}
    for k, v in {**rows, "next step": next_step(model, drafter, blas_ok)}.items():
        table.add_row(f"[bold]{k}[/bold]", v)
    Console().print(table)
