"""Shared pytest setup: repo root importable (for `convert/`), the `../shared` material."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Under pytest-xdist (`make test` runs a worker per core) each worker gets its own temporary
# folder: MLX's CPU backend compiles fused kernels into $TMPDIR/mlx and loads them back, and two
# workers building the same kernel at once could load a library the other is still writing.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _tmp = Path(tempfile.gettempdir()) / f"dflash-mlx-tests-{os.environ['PYTEST_XDIST_WORKER']}"
    _tmp.mkdir(exist_ok=True)
    os.environ["TMPDIR"] = str(_tmp)
    tempfile.tempdir = None  # read $TMPDIR again
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Before any test module imports mlx, so OpenBLAS takes over float32 matmul (mlx_dflash/_blas.py).
import mlx_dflash  # noqa: E402, F401
from mlx_dflash.settings import SETTINGS, VARIABLES  # noqa: E402


@pytest.fixture(scope="session")
def SHARED() -> Path:
    """The read-only `shared/` folder next to the repo (CI sees it at ../shared), or $DFLASH_SHARED."""
    return Path(os.environ.get("DFLASH_SHARED", ROOT / ".." / "shared")).resolve()


@pytest.fixture(scope="session")
def shared_file(SHARED: Path) -> Callable[[str], Path]:
    """`shared_file("models/x.bin")`: the path under SHARED, or skip the test saying what's missing."""

    def get(relative: str) -> Path:
        path = SHARED / relative
        if not path.exists():
            pytest.skip(f"needs {path} (the project's shared/ material), which is absent")
        return path

    return get


@pytest.fixture
def run_cli(monkeypatch, capsys) -> Callable[..., tuple[int, str, str]]:
    """Run `dflash-mlx ARGS` in-process through cli.main: (exit code, stdout, stderr)."""

    def run(*args) -> tuple[int, str, str]:
        from mlx_dflash import cli

        monkeypatch.setattr(sys, "argv", ["dflash-mlx", *map(str, args)])
        code = 0
        try:
            cli.main()
        except SystemExit as e:
            code = e.code or 0
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


@pytest.fixture(scope="module")
def harness():
    """metal/harness/run_kernel.py as a module (tests/harness_util.py); skipped where there is
    no C++ compiler."""
    from harness_util import load_harness

    return load_harness()


@pytest.fixture(autouse=True)
def no_hub(monkeypatch):
    """No test reaches the Hugging Face hub: downloads fail as offline unless a test serves
    local folders in their place (tests/test_registry.py's `serve`)."""
    from mlx_dflash.checkpoints import convert

    def offline(repo_id):
        raise ConnectionError(f"tests have no network ({repo_id})")

    monkeypatch.setattr(convert, "_download_config", offline)
    monkeypatch.setattr(convert, "_snapshot_download", offline)


def set_setting(patch: pytest.MonkeyPatch, **values: str) -> None:
    """Change fields of mlx_dflash's SETTINGS (read once from the environment at import),
    and their variables for the processes a test starts; `patch` undoes both."""
    for name, value in values.items():
        patch.setattr(SETTINGS, name, value)
        patch.setenv(VARIABLES[name][0], value)


@pytest.fixture(scope="session", autouse=True)
def session_environment(tmp_path_factory):
    """Before any fixture loads a model (module-scoped ones included): caches (verify
    profiles, padding tables, kernel verdicts) in one folder per test session, never the
    user's ~/.cache, every loaded target's forwards padded to multiples of 16 rows
    (models/padding.py): deterministic, unlike a measured table, so every exactness test runs
    padded, and every float32 exponential of a forward through numpy at any size
    (kernels/cpu_math.py), so every exactness test runs through it too, and `--budget auto`'s
    measured verify profiles priced on a fixed curve (below). A variable set outside the tests
    wins; a test may set its own."""
    patch = pytest.MonkeyPatch()
    if not SETTINGS.cache:
        set_setting(patch, cache=str(tmp_path_factory.mktemp("dflash-cache")))
    if not SETTINGS.row_padding:
        set_setting(patch, row_padding="16")
    if not SETTINGS.numpy_math:
        set_setting(patch, numpy_math="1")
    # `--budget auto` decodes plainly where a probe timed a verify too dear (budget.
    # speculation_pays). On a tiny test target that verdict is the machine's load, not the
    # model, so the tests' --budget auto always drafts (the probe still runs and is cached);
    # tests/test_defaults.py checks the verdict itself with the real bound and fake timings.
    from mlx_dflash.engine import budget

    patch.setattr(budget, "MIN_IDEAL_SPEEDUP", 0.0)
    # What `--budget auto` prices a verify at is measured per model and machine, once. Under a
    # second test worker that timing is the other worker's load as much as the model's: a
    # lookup branch that pays on a quiet machine did not on a loaded one, and a test that
    # needed it failed. So the verifies still run (the path is exercised) but are priced as a
    # float32 target on this CPU prices them: a step, and 4% of one per further token (1.3
    # steps for 8). Tests of the pricing itself write their own (tests/test_defaults.py).
    measured = budget.VerifyProfile.measure.__func__

    def measure(cls, *args, **kwargs):
        sizes = measured(cls, *args, **kwargs).sizes
        return cls(sizes, [0.01 * (1 + 0.04 * (s - 1)) for s in sizes])

    patch.setattr(budget.VerifyProfile, "measure", classmethod(measure))
    yield
    patch.undo()


@pytest.fixture(autouse=True)
def isolated_cache():
    """Every test starts without the kernel verdicts an earlier one left in memory."""
    from mlx_dflash.kernels import self_check as kernel_check

    kernel_check.forget()
