"""`dflash-mlx generate`, and the text-streaming generator every command builds on."""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import typer

from .engine import MODES, GenerationConfig, Round, Session, generate_rounds
from .errors import DFlashError
from .sampling import SamplingParams

ASSETS = Path(__file__).parent / "assets"
DEFAULT_TARGET = ASSETS / "stories260K"
DEFAULT_DRAFTER = ASSETS / "stories260K-dflash"


@dataclass
class Stats:
    """Aggregates rounds into what users look at: speeds, tau and its histogram, time split."""

    prompt_tokens: int = 0
    t_prefill: float = 0.0
    tokens: int = 0
    t_draft: float = 0.0
    t_verify: float = 0.0
    t_other: float = 0.0
    taus: list[int] = field(default_factory=list)
    draft_rounds: int = 0  # rounds that ran the drafter (auto's pauses and plain steps do not)
    finish: str | None = None

    def add(self, r: Round) -> None:
        if r.prefill:
            self.prompt_tokens += r.prefill_tokens
            self.t_prefill += r.t_prefill
            self.t_other += r.t_other  # sampling the first token
        else:
            self.taus.append(r.accepted)
            self.draft_rounds += r.t_draft > 0
            self.t_draft += r.t_draft
            self.t_verify += r.t_verify
            self.t_other += r.t_other
        self.tokens += len(r.tokens)
        self.finish = r.finished or self.finish

    @property
    def t_decode(self) -> float:
        return self.t_draft + self.t_verify + self.t_other

    @property
    def mean_tau(self) -> float:
        return sum(self.taus) / len(self.taus) if self.taus else 0.0

    @property
    def histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.taus).items()))

    def to_dict(self) -> dict:
        gen_tps = (
            (self.tokens - 1) / self.t_decode if self.t_decode > 0 and self.tokens > 1 else 0.0
        )
        return {
            "prompt_tokens": self.prompt_tokens,
            "prompt_tps": self.prompt_tokens / self.t_prefill if self.t_prefill else 0.0,
            "generated_tokens": self.tokens,
            "generation_tps": gen_tps,
            "rounds": len(self.taus),
            "draft_rounds": self.draft_rounds,
            "mean_tau": self.mean_tau,
            "tau_histogram": self.histogram,
            # Round by round, to compare with other implementations (the last rounds draft
            # no further than the remaining token budget, so they may be shorter).
            "acceptance_lengths": list(self.taus),
            "time_draft_s": self.t_draft,
            "time_verify_s": self.t_verify,
            "time_other_s": self.t_other,
            "time_prefill_s": self.t_prefill,
            "finish_reason": self.finish,
        }

    def line(self) -> str:
        d = self.to_dict()
        total = self.t_decode or 1.0
        hist = " ".join(f"{k}:{v}" for k, v in d["tau_histogram"].items())
        return (
            f"prompt {d['prompt_tokens']} tok @ {d['prompt_tps']:.1f} tok/s | "
            f"gen {d['generated_tokens']} tok @ {d['generation_tps']:.1f} tok/s | "
            f"tau {d['mean_tau']:.2f} [{hist}] | "
            f"draft {100 * self.t_draft / total:.0f}% verify {100 * self.t_verify / total:.0f}% "
            f"other {100 * self.t_other / total:.0f}%"
        )


@dataclass
class Chunk:
    text: str
    tokens: list[int]
    round: Round


def stop_ids(tokenizer) -> frozenset[int]:
    ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def stream_generate(session: Session, prompt: list[int], cfg: GenerationConfig) -> Iterator[Chunk]:
    """Decode rounds into text as tokens are accepted (stop tokens are not printed)."""
    detok = session.target.tokenizer.detokenizer
    detok.reset()
    for rnd in generate_rounds(session, prompt, cfg):
        for t in rnd.tokens:
            if t not in cfg.stop_ids:
                detok.add_token(t)
        if rnd.finished:
            detok.finalize()
        yield Chunk(detok.last_segment, rnd.tokens, rnd)


def encode_prompt(tokenizer, prompt: str, chat: bool | None, system: str | None) -> list[int]:
    """Token ids for a prompt, through the chat template when the model has one."""
    if not prompt.strip():
        raise DFlashError("The prompt is empty.")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    use_chat = has_template if chat is None else chat
    if use_chat and not has_template:
        raise DFlashError("This model has no chat template; drop --chat-template.")
    if use_chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict):
            ids = ids["input_ids"]
        return list(ids)
    ids = tokenizer.encode(prompt)
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and (not ids or ids[0] != bos) and _adds_bos(tokenizer):
        ids = [bos, *ids]
    return list(ids)


