"""What the Metal-kernel modules (tree_attention.py, gdn_kernels.py) share.

Each keeps its kernels in one metal/*.metal file, split into `//// [section]` parts (a
`header` plus one part per kernel), builds them once per kernel factory, and picks its backend
from an environment variable: auto (default) | metal | reference.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..errors import DFlashError
from ..settings import SETTINGS, VARIABLES
from . import self_check

KernelFactory = self_check.KernelFactory
MODES = ("auto", "metal", "reference")

_SECTION = re.compile(r"^//// \[(.+?)\][ \t]*$\n?", flags=re.MULTILINE)


def metal_dir(filename: str) -> Path:
    """metal/ sources: mlx_dflash/metal in a wheel, the repository's metal/ when editable."""
    package = Path(__file__).resolve().parent.parent
    for cand in (package / "metal", package.parent / "metal"):
        if (cand / filename).is_file():
            return cand
    raise DFlashError(
        f"The Metal kernel source {filename} is missing from this install; reinstall mlx-dflash."
    )


def read_sections(filename: str, required: Iterable[str]) -> dict[str, str]:
    """The `//// [name]` sections of a .metal file by name ("kernel " dropped); all required."""
    parts = _SECTION.split((metal_dir(filename) / filename).read_text())
    sections = {
        name.removeprefix("kernel ").strip(): body
        for name, body in zip(parts[1::2], parts[2::2], strict=True)
    }
    for need in required:
        if need not in sections:
            raise DFlashError(f"{filename} has no section [{need}]; the install is broken.")
    return sections


_kernels: dict[tuple[Any, str], Any] = {}


def cached_kernel(
    factory: KernelFactory,
    which: str,
    sources: Callable[[], dict[str, str]],
    input_names: Iterable[str],
    output_names: Iterable[str],
    **options: Any,
) -> Any:
    """The kernel `which` (a section of `sources()`, with its header), built once per factory."""
    key = (factory, which)
    if key not in _kernels:
        src = sources()
        _kernels[key] = factory(
            name=f"dflash_{which}",
            input_names=list(input_names),
            output_names=list(output_names),
            source=src[which],
            header=src["header"],
            **options,
        )
    return _kernels[key]


def backend_mode(setting: str) -> str:
    """The backend a setting (settings.py: "attention", "gdn") asks for: auto (unset), metal
    or reference."""
    return SETTINGS.choice(setting, MODES)


def metal_available() -> bool:
    return mx.metal.is_available()


def metal_ready(sources: Callable[[], object], available: Callable[[], bool]) -> bool:
    """Whether there is a Metal GPU and the kernel sources load."""
    if not available():
        return False
    try:
        sources()
    except DFlashError:
        return False
    return True


def use_kernel(
    setting: str,
    supported: bool,
    what: str | Callable[[], str],
    limits: str,
    *,
    sources: Callable[[], object],
    available: Callable[[], bool] = metal_available,
    family: str | None = None,
) -> bool:
    """Whether to run a kernel for a call whose shape support is `supported`.

    auto: the kernel when Metal is there, it takes the shape and its `family` passed its
    self-check on this machine (kernel_check.py); reference: never; metal: always (even after
    a failed self-check: for debugging), and a clear error where it cannot run (naming `what`,
    a string or a function giving one, and the `limits`) rather than a silent fallback.
    """
    mode, env_var = backend_mode(setting), VARIABLES[setting][0]
    if mode == "reference":
        return False
    if mode == "metal":
        if not available():
            raise DFlashError(
                f"{env_var}=metal needs a Metal GPU and none is available here; "
                f"unset it or set {env_var}=reference."
            )
        if not supported:
            what = what() if callable(what) else what
            raise DFlashError(f"{env_var}=metal cannot run {what} (supported: {limits}).")
        return True
    if not (supported and metal_ready(sources, available)):
        return False
    if family is None:
        return True
    return self_check.kernel_ok(family)


def describe_backend(
    setting: str,
    reference: str,
    fails: str,
    kernels: str,
    limits: str,
    *,
    sources: Callable[[], object],
    available: Callable[[], bool] = metal_available,
    family: str | None = None,
) -> str:
    """One line for `dflash-mlx doctor`: which path runs, and why (with the kernels'
    self-check verdict, running the check if this machine has none yet).

    reference: the reference path; fails: what breaks when metal is forced without a GPU;
    kernels: the kernel path, and limits: the shapes it takes.
    """
    env_var = VARIABLES[setting][0]
    try:
        mode = backend_mode(setting)
    except DFlashError as exc:
        return f"invalid: {exc}"
    if mode == "reference":
        return f"{reference}, forced by {env_var}=reference"
    if not available():
        if mode == "metal":
            return f"none: {env_var}=metal but no Metal GPU is available ({fails} will fail)"
        return f"{reference}: no Metal GPU"
    if not metal_ready(sources, available):
        return f"{reference}: Metal kernel source missing from the install"
    verdict = ""
    if family is not None:
        ok = self_check.kernel_ok(family)
        known = self_check.cached_verdict(family)
        verdict = f"; {known.describe()}" if known else ""
        if not ok and mode == "auto":
            return f"{reference}: the Metal kernel failed its self-check{verdict}"
    how = f"forced by {env_var}=metal" if mode == "metal" else "reference for other shapes"
    return f"{kernels} ({limits}; {how}{verdict})"
