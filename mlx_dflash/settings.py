"""What the environment switches, read once at start into one object: SETTINGS.

Every variable dflash-mlx reads is a field here, with its name beside it. The package reads
SETTINGS, never os.environ (a layout test holds it to that); the CLI and library users may change
a field, tests change them through monkeypatch (tests/conftest.py), and `dflash-mlx doctor`
prints them. A value is checked where it is used, in one sentence naming the variable, so a
typo in one never stops `import mlx_dflash`.

Seven of them change which code computes a verify (the first seven below); each states which
device class it serves (engine/device.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import DFlashError

# field -> (variable, what it switches)
VARIABLES = {
    "attention": ("DFLASH_ATTENTION", "tree attention: auto | metal | reference (Metal)"),
    "gdn": ("DFLASH_GDN", "Gated DeltaNet kernels: auto | metal | reference (Metal)"),
    "numpy_math": ("DFLASH_MLX_NUMPY_MATH", "large exponentials through numpy: auto | 0 | 1 (CPU)"),
    "row_padding": ("DFLASH_MLX_ROW_PADDING", "dense rows padded: auto | 0 | k (CPU)"),
    "cpu_attention": ("DFLASH_MLX_CPU_ATTENTION", "attention's base-2 softmax: auto | 0 (CPU)"),
    "compile": ("DFLASH_MLX_COMPILE", "a layer's halves through mx.compile: auto | 0 | 1 (GPU)"),
    "blas": ("DFLASH_BLAS", "OpenBLAS for float32 matmuls: auto | off | a path (CPU, Linux)"),
    "parallel": ("DFLASH_MLX_PARALLEL", "a sharded target: auto | tensor | pipeline"),
    "dist_timeout": ("DFLASH_MLX_DIST_TIMEOUT", "seconds a rank waits for the others"),
    "cache": ("DFLASH_MLX_CACHE", "where profiles and kernel verdicts are kept"),
    "shared": ("DFLASH_SHARED", "the benchmark data folder (shared/data/bench)"),
}


@dataclass
class Settings:
    """Each field's value as its variable gave it (stripped); "" where it is unset."""

    attention: str = ""
    gdn: str = ""
    numpy_math: str = ""
    row_padding: str = ""
    cpu_attention: str = ""
    compile: str = ""
    blas: str = ""
    parallel: str = ""
    dist_timeout: str = ""
    cache: str = ""
    shared: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        return cls(**{f: env.get(var, "").strip() for f, (var, _) in VARIABLES.items()})

    def choice(self, name: str, allowed: tuple[str, ...], default: str = "auto") -> str:
        """Field `name` lower-cased (unset: `default`) if it is one of `allowed`, else one
        sentence naming the variable."""
        value = (self.value(name).strip() or default).lower()
        if value not in allowed:
            var = VARIABLES[name][0]
            raise DFlashError(f"{var} must be one of {', '.join(allowed)}, not {value!r}.")
        return value

    def value(self, name: str) -> str:
        return str(getattr(self, name))

    def line(self) -> str:
        """doctor's line: the variables set, else that none is."""
        set_ = [f"{var}={self.value(f)}" for f, (var, _) in VARIABLES.items() if self.value(f)]
        return ", ".join(set_) if set_ else "defaults (no DFLASH_* variable set; docs/settings.md)"


SETTINGS = Settings.from_env()
