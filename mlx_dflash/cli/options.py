"""Flags shared by generate, chat and bench (one definition, one help text), and the engine
settings they make."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import typer

from ..engine import GenerationConfig, SamplingParams
from ..engine.choice import default_mode
from ..engine.session import speculates
from ..errors import DFlashError
from ..prompts import xtc_special_ids

# Help panels (`--help` groups the flags under these titles).
MODEL_PANEL = "Model"
TEMPLATE = "Chat template"
KV_PANEL = "KV cache"
SPECULATION = "Speculation"
SAMPLING = "Sampling"
STRUCTURED = "Structured output"
OUTPUT = "Output"
MODES = ("ddtree", "dflash", "lookup", "ar")


def panel(title: str, *options) -> None:
    """Put these options under one title in `--help` (for commands with many)."""
    for option in options:
        option.rich_help_panel = title


def max_tokens_option(default: int, help: str):
    """--max-tokens (-n): the same flag everywhere, with each command's default and help."""
    return typer.Option(
        default, "--max-tokens", "-n", min=1, metavar="N", help=help, rich_help_panel=OUTPUT
    )


MODEL = typer.Option(
    None,
    "--model",
    "-m",
    metavar="PATH|ID",
    help="Target folder or hub id (default: embedded stories260K).",
)
DRAFTER = typer.Option(
    None,
    "--drafter",
    "-d",
    metavar="PATH|ID",
    help="DFlash drafter folder or hub id (found for known targets).",
)
TEMP = typer.Option(0.0, "--temp", min=0.0, metavar="T", help="0 = greedy.")
TOP_P = typer.Option(1.0, "--top-p", min=0.0, max=1.0, metavar="P")
TOP_K = typer.Option(0, "--top-k", min=0, metavar="K", help="0 = off.")
SEED = typer.Option(None, "--seed", metavar="N")
MIN_P = typer.Option(
    0.0,
    "--min-p",
    min=0.0,
    max=1.0,
    metavar="P",
    help="Drop tokens under P times the top one's probability (0: off).",
    show_default=False,
)
XTC_PROBABILITY = typer.Option(
    0.0, "--xtc-probability", min=0.0, max=1.0, metavar="P",
    help="XTC: how often a draw drops the top choices (0: off).", show_default=False,
)  # fmt: skip
XTC_THRESHOLD = typer.Option(
    0.1, "--xtc-threshold", min=0.0, max=0.5, metavar="P", help="XTC: what counts as a top choice."
)
MIN_TOKENS_TO_KEEP = typer.Option(
    1, "--min-tokens-to-keep", min=1, metavar="N", help="What --min-p keeps at least.", show_default=False,
)  # fmt: skip
MODE = typer.Option(
    None,
    "--mode",
    metavar="[" + "|".join(MODES) + "]",
    help="ddtree: trees + lookup; dflash: z-lab's chain; lookup: no drafter; ar: plain. "
    "Default: ddtree, or what can run here.",
)
BLOCK_SIZE = typer.Option(
    None, "--block-size", metavar="N", help="Draft block, at most the drafter's."
)
BUDGET = typer.Option(
    None,
    "--budget",
    metavar="N|auto",
    help="Tokens verified a round, or auto: sized from the measured verify cost (default).",
)
CHAT_TEMPLATE = typer.Option(
    None, "--chat-template/--no-chat-template", help="Default: when the model has one."
)
PREFILL = typer.Option(
    512, "--prefill-step-size", min=1, metavar="N", help="Prompt tokens a prefill chunk takes."
)
SYSTEM = typer.Option(None, "--system", "--system-prompt", metavar="TEXT", help="System message.")
THINKING = typer.Option(
    None,
    "--thinking/--no-thinking",
    help="Thinking on or off (Qwen3-style templates; default: theirs).",
)
LOOKUP = typer.Option(
    None,
    "--lookup",
    min=0,
    metavar="N",
    help="Up to N tokens copied from earlier text join the tree (the draft under --mode "
    "lookup). Default: 10 (0 under a fixed --budget).",
)
LOOKUP_CORPUS = typer.Option(
    None,
    "--lookup-corpus",
    metavar="FILE|none",
    help="Past answers (JSONL) for lookup (docs/lookup.md); default: the drafter's.",
)
KV_BITS = typer.Option(
    None, "--kv-bits", metavar="BITS", help="Quantize the KV cache to BITS (4 or 8)."
)
MAX_KV_SIZE = typer.Option(
    None, "--max-kv-size", min=5, metavar="N", help="At most N positions (a rotating cache)."
)
KV_GROUP_SIZE = typer.Option(64, "--kv-group-size", metavar="N", help="Group size of --kv-bits.")
QUANTIZED_KV_START = typer.Option(
    5000, "--quantized-kv-start", metavar="N", help="Quantize from N tokens of context on."
)