def _adds_bos(tokenizer) -> bool:
    return bool(getattr(tokenizer, "add_bos_token", False))


def load_pair(model: str | None, drafter: str | None, mode: str = "dflash"):
    """Target and drafter from folders or hub ids (the embedded default pair when neither is
    given); a known target finds its published drafter without --drafter."""
    from .drafter import DrafterRunner, load_drafter
    from .resolve import resolve_model
    from .target import load_target

    if model is None:
        model = str(DEFAULT_TARGET)
        drafter = drafter or str(DEFAULT_DRAFTER)
    target_path = resolve_model(model, "target")
    target = load_target(target_path)
    if mode == "ar" and drafter is None:
        return target, None
    if drafter is None:
        from .registry import find_drafter

        drafter = find_drafter(model)
    drafter_path = resolve_model(drafter, "drafter", target=target_path)
    draft_model = load_drafter(drafter_path, target_config=target.config)
    target.set_taps(draft_model.cfg.target_layer_ids)
    return target, DrafterRunner(draft_model, target)


# Flags shared by generate and chat (one definition, one help text).
MODEL = typer.Option(
    None, "--model", "-m", help="Target folder or hub id (default: embedded stories260K)."
)
DRAFTER = typer.Option(
    None, "--drafter", "-d", help="DFlash drafter folder or hub id (found for known targets)."
)
TEMP = typer.Option(0.0, "--temp", min=0.0, help="0 = greedy.")
TOP_P = typer.Option(1.0, "--top-p", min=0.0, max=1.0)
TOP_K = typer.Option(0, "--top-k", min=0)
SEED = typer.Option(None, "--seed")
MODE = typer.Option("dflash", "--mode", help="dflash | ddtree | ar")
BLOCK_SIZE = typer.Option(None, "--block-size", help="At most the drafter's.")
BUDGET = typer.Option("16", "--budget", help="DDTree node budget, or 'auto'.")
CHAT_TEMPLATE = typer.Option(
    None, "--chat-template/--no-chat-template", help="Default: use it when the model has one."
)
SYSTEM = typer.Option(None, "--system", help="System message (chat template).")


def generate_command(
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text, or '-' to read stdin."),
    model: str = MODEL,
    drafter: str = DRAFTER,
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", min=1),
    temp: float = TEMP,
    top_p: float = TOP_P,
    top_k: int = TOP_K,
    seed: int = SEED,
    mode: str = MODE,
    block_size: int = BLOCK_SIZE,
    budget: str = BUDGET,
    chat_template: bool = CHAT_TEMPLATE,
    system: str = SYSTEM,
    as_json: bool = typer.Option(False, "--json", help="Print text and stats as one JSON object."),
    quiet_stats: bool = typer.Option(False, "--no-stats", help="Do not print the stats line."),
) -> None:
    """Generate text with DFlash / DDTree speculative decoding (or plain decoding: --mode ar)."""
    if prompt == "-":
        prompt = sys.stdin.read()
    check_mode(mode)
    target, runner = load_pair(model, drafter, mode)
    ids = encode_prompt(target.tokenizer, prompt, chat_template, system)
    cfg = generation_config(target, max_tokens, temp, top_p, top_k, seed, mode, block_size, budget)
    session = Session(target, runner if mode != "ar" else None)
    stats, text = Stats(), []
    for chunk in stream_generate(session, ids, cfg):
        stats.add(chunk.round)
        text.append(chunk.text)
        if not as_json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    if as_json:
        print(json.dumps({"text": "".join(text), "mode": mode, **stats.to_dict()}))
        return
    sys.stdout.write("\n")
    if not quiet_stats:
        print(stats.line(), file=sys.stderr)


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise DFlashError(f"Unknown mode '{mode}' (choose dflash, ddtree or ar).")


def generation_config(
    target, max_tokens, temp, top_p, top_k, seed, mode, block_size, budget
) -> GenerationConfig:
    """The engine settings behind the flags that generate, chat and bench share."""
    return GenerationConfig(
        max_tokens=max_tokens,
        sampling=SamplingParams(temp, top_p, top_k),
        seed=seed,
        mode=mode,
        block_size=block_size,
        budget=parse_budget(budget),
        stop_ids=stop_ids(target.tokenizer),
    )


def parse_budget(budget: str | int) -> int | str:
    if budget == "auto":
        return "auto"
    try:
        b = int(budget)
    except (TypeError, ValueError):
        raise DFlashError(
            f"--budget must be a positive integer or 'auto', not '{budget}'."
        ) from None
    if b < 1:
        raise DFlashError(f"--budget must be at least 1, not {b}.")
    return b
