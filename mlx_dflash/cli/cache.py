"""`dflash-mlx cache`: run a long prompt once and save the caches (mlx-lm's cache_prompt), so
`generate --prompt-cache-file` answers questions about it without running it again."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer

from .. import prompt_cache
from ..engine import Session
from ..engine.rounds import prefill
from ..paths import DEFAULT_TARGET
from ..prompts import render_open, use_template
from . import options as opts

CACHE_FILE = typer.Option(
    ..., "--prompt-cache-file", metavar="FILE", help="Where the cache goes (.safetensors)."
)
opts.panel(opts.OUTPUT, CACHE_FILE)


def cache_command(
    prompt: str = typer.Option(
        None, "--prompt", "-p", metavar="TEXT", help="The text to cache, or '-' to read stdin."
    ),
    prompt_file: str = typer.Option(
        None, "--prompt-file", metavar="FILE", help="Read the text from a file."
    ),
    model: str = opts.MODEL,
    drafter: str = opts.DRAFTER,
    chat_template: bool = opts.CHAT_TEMPLATE,
    system: str = opts.SYSTEM,
    prefill_step_size: int = opts.PREFILL,
    max_kv_size: int = opts.MAX_KV_SIZE,
    kv_bits: int = opts.KV_BITS,
    kv_group_size: int = opts.KV_GROUP_SIZE,
    quantized_kv_start: int = opts.QUANTIZED_KV_START,
    mode: str = opts.MODE,
    out: Path = CACHE_FILE,
) -> None:
    """Run a prompt once and save the caches for `generate --prompt-cache-file`.

    As mlx-lm's cache_prompt: through the chat template the text is an open user message that
    the later prompt continues. The drafter's context is saved with the target's caches, so
    the later run drafts from its first round."""
    text = opts.read_prompt(prompt, prompt_file)
    kv = opts.kv_quantization(kv_bits, kv_group_size, quantized_kv_start)
    prompt_cache.check_output(out)
    flags = opts.Flags(1, mode=mode, prefill=prefill_step_size)
    world, target, runner, cfg = opts.load_settled(flags, model, drafter)
    templated = use_template(target.tokenizer, chat_template)
    ids = render_open(target.tokenizer, text, system, templated)
    runner = runner if cfg.uses_drafter else None
    session = Session(target, runner, kv, max_kv_size)
    t0 = time.perf_counter()
    prefill(session, ids, cfg)
    prompt_cache.save(out, session, model or str(DEFAULT_TARGET), system=system,
                      chat_template=templated)  # fmt: skip
    if world.is_main:
        dt = time.perf_counter() - t0
        print(f"Saved {len(ids)} tokens' caches to {out} ({len(ids) / dt:.1f} tokens/s).",
              file=sys.stderr)  # fmt: skip
