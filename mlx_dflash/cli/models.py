"""`dflash-mlx models`: the published target -> drafter pairs, whether this build runs each
(mlx_dflash.checkpoints.registry.support_rows asks the loaders; nothing here decides), how
large each target is, and the command that runs it."""

from __future__ import annotations

import json

import typer
from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

# Below this many columns a table of ids and reasons cannot be read: each pair is a block.
TABLE_WIDTH = 130
HINT = (
    "A 4-bit or 8-bit MLX copy of a target (mlx-community/...-4bit, or `dflash-mlx convert "
    "TARGET --out DIR -q`) finds the same drafter: pass it to -m."
)


def size(row: dict) -> str:
    """'8B: 4.5 GB at 4-bit, 8.5 at 8-bit' (the weights: download and memory)."""
    if row["params_b"] is None:
        return "not known here"
    total, active = row["params_b"], row["active_params_b"]
    billions = f"{total:g}B" if total < 1000 else f"{total / 1000:.2g}T"
    if active is not None:
        billions += f" ({active:g}B active)"
    gb = row["weights_gb"]
    return f"{billions}: {gb['4bit']:g} GB at 4-bit, {gb['8bit']:g} at 8-bit"


def verdict(row: dict) -> str:
    return "[green]yes[/green]" if row["runs"] else f"[red]no[/red]: {escape(row['refused'])}"


def table(rows: list[dict], title: str) -> Table:
    out = Table(title=title, caption=HINT)
    for name in ("target", "drafter", "kind", "default", "size, weights"):
        out.add_column(name, no_wrap=True)
    out.add_column("runs here", overflow="fold")
    for r in rows:
        out.add_row(r["target"], r["drafter"], r["kind"], "yes" if r["default"] else "", size(r),
                    verdict(r))  # fmt: skip
    return out


def blocks(rows: list[dict], title: str) -> Group:
    """One block a pair: the target and whether it runs, then its drafter, size and command."""
    parts: list = [Text(title, style="bold"), Text("")]
    for r in rows:
        kind = r["kind"] + ("" if r["default"] else ", not the default")
        parts.append(Text.from_markup(f"[bold]{escape(r['target'])}[/bold]  {verdict(r)}"))
        fields = {"drafter": f"{r['drafter']} ({kind})", "size": size(r)}
        if r["command"]:
            fields["run"] = r["command"]
        grid = Table.grid(padding=(0, 1))
        grid.add_column(style="dim", no_wrap=True)
        grid.add_column(overflow="fold")
        for k, v in fields.items():
            grid.add_row(f"  {k}", escape(v))
        parts.append(grid)
    parts += [Text(""), Text(HINT)]
    return Group(*parts)


def render(rows: list[dict], width: int):
    """The pairs as a table where the terminal is wide, else as stacked blocks."""
    runs = sum(bool(r["runs"]) for r in rows)
    title = f"{runs} of {len(rows)} published pairs run in this build"
    return table(rows, title) if width >= TABLE_WIDTH else blocks(rows, title)


def models_command(
    as_json: bool = typer.Option(False, "--json", help="Print the pairs as one JSON list."),
) -> None:
    """List the published DFlash pairs and whether this build runs each.

    Per pair: the target, its drafter (and kind), the target's size (its weights at 4 and 8
    bits: download and memory), the command that runs it, and the loader's reason where this
    build does not."""
    from ..checkpoints.registry import support_rows

    rows = support_rows()
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    console = Console()
    if not console.is_terminal:  # piped: keep every id on one line for grep
        console.width = max(console.width, 200)
    console.print(render(rows, console.width))
