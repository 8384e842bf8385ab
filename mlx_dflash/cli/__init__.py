"""The `dflash-mlx` command line: thin wrappers, one module per command.

Every user mistake surfaces as a DFlashError, printed here as one sentence with a non-zero exit.
"""

from __future__ import annotations

import inspect
import sys

import typer

from ..errors import DFlashError

app = typer.Typer(
    name="dflash-mlx",
    help="Lossless DFlash / DDTree speculative decoding for MLX.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"dflash-mlx {version('mlx-dflash')}")
        except PackageNotFoundError:
            typer.echo("dflash-mlx (not installed as a package)")
        raise typer.Exit()


@app.callback()
def _options(
    show_version: bool = typer.Option(
        False, "--version", help="Print the version and exit.", callback=_version, is_eager=True
    ),
) -> None:
    """Lossless DFlash / DDTree speculative decoding for MLX."""


def _help(command) -> str:
    """A command's docstring as help: each paragraph one line, for the terminal to wrap (the
    first paragraph is the summary `dflash-mlx --help` lists)."""
    paragraphs = inspect.cleandoc(command.__doc__ or "").split("\n\n")
    return "\n\n".join(" ".join(p.split()) for p in paragraphs)


def _register() -> None:
    from . import bench, cache, chat, convert, doctor, generate, models, serve, train

    for name, command in (
        ("generate", generate.generate_command),
        ("chat", chat.chat_command),
        ("cache", cache.cache_command),
        ("bench", bench.bench_command),
        ("convert", convert.convert_command),
        ("doctor", doctor.doctor_command),
        ("models", models.models_command),
        ("train", train.train_command),
        ("serve", serve.serve_command),
    ):
        app.command(name, help=_help(command))(command)


_register()


def main() -> None:
    try:
        app()
    except DFlashError as e:
        msg = str(e).strip()
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
