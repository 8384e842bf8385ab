"""The `dflash-mlx` command line: thin wrappers, one module per command.

Every user mistake surfaces as a DFlashError, printed here as one sentence with a non-zero exit.
"""

from __future__ import annotations

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


def _register() -> None:
    from . import bench, chat, convert, doctor, generate, models, serve, train

    app.command("generate", help=generate.generate_command.__doc__)(generate.generate_command)
    app.command("chat", help=chat.chat_command.__doc__)(chat.chat_command)
    app.command("bench", help=bench.bench_command.__doc__)(bench.bench_command)
    app.command("convert", help=convert.convert_command.__doc__)(convert.convert_command)
    app.command("doctor", help=doctor.doctor_command.__doc__)(doctor.doctor_command)
    app.command("models", help=models.models_command.__doc__)(models.models_command)
    app.command("train", help=train.train_command.__doc__)(train.train_command)
    app.command("serve", help=serve.serve_command.__doc__)(serve.serve_command)


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
