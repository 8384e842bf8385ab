"""SETTINGS (mlx_dflash/settings.py): the environment read once, checked where used, shown by
doctor, and what the code that used to read the environment now reads."""

from __future__ import annotations

import pytest

from mlx_dflash.errors import DFlashError
from mlx_dflash.kernels import cpu_math
from mlx_dflash.kernels.dispatch import backend_mode
from mlx_dflash.settings import SETTINGS, VARIABLES, Settings


def test_read_from_the_environment_once_and_checked_where_used():
    s = Settings.from_env({"DFLASH_GDN": " Metal ", "DFLASH_MLX_CACHE": "/tmp/x", "OTHER": "1"})
    assert s.gdn == "Metal" and s.cache == "/tmp/x" and s.attention == ""
    assert s.choice("gdn", ("auto", "metal", "reference")) == "metal"
    assert s.choice("attention", ("auto", "metal", "reference")) == "auto"  # unset
    with pytest.raises(DFlashError, match="^DFLASH_MLX_PARALLEL must be one of auto, tensor"):
        Settings(parallel="both").choice("parallel", ("auto", "tensor", "pipeline"))
    assert set(VARIABLES) == {f for f in Settings.__dataclass_fields__}


def test_the_code_reads_settings_not_the_environment(monkeypatch):
    monkeypatch.setenv("DFLASH_ATTENTION", "reference")  # read at import only: no effect now
    monkeypatch.setattr(SETTINGS, "attention", "")
    assert backend_mode("attention") == "auto"
    monkeypatch.setattr(SETTINGS, "attention", "reference")
    assert backend_mode("attention") == "reference"
    monkeypatch.setattr(SETTINGS, "numpy_math", "0")
    assert not cpu_math.enabled()
    monkeypatch.setattr(SETTINGS, "numpy_math", "yes")
    with pytest.raises(DFlashError, match="DFLASH_MLX_NUMPY_MATH must be one of auto, 0, 1"):
        cpu_math.setting()


def test_doctor_shows_what_is_set(run_cli, monkeypatch):
    for name in VARIABLES:
        monkeypatch.setattr(SETTINGS, name, "")
    monkeypatch.setattr(SETTINGS, "row_padding", "16")
    code, out, err = run_cli("doctor")
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.strip().startswith("settings"))
    assert "DFLASH_MLX_ROW_PADDING=16" in line and "DFLASH_GDN" not in line
    assert Settings().line().startswith("defaults")


def test_a_bad_value_is_one_sentence_at_the_command_line(run_cli, monkeypatch):
    monkeypatch.setattr(SETTINGS, "row_padding", "")
    monkeypatch.setattr(SETTINGS, "numpy_math", "sometimes")
    code, out, err = run_cli("generate", "-p", "Once", "-n", "4")
    assert code != 0 and "DFLASH_MLX_NUMPY_MATH must be one of auto, 0, 1" in err
    assert "Traceback" not in err
