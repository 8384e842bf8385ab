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
        from ..benchmark.runner import package_version

        typer.echo(f"dflash-mlx {package_version('mlx-dflash') or '(not installed as a package)'}")
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


# mlx-lm's flags that are not taken here: what to type instead, or why not (README, "Coming
# from mlx-lm"), said in one sentence rather than "No such option".
MLX_LM_FLAGS = {
    "--draft-model": "here the drafter is a DFlash drafter: --drafter (found for known targets)",
    "--num-draft-tokens": "here --budget N (or auto) sizes what a round verifies",
    "--ignore-chat-template": "here it is --no-chat-template",
    "--log-level": "here serve --verbose logs every request",
    "--decode-concurrency": "here it is serve --max-batch",
    "--prompt-cache-size": "here it is serve --prefix-cache-sessions",
    "--prompt-cache-bytes": "here it is serve --prefix-cache-mb",
    "--chat-template-args": "here --thinking/--no-thinking, or a request's chat_template_kwargs",
    "--chat-template-config": "the model's own chat template is used (or none: --no-chat-template)",
    "--use-default-chat-template": "the model's own chat template is used",
    "--pipeline": "a target is sharded over several Macs with mlx.launch (README, Several Macs)",
    "--adapter-path": "a LoRA adapter would change the target its drafter was trained for",
    "--trust-remote-code": "nothing here runs a model's own code: targets are mlx-lm modules",
    "--image": "only text targets run here",
    "--quantize-activations": "quantized activations are not supported here yet",
    "--allowed-origins": "serve answers agents on this machine, without CORS",
    "--prompt-concurrency": "a long prompt's chunks already interleave with the batch's rounds",
}


def _mlx_lm_flag(args: list[str]) -> str | None:
    """One sentence for the first mlx-lm flag in `args` that is not taken here, else None."""
    for arg in args:
        name = arg.split("=", 1)[0]
        if name in MLX_LM_FLAGS:
            return f"{name} is mlx-lm's and not taken here: {MLX_LM_FLAGS[name]}."
    return None


def main() -> None:
    try:
        said = _mlx_lm_flag(sys.argv[1:])
        if said is not None:
            raise DFlashError(said)
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
