"""The one atomic folder writer (mlx_dflash/atomic.py): nothing half-written is ever left, and a
folder the user had is never deleted before its replacement is in place."""

from __future__ import annotations

import os

import pytest

from mlx_dflash import atomic
from mlx_dflash.atomic import atomic_file, atomic_folder
from mlx_dflash.errors import DFlashError


def _old(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("old")
    return out


def _leftovers(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))


def test_a_new_folder_appears_only_when_complete(tmp_path):
    out = tmp_path / "new"
    with atomic_folder(out) as tmp:
        (tmp / "a").write_text("1")
        assert not out.exists()
    assert (out / "a").read_text() == "1" and not _leftovers(tmp_path)


def test_a_failed_build_leaves_the_old_folder_and_no_debris(tmp_path):
    out = _old(tmp_path)
    with pytest.raises(KeyboardInterrupt), atomic_folder(out, force=True) as tmp:
        (tmp / "config.json").write_text("half")
        raise KeyboardInterrupt
    assert (out / "config.json").read_text() == "old" and not _leftovers(tmp_path)


def test_the_old_folder_stays_whole_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    out = _old(tmp_path)
    seen = []
    real = os.replace

    def watching(src, dst):
        # Before every rename, a complete folder sits at `out` or in its hidden sibling.
        whole = [p for p in tmp_path.iterdir() if (p / "config.json").is_file()]
        seen.append(sorted(p.read_text() for p in (w / "config.json" for w in whole)))
        real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", watching)
    with atomic_folder(out, force=True) as tmp:
        assert (out / "config.json").read_text() == "old"  # still there while building
        (tmp / "config.json").write_text("new")
    assert (out / "config.json").read_text() == "new" and not _leftovers(tmp_path)
    assert all("old" in s for s in seen)  # the old one was never gone before the swap


def test_a_failed_swap_puts_the_old_folder_back(tmp_path, monkeypatch):
    out = _old(tmp_path)
    real, calls = os.replace, []

    def second_fails(src, dst):
        calls.append(1)
        if len(calls) == 2:  # moving the new folder in
            raise OSError("disk full")
        real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", second_fails)
    with pytest.raises(OSError), atomic_folder(out, force=True) as tmp:
        (tmp / "config.json").write_text("new")
    assert (out / "config.json").read_text() == "old" and not _leftovers(tmp_path)


def test_an_existing_folder_needs_force(tmp_path):
    out = _old(tmp_path)
    with pytest.raises(DFlashError, match="already exists; pass --force"):
        with atomic_folder(out) as tmp:
            (tmp / "config.json").write_text("new")
    assert (out / "config.json").read_text() == "old" and not _leftovers(tmp_path)


def test_atomic_file_never_leaves_a_partial_file(tmp_path):
    path = tmp_path / "state.json"
    path.write_text("old")

    def fails(tmp):
        open(tmp, "w").write("half")
        raise RuntimeError

    with pytest.raises(RuntimeError):
        atomic_file(path, fails)
    assert path.read_text() == "old" and not _leftovers(tmp_path)
    atomic_file(path, lambda tmp: open(tmp, "w").write("new"))
    assert path.read_text() == "new" and not _leftovers(tmp_path)
