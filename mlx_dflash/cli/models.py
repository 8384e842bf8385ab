"""`dflash-mlx models`: the published target -> drafter pairs and whether this build runs each
(mlx_dflash.checkpoints.registry.support_rows asks the loaders; nothing here decides)."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table


def models_command(
    as_json: bool = typer.Option(False, "--json", help="Print the pairs as one JSON list."),
) -> None:
    """List the published DFlash pairs and whether this build runs each.

    Per pair: the target, its drafter (and kind), and the loader's reason where this build
    does not run it."""
    from ..checkpoints.registry import support_rows

    rows = support_rows()
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    runs = sum(bool(r["runs"]) for r in rows)
    table = Table(title=f"{runs} of {len(rows)} published pairs run in this build")
    table.add_column("target", no_wrap=True)
    table.add_column("drafter", no_wrap=True)
    table.add_column("kind", no_wrap=True)
    table.add_column("default", no_wrap=True)
    table.add_column("runs here", overflow="fold")
    for r in rows:
        verdict = (
            "[green]yes[/green]"
            if r["runs"]
            else f"[red]refused[/red]: {escape(str(r['refused']))}"
        )
        table.add_row(
            str(r["target"]),
            str(r["drafter"]),
            str(r["kind"]),
            "yes" if r["default"] else "",
            verdict,
        )
    console = Console()
    if not console.is_terminal:  # piped: keep every id on one line for grep
        console.width = max(console.width, 160)
    console.print(table)
