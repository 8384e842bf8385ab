"""Writing outputs so that a crash, a Ctrl-C or a full disk never leaves a half-written one, and
never loses the finished one the user already had.

`atomic_folder`: build a folder beside its destination and move it into place only when it is
complete; an existing folder (with force) is moved aside first and deleted only after the new
one is in place, so at every instant one complete folder sits at the destination or, between
two renames, in its hidden sibling. `atomic_file`: the same for one file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import DFlashError


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def _publish(tmp: Path, out: Path, force: bool) -> None:
    """Move the finished folder into place; an old one is removed only after that succeeded."""
    if not _exists(out):
        os.replace(tmp, out)
        return
    if not force:
        raise DFlashError(f"The output folder {out} already exists; pass --force to replace it.")
    old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old, out)
        raise
    _remove(old)


@contextlib.contextmanager
def atomic_folder(out: str | Path, force: bool = False) -> Iterator[Path]:
    """A hidden sibling folder to build into; it becomes `out` only if the block succeeds.

    Any failure (including Ctrl-C) deletes it, so no half-written output is ever left behind;
    `force` replaces an existing `out`, which stays whole until the new one is in place.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        _publish(tmp, out, force)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def atomic_file(path: Path, write: Callable[[str], object]) -> None:
    """`write(tmp_path)` beside `path`, then one rename: a crash never leaves a half-written
    file. The temporary folder is per process, so concurrent writers never share it."""
    tmp = path.parent / f".partial-{os.getpid()}" / path.name
    tmp.parent.mkdir(exist_ok=True)
    try:
        write(str(tmp))
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # another file of this process may be under way
            tmp.parent.rmdir()
