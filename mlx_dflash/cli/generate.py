"""`dflash-mlx generate`: one prompt, streamed to the terminal (or one JSON object)."""

from __future__ import annotations

import dataclasses
import json
import sys

import typer

from ..engine import Session, Stats, stream_generate
from ..engine.choice import describe
from ..prompts import encode_prompt, stop_ids, use_template
from ..server.text import StopStrings
from . import options as opts

PROMPT, OUT = "Prompt", opts.OUTPUT


def cached_prompt(session, saved, arrays, prompt: str, system, thinking) -> list[int]:
    """The prompt's ids after a prompt cache, the session filled from it: a `cache` file's open
    message continued with the prompt (mlx-lm's rule), or a chat's messages and the prompt as
    the next user turn (`--system` and a chat template choice are the file's)."""
    from ..errors import DFlashError
    from ..prompt_cache import restore
    from ..prompts import continuation, render, thinking_kwargs

    if system:
        raise DFlashError("A prompt cache holds its own system message; drop --system.")
    restore(session, saved, arrays, session.target.folder)
    tokenizer, templated = session.target.tokenizer, bool(saved.chat_template)
    kwargs = thinking_kwargs(tokenizer, templated, thinking)
    if saved.source == "chat":
        msgs = [*saved.messages, {"role": "user", "content": prompt}]
        return render(tokenizer, msgs, saved.system, templated, **kwargs)
    return list(saved.tokens) + continuation(tokenizer, prompt, templated, **kwargs)


PROMPT_TEXT = typer.Option(
    None, "--prompt", "-p", metavar="TEXT", help="Prompt text, or '-' to read stdin."
)
PREFILL_RESPONSE = typer.Option(
    None, "--prefill-response", metavar="TEXT",
    help="The answer's start, which the model continues.",
)  # fmt: skip
PROMPT_FILE = typer.Option(
    None, "--prompt-file", metavar="FILE", help="Read the prompt from a file."
)
MAX_TOKENS = opts.max_tokens_option(256, "Tokens to generate at most.")
EXTRA_EOS = typer.Option(
    [], "--extra-eos-token", metavar="TOKEN", help="A token (text or id) that ends the answer too."
)
STOP = typer.Option([], "--stop", metavar="TEXT", help="End the answer before TEXT (repeatable).")
VERBOSE = typer.Option(None, "--verbose", metavar="BOOL", help="False: no stats line (mlx-lm's).")
AS_JSON = typer.Option(False, "--json", help="Text and stats as one JSON object.")
NO_STATS = typer.Option(False, "--no-stats", help="Do not print the stats line.")
opts.panel(PROMPT, PROMPT_TEXT, PREFILL_RESPONSE, PROMPT_FILE)
opts.panel(OUT, EXTRA_EOS, STOP, VERBOSE, AS_JSON, NO_STATS)


def stream(session, ids, cfg, world, stop: list[str], show: bool) -> tuple[str, Stats]:
    """Generate, printing the text as it comes on rank 0 when `show`; the text (cut before the
    first --stop string) and the last chunk's running totals."""
    stats, text = Stats(), []
    cut = StopStrings(stop)  # (every rank decodes the same text, so all stop at one chunk)
    for chunk in stream_generate(session, ids, cfg):
        stats = chunk.stats
        piece, hit = cut.feed(chunk.text)
        if stats.finish and not hit:
            piece += cut.flush()
        text.append(piece)
        world.heartbeat()
        if world.is_main and show:  # only rank 0 prints
            sys.stdout.write(piece)
            sys.stdout.flush()
        if hit:
            stats.finish = "stop"
            break
    return "".join(text), stats


def json_result(text: str, stats: Stats, cfg, runner, world) -> dict:
    """--json's object: the text, what ran, the stats and the drafter it ran with."""
    ran = runner if cfg.uses_drafter else None
    return {
        "text": text,
        "mode": cfg.mode,
        "budget": cfg.budget,
        "lookup": cfg.lookup,
        "configuration": describe(cfg, runner),
        **stats.to_dict(),
        "drafter": None if ran is None else {**ran.cfg.describe(), "block_used": ran.block_size},
        "lookup_corpus": cfg.lookup_corpus or None,
        "world_size": world.size,
        "host_decisions": {"broadcasts": world.collectives, "bytes": world.bytes_agreed},
    }


