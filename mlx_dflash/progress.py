"""The one progress-bar style of every long command (convert, bench, train), on stderr.

Disabled when stderr is not a terminal unless asked for, so logs and pipes get no stray lines.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def progress(
    *, transient: bool = True, eta: bool = False, info: bool = False, show: bool | None = None
) -> Progress:
    """A rich Progress: description, bar, n/total and elapsed time; `eta` adds the time left,
    `info` a free-text field (`progress.update(task, info=...)`); `show` forces it on or off."""
    console = Console(stderr=True)
    columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn()]
    columns += [MofNCompleteColumn(), TimeElapsedColumn()]
    if eta:
        columns.append(TimeRemainingColumn())
    if info:
        columns.append(TextColumn("{task.fields[info]}"))
    return Progress(
        *columns,
        console=console,
        transient=transient,
        disable=not console.is_terminal if show is None else not show,
    )
