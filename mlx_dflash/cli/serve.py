"""`dflash-mlx serve`: the OpenAI-compatible server (mlx_dflash.server) on a loaded pair."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from ..engine.choice import describe
from ..errors import DFlashError
from . import options as opts

SERVER = "Server"
MAX_BATCH = typer.Option(
    8,
    "--max-batch",
    min=1,
    help="Requests whose rounds share each target forward (1: one at a time). 8: on a "
    "2-core CPU, throughput still grew from 4 to 8 (docs/batching.md).",
)
KEEP_ANSWERS = typer.Option(
    None,
    "--keep-answers",
    help="A file where the answers that join the lookup corpus are kept (created if new, "
    "readable only by you) and read back at start, so what the server learned in earlier "
    "sessions survives a restart. It holds the served answers, as token ids.",
)


THINKING = typer.Option(
    None, "--thinking/--no-thinking",
    help="Default enable_thinking for chat templates that have the switch (requests may "
    "override it with chat_template_kwargs).",
)  # fmt: skip
MAX_TOKENS = opts.max_tokens_option(512, "Answer length when a request does not say.")
HOST = typer.Option(
    "127.0.0.1", "--host", help="Address to bind (0.0.0.0 exposes the server to the network)."
)
PORT = typer.Option(8080, "--port", min=0, max=65535, help="0: any free port.")
API_KEY = typer.Option(
    None, "--api-key", envvar="DFLASH_MLX_API_KEY", help="Require 'Authorization: Bearer KEY'."
)
NAME = typer.Option(
    None, "--served-model-name", help="Model id clients use (default: the model's name)."
)
CACHE_MB = typer.Option(2048, "--prefix-cache-mb", min=0, help="Memory for cached prompt prefixes.")
CACHE_SESSIONS = typer.Option(
    8, "--prefix-cache-sessions", min=1, help="Cached prompt prefixes kept at most."
)
VERBOSE = typer.Option(False, "--verbose", help="Log every request.")
opts.panel(SERVER, HOST, PORT, API_KEY, NAME, MAX_BATCH, CACHE_MB, CACHE_SESSIONS, VERBOSE)
opts.panel(opts.SPECULATION, KEEP_ANSWERS)
opts.panel(opts.TEMPLATE, THINKING)


def serve_command(
    model: str = opts.MODEL,
    drafter: str = opts.DRAFTER,
    thinking: bool = THINKING,
    prefill_step_size: int = opts.PREFILL,
    max_kv_size: int = opts.MAX_KV_SIZE,
    kv_bits: int = opts.KV_BITS,
    kv_group_size: int = opts.KV_GROUP_SIZE,
    quantized_kv_start: int = opts.QUANTIZED_KV_START,
    mode: str = opts.MODE,
    block_size: int = opts.BLOCK_SIZE,
    budget: str = opts.BUDGET,
    lookup: int = opts.LOOKUP,
    lookup_corpus: str = opts.LOOKUP_CORPUS,
    keep_answers: Path = KEEP_ANSWERS,
    temp: float = opts.TEMP,
    top_p: float = opts.TOP_P,
    top_k: int = opts.TOP_K,
    min_p: float = opts.MIN_P,
    min_tokens_to_keep: int = opts.MIN_TOKENS_TO_KEEP,
    xtc_probability: float = opts.XTC_PROBABILITY,
    xtc_threshold: float = opts.XTC_THRESHOLD,
    max_tokens: int = MAX_TOKENS,
    host: str = HOST,
    port: int = PORT,
    api_key: str = API_KEY,
    name: str = NAME,
    max_batch: int = MAX_BATCH,
    cache_mb: int = CACHE_MB,
    cache_sessions: int = CACHE_SESSIONS,
    verbose: bool = VERBOSE,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (chat, completions, messages)."""
    from ..server.app import App, ServerConfig
    from ..server.http import make_server

    flags = opts.Flags(max_tokens, temp, top_p, top_k, None, mode, block_size, budget,
                       lookup, lookup_corpus, prefill=prefill_step_size, min_p=min_p,
                       min_keep=min_tokens_to_keep,
                       xtc=(xtc_probability, xtc_threshold))  # fmt: skip
    kv = opts.kv_quantization(kv_bits, kv_group_size, quantized_kv_start)
    # (several ranks under mlx.launch: rank 0 serves HTTP; cfg: the engine config every
    # request starts from)
    world, target, runner, cfg = opts.load_settled(flags, model, drafter)
    if kv is not None or max_kv_size is not None:
        target.make_cache(kv, max_kv_size)  # a target they do not apply to stops here
    served = name or (Path(model).name if model else "stories260K")
    aliases = tuple(a for a in (model, Path(model).name if model else None) if a)
    keep = str(keep_answers) if keep_answers else None
    config = ServerConfig(model_name=served, aliases=aliases, api_key=api_key,
                          max_tokens=max_tokens, thinking=thinking, cache_bytes=cache_mb * 2**20,
                          cache_sessions=cache_sessions, max_batch=max_batch, keep_answers=keep, kv=kv,
                          max_kv_size=max_kv_size)  # fmt: skip
    app = App(target, runner if cfg.uses_drafter else None, cfg, config, world)
    if not world.is_main:
        return app.worker.follow(app.base)
    try:
        server = make_server(app, host, port, verbose)
    except OSError as e:
        raise DFlashError(f"Cannot listen on {host}:{port}: {e.strerror or e}.") from None
    base_url = f"http://{host}:{server.server_address[1]}/v1"
    log = app.worker.answer_log
    kept = f"; {log.kept} kept answers read from {log.path}" if log is not None else ""
    ran = describe(cfg, runner if cfg.uses_drafter else None)
    print(f"Serving '{served}' ({ran}) at OpenAI base_url {base_url}{kept}; Ctrl-C stops.",
          file=sys.stderr, flush=True)  # fmt: skip
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopping", file=sys.stderr)
    finally:
        server.server_close()
        app.worker.stop()