def generate_command(
    prompt: str = PROMPT_TEXT,
    prefill_response: str = PREFILL_RESPONSE,
    prompt_file: str = PROMPT_FILE,
    model: str = opts.MODEL,
    drafter: str = opts.DRAFTER,
    chat_template: bool = opts.CHAT_TEMPLATE,
    system: str = opts.SYSTEM,
    thinking: bool = opts.THINKING,
    prefill_step_size: int = opts.PREFILL,
    max_kv_size: int = opts.MAX_KV_SIZE,
    kv_bits: int = opts.KV_BITS,
    kv_group_size: int = opts.KV_GROUP_SIZE,
    quantized_kv_start: int = opts.QUANTIZED_KV_START,
    prompt_cache_file: str = opts.PROMPT_CACHE_FILE,
    mode: str = opts.MODE,
    block_size: int = opts.BLOCK_SIZE,
    budget: str = opts.BUDGET,
    lookup: int = opts.LOOKUP,
    lookup_corpus: str = opts.LOOKUP_CORPUS,
    temp: float = opts.TEMP,
    top_p: float = opts.TOP_P,
    top_k: int = opts.TOP_K,
    min_p: float = opts.MIN_P,
    min_tokens_to_keep: int = opts.MIN_TOKENS_TO_KEEP,
    xtc_probability: float = opts.XTC_PROBABILITY,
    xtc_threshold: float = opts.XTC_THRESHOLD,
    seed: int = opts.SEED,
    json_schema: str = opts.JSON_SCHEMA,
    regex: str = opts.REGEX,
    lark: str = opts.LARK,
    max_tokens: int = MAX_TOKENS,
    extra_eos: list[str] = EXTRA_EOS,
    stop: list[str] = STOP,
    verbose: str = VERBOSE,
    as_json: bool = AS_JSON,
    quiet_stats: bool = NO_STATS,
) -> None:
    """Generate text with DFlash / DDTree speculative decoding (or plain decoding: --mode ar)."""
    prompt = opts.read_prompt(prompt, prompt_file)
    flags = opts.Flags(max_tokens, temp, top_p, top_k, seed, mode, block_size, budget,
                       lookup, lookup_corpus, prefill=prefill_step_size, min_p=min_p,
                       min_keep=min_tokens_to_keep,
                       xtc=(xtc_probability, xtc_threshold))  # fmt: skip
    grammar = opts.grammar_spec(json_schema, regex, lark)
    kv = opts.kv_quantization(kv_bits, kv_group_size, quantized_kv_start)
    flags.config()  # every flag checked before any model loads
    saved, arrays, model, drafter, kv, max_kv_size = opts.read_prompt_cache(
        prompt_cache_file, model, drafter, kv, max_kv_size
    )
    world, target, runner, cfg = opts.load_settled(flags, model, drafter)
    session = Session(target, runner if cfg.uses_drafter else None, kv, max_kv_size)
    if saved is None:
        ids = encode_prompt(target.tokenizer, prompt, chat_template, system, thinking,
                            prefill_response)  # fmt: skip
    else:
        ids = cached_prompt(session, saved, arrays, prompt, system, thinking)
    ends = stop_ids(target.tokenizer) | opts.token_ids(target.tokenizer, extra_eos)
    cfg = dataclasses.replace(cfg, grammar=grammar, stop_ids=ends)
    notes = [opts.context_note(target, len(ids), cfg.max_tokens)]
    if system and not use_template(target.tokenizer, chat_template):
        notes.append("note: without a chat template, --system goes before the prompt as text.")
    for note in notes:
        if note and world.is_main:
            typer.echo(note, err=True)
    text, stats = stream(session, ids, cfg, world, stop, show=not as_json)
    if not world.is_main:
        return
    if as_json:
        print(json.dumps(json_result(text, stats, cfg, runner, world)))
        return
    sys.stdout.write("\n")
    quiet = quiet_stats or str(verbose).lower() in ("false", "0", "no", "off")
    if not quiet:
        print(f"{describe(cfg, runner)} | {stats.line()}", file=sys.stderr)