panel(MODEL_PANEL, MODEL, DRAFTER, PREFILL)
panel(TEMPLATE, CHAT_TEMPLATE, SYSTEM, THINKING)
panel(KV_PANEL, KV_BITS, MAX_KV_SIZE, KV_GROUP_SIZE, QUANTIZED_KV_START)
panel(SPECULATION, MODE, BLOCK_SIZE, BUDGET, LOOKUP, LOOKUP_CORPUS)
panel(SAMPLING, TEMP, TOP_P, TOP_K, SEED, MIN_P, XTC_PROBABILITY, XTC_THRESHOLD, MIN_TOKENS_TO_KEEP)


def kv_quantization(bits: int | None, group_size: int, start: int):
    """--kv-bits and its two companions as the cache takes them (None: a float cache),
    checked before any model loads."""
    from ..models.cache import KVQuantization

    return None if bits is None else KVQuantization(bits, group_size, start)


PROMPT_CACHE_FILE = typer.Option(
    None,
    "--prompt-cache-file",
    metavar="FILE",
    help="Start from a prompt cache (`dflash-mlx cache`, chat's /save).",
)


def read_prompt_cache(path: str | None, model: str | None, drafter: str | None, kv, max_kv):
    """(file metadata, arrays, model, drafter, kv, max_kv): a prompt cache file read, its
    target and drafter taken where none is given (mlx-lm's rule), and its KV settings where
    no --kv-bits / --max-kv-size is given; (None, None, the rest as given) without a file."""
    if path is None:
        return None, None, model, drafter, kv, max_kv
    from ..models.cache import KVQuantization
    from ..prompt_cache import read

    meta, arrays = read(path)
    if model is None:
        model, drafter = meta.model, drafter or meta.drafter
    if kv is None and meta.kv is not None:
        kv = KVQuantization(**meta.kv)
    sizes = [m["max_size"] for m in meta.layers if "max_size" in m]
    if max_kv is None and sizes:
        max_kv = sizes[0]
    return meta, arrays, model, drafter, kv, max_kv


JSON_SCHEMA = typer.Option(
    None, "--json-schema", metavar="FILE", help="The answer is JSON valid under this schema."
)
REGEX = typer.Option(None, "--regex", metavar="REGEX", help="The answer matches this regex.")
LARK = typer.Option(
    None, "--lark", metavar="FILE", help="The answer follows this Lark grammar (llguidance)."
)

panel(KV_PANEL, PROMPT_CACHE_FILE)
panel(STRUCTURED, JSON_SCHEMA, REGEX, LARK)


def grammar_spec(json_schema: str | None, regex: str | None, lark: str | None):
    """The grammar the flags ask for (None: free text), its files read and checked here."""

    from ..engine.grammar import GrammarSpec

    given = [
        (k, v) for k, v in (("json_schema", json_schema), ("regex", regex), ("lark", lark)) if v
    ]
    if not given:
        return None
    if len(given) > 1:
        raise DFlashError("Give one of --json-schema, --regex and --lark, not several.")
    kind, value = given[0]
    if kind == "regex":
        return GrammarSpec("regex", value)
    path = Path(value).expanduser()
    if not path.is_file():
        raise DFlashError(f"{path} does not exist (the --{kind.replace('_', '-')} file).")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise DFlashError(f"{path} cannot be read: {e}.") from None
    return GrammarSpec(kind, text)


@dataclass(frozen=True)
class Flags:
    """The engine flags as typed (None: not given), turned into a GenerationConfig twice:
    checked before any model loads, and final once the pair is loaded and the mode chosen."""

    max_tokens: int
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    mode: str | None = None
    block_size: int | None = None
    budget: str | None = None
    lookup: int | None = None
    corpus: str | None = None
    prefill: int = 512  # --prefill-step-size
    min_p: float = 0.0
    min_keep: int = 1  # --min-tokens-to-keep
    xtc: tuple[float, float] = (0.0, 0.1)  # --xtc-probability, --xtc-threshold

    def config(self, mode: str | None = None) -> GenerationConfig:
        """The settings for `mode` (the typed one, else the default's DDTree), checked; a
        lookup corpus is read and indexed here."""
        from ..engine.corpus import load_corpus

        corpus = "" if self.corpus == "none" else self.corpus  # "": none, not the drafter's
        cfg = GenerationConfig(
            max_tokens=self.max_tokens,
            sampling=SamplingParams(
                self.temp, self.top_p, self.top_k, self.min_p, self.min_keep, *self.xtc
            ),
            seed=self.seed,
            mode=mode or self.mode or "ddtree",
            block_size=self.block_size,
            budget=self.budget,
            lookup=self.lookup,
            lookup_corpus=corpus,
            prefill_chunk=self.prefill,
        )
        if corpus:
            load_corpus(corpus)
        return cfg

    def settle(self, target, runner, model: str | None) -> tuple[GenerationConfig, str | None]:
        """The final settings for the loaded pair, and a line to tell the user where the
        default chose other than DDTree (engine/choice.py)."""
        choice = default_mode(target, runner, model) if self.mode is None else None
        flags = self
        if choice and not speculates(choice.mode):  # nothing drafts: no speculation flag applies
            flags = dataclasses.replace(self, budget=None, lookup=None, corpus=None)
        cfg = default_corpus(flags.config(choice and choice.mode), runner)
        return xtc_special(cfg, target), choice and choice.note


def xtc_special(cfg: GenerationConfig, target) -> GenerationConfig:
    """XTC never excludes a newline or an end of text (mlx-lm's special tokens for it)."""
    if not cfg.sampling.xtc_probability:
        return cfg
    special = xtc_special_ids(target.tokenizer)
    return dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, xtc_special=special))


def load_settled(flags: Flags, model, drafter):
    """(world, target, drafter runner, final settings): the process group (several ranks under
    mlx.launch: a sharded target), the flags checked before any model loads, the pair loaded,
    the default chosen (engine/choice.py) and any notes said once on stderr."""
    from .. import distributed
    from ..models.pair import load_pair

    world = distributed.init()
    flags.config()
    target, runner = load_pair(model, drafter, flags.mode, world)
    cfg, note = flags.settle(target, runner, model)
    if world.is_main:
        if note:
            typer.echo(f"note: {note}", err=True)
        if slow := slow_verify_note(target, model, cfg.mode, cfg.budget):
            typer.echo(slow, err=True)
    return world, target, runner, cfg


def default_corpus(cfg: GenerationConfig, runner) -> GenerationConfig:
    """The drafter's own lookup corpus (the answers of the target it was trained on, as the
    shipped drafters carry them), where lookup runs and no --lookup-corpus was given; read
    and indexed here, as a given one is, so a damaged file stops before any output."""
    from ..engine.corpus import load_corpus

    path = None if runner is None else runner.corpus_file
    if not cfg.lookup or cfg.lookup_corpus is not None or path is None:
        return cfg
    load_corpus(path)
    return dataclasses.replace(cfg, lookup_corpus=path)


def slow_verify_note(target, model: str | None, mode: str, budget=None) -> str | None:
    """One line for a quantized or half-precision target on the CPU in a speculative mode:
    there MLX's own matmul kernels cost about linearly in the rows a forward carries (4-bit
    SmolLM2's dense layers: 30 ms at 1 row, 552 at 16), so every verify loses to plain steps;
    float32 weights go to BLAS, where 16 rows cost ~1.3 of one. Under --budget auto it says
    that the engine decodes plainly (engine/loop.py). None where it does not apply."""
    from ..engine.budget import PROBE_TOKENS, speculation_pays, verify_steps
    from ..engine.device import on_cpu
    from ..models.padding import blas_weights

    if not speculates(mode) or not on_cpu() or target.stage is not None:
        return None
    if blas_weights(target):
        return None
    name = model or "the target"
    fix = (
        f"A float32 copy speculates fast: dflash-mlx convert {name} --out {name}-f32 "
        "--dequantize --dtype float32"
    )
    if str(budget) == "auto" and not speculation_pays(target):
        return (
            f"note: --budget auto decodes plainly: {name} is quantized or half precision, and "
            f"on this CPU a verify of {PROBE_TOKENS} tokens costs {verify_steps(target):.1f} "
            f"plain steps (measured), so no draft can pay (a fixed --budget speculates anyway). "
            + fix
        )
    return (
        f"note: {name} is quantized or half precision, which on the CPU makes every verify "
        "cost about as many plain steps as it has tokens: speculative modes run slower than "
        f"--mode ar here. " + fix
    )


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt from --prompt (text, or '-': stdin) or --prompt-file, exactly one of them."""
    if (prompt is None) == (prompt_file is None):
        raise DFlashError("Give the prompt with --prompt or --prompt-file (one of them).")
    if prompt_file is not None:
        try:
            return Path(prompt_file).read_text()
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or e
            raise DFlashError(f"Cannot read the prompt file {prompt_file}: {why}.") from None
    return sys.stdin.read() if prompt == "-" else str(prompt)


def token_ids(tokenizer, tokens: list[str]) -> frozenset[int]:
    """--extra-eos-token: each a token's text or its id, as mlx-lm reads them."""
    ids = set()
    for token in tokens:
        tid = int(token) if token.strip().isdigit() else tokenizer.convert_tokens_to_ids(token)
        unk = getattr(tokenizer, "unk_token_id", None)
        if tid is None or (tid == unk and token != getattr(tokenizer, "unk_token", None)):
            raise DFlashError(f"'{token}' is not a token of this model (--extra-eos-token).")
        ids.add(int(tid))
    return frozenset(ids)


def context_note(target, prompt_tokens: int, max_tokens: int) -> str | None:
    """One line where the prompt and --max-tokens together pass the model's context
    (max_position_embeddings): what it writes past it is not what it was trained for."""
    context = int(target.text_config.get("max_position_embeddings") or 0)
    if not context or prompt_tokens + max_tokens <= context:
        return None
    return (
        f"note: the prompt ({prompt_tokens} tokens) and --max-tokens {max_tokens} pass this "
        f"model's context of {context} tokens; text past it may degrade."
    )
