"""`dflash-mlx chat`: a multi-turn terminal chat on the speculative engine.

Every turn renders the whole history with the model's chat template and hands it to one
long-lived Session, whose `rewind` keeps the longest cached token prefix: only the new text of a
turn is prefilled, with no bookkeeping here about what the cache holds. When stdin is not a
terminal the loop is plain and line-oriented (one message or command per line, answers on
stdout, notices and stats on stderr), so conversations can be scripted and tested.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator

import typer

from . import generate as opts
from .engine import GenerationConfig, Session
from .errors import DFlashError
from .generate import Stats, check_mode, generation_config, load_pair, stream_generate

COMMANDS = {
    "/system TEXT": "set the system message (just /system clears it)",
    "/reset": "forget the conversation (the system message stays)",
    "/stats": "totals for this session",
    "/help": "this list",
    "/exit": "quit (also /quit or Ctrl-D)",
}


class Chat:
    """A conversation: messages, the Session whose cache outlives turns, and running totals."""

    def __init__(
        self,
        target,
        runner,
        cfg: GenerationConfig,
        system: str | None = None,
        chat_template: bool | None = None,
    ):
        self.tokenizer = target.tokenizer
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        if chat_template and not has_template:
            raise DFlashError("This model has no chat template; drop --chat-template.")
        self.templated = has_template if chat_template is None else chat_template
        self.cfg = cfg
        self.session = Session(target, runner if cfg.mode != "ar" else None)
        self.system = system or None
        self.messages: list[dict[str, str]] = []
        self.total = Stats()
        self.turns = 0
        self.last_prompt_tokens = 0  # length of the last rendered conversation

    def render(self, user: str) -> list[int]:
        """Token ids of the whole conversation plus `user`, ready for the answer."""
        if self.templated:
            msgs = [{"role": "system", "content": self.system}] if self.system else []
            msgs += [*self.messages, {"role": "user", "content": user}]
            ids = self.tokenizer.apply_chat_template(
                msgs, add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict):
                ids = ids["input_ids"]
            return list(ids)
        # A plain model continues text: each answer follows its message directly, turns are
        # separated by a newline, so the cached tokens of earlier turns stay a prefix.
        text = f"{self.system}\n\n" if self.system else ""
        for m in self.messages:
            text += m["content"] + ("\n" if m["role"] == "assistant" else "")
        text += user
        ids = self.tokenizer.encode(text)
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if bos is not None and getattr(self.tokenizer, "add_bos_token", False):
            if not ids or ids[0] != bos:
                ids = [bos, *ids]
        return list(ids)

    def turn(
        self,
        user: str,
        write: Callable[[str], None] = lambda s: None,
        stopped: Callable[[], bool] = lambda: False,
    ) -> tuple[str, Stats]:
        """Answer one message, streaming text to `write`; `stopped()` or Ctrl-C ends it early.

        An interrupted answer is kept (as far as it got) in the history, and the session stays
        usable: its caches always hold a consistent prefix of what was decided.
        """
        ids = self.render(user)
        self.last_prompt_tokens = len(ids)
        stats, tokens, printed = Stats(), [], []
        gen = stream_generate(self.session, ids, self.cfg)
        try:
            for chunk in gen:
                stats.add(chunk.round)
                tokens += chunk.tokens
                printed.append(chunk.text)
                write(chunk.text)
                if stopped() and not stats.finish:
                    stats.finish = "interrupted"
                    break
        except KeyboardInterrupt:
            stats.finish = "interrupted"
        finally:
            gen.close()
        answer = self.tokenizer.decode([t for t in tokens if t not in self.cfg.stop_ids])
        shown = "".join(printed)
        if answer.startswith(shown) and len(answer) > len(shown):
            write(answer[len(shown) :])  # the detokenizer's held-back tail after a stop
        self.messages += [
            {"role": "user", "content": user},
            {"role": "assistant", "content": answer},
        ]
        self.turns += 1
        for name in ("prompt_tokens", "t_prefill", "tokens", "t_draft", "t_verify", "t_other"):
            setattr(self.total, name, getattr(self.total, name) + getattr(stats, name))
        self.total.taus += stats.taus
        return answer, stats

    def reset(self) -> None:
        self.messages = []

    def turn_line(self, stats: Stats) -> str:
        """The short line after each answer."""
        d = stats.to_dict()
        reused = self.last_prompt_tokens - stats.prompt_tokens
        line = (
            f"{d['generated_tokens']} tok @ {d['generation_tps']:.1f} tok/s | "
            f"tau {d['mean_tau']:.2f} | "
            f"prefill {stats.prompt_tokens} new of {self.last_prompt_tokens} ({reused} cached)"
        )
        return line + (" | interrupted" if stats.finish == "interrupted" else "")

    def stats_text(self) -> str:
        s = self.total
        d = s.to_dict()
        dec = s.t_decode or 1.0
        hist = " ".join(f"{k}:{v}" for k, v in d["tau_histogram"].items()) or "-"
        tps = max(s.tokens - self.turns, 0) / s.t_decode if s.t_decode else 0.0
        return "\n".join(
            [
                f"turns {self.turns} | messages in history {len(self.messages)} | "
                f"context {len(self.session.tokens)} tokens cached",
                f"generated {s.tokens} tok @ {tps:.1f} tok/s | mean tau {d['mean_tau']:.2f} "
                f"[{hist}]",
                f"prefilled {s.prompt_tokens} tok in {s.t_prefill:.2f} s | "
                f"draft {100 * s.t_draft / dec:.0f}% verify {100 * s.t_verify / dec:.0f}% "
                f"other {100 * s.t_other / dec:.0f}%",
                f"mode {self.cfg.mode} | system {self.system!r}",
            ]
        )


@contextlib.contextmanager
def stop_on_ctrl_c() -> Iterator[Callable[[], bool]]:
    """While answering, a first Ctrl-C asks to stop after the current round (the caches stay
    consistent); a second one interrupts at once."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    state = {"stop": False}

    def handler(signum, frame):
        if state["stop"]:
            raise KeyboardInterrupt
        state["stop"] = True

    old = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: state["stop"]
    finally:
        signal.signal(signal.SIGINT, old)


class PlainIO:
    """Scripted use: lines in, answers out, no prompts or colours."""

    def read(self) -> str | None:
        line = sys.stdin.readline()
        return None if line == "" else line.rstrip("\n")

    def write(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def end_answer(self, line: str) -> None:
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(line, file=sys.stderr)

    def info(self, text: str) -> None:
        print(text)

    def notice(self, text: str) -> None:
        print(text, file=sys.stderr)


class RichIO:
    """A terminal: a coloured prompt, line editing, streamed answers, dim stats."""

    def __init__(self):
        from rich.console import Console

        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
        self.console = Console(highlight=False)

    def read(self) -> str | None:
        while True:
            try:
                return self.console.input("[bold green]>>> [/]")
            except EOFError:
                self.console.print()
                return None
            except KeyboardInterrupt:
                self.console.print("\n[dim](/exit or Ctrl-D quits)[/]")

    def write(self, text: str) -> None:
        self.console.print(text, end="", markup=False, style="cyan", soft_wrap=True)

    def end_answer(self, line: str) -> None:
        self.console.print()
        self.console.print(f"[dim]{line}[/]")

    def info(self, text: str) -> None:
        self.console.print(text, markup=False)

    def notice(self, text: str) -> None:
        self.console.print(f"[yellow]{text}[/]")


def run_chat(chat: Chat, io) -> None:
    """The read-answer loop shared by terminals and scripts."""
    while True:
        line = io.read()
        if line is None:
            return
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            cmd, _, arg = text.partition(" ")
            if cmd in ("/exit", "/quit"):
                return
            if cmd == "/reset":
                chat.reset()
                io.info("Conversation reset.")
            elif cmd == "/stats":
                io.info(chat.stats_text())
            elif cmd == "/system":
                chat.system = arg.strip() or None
                io.info(f"System message set: {chat.system}" if chat.system else "System cleared.")
            elif cmd == "/help":
                io.info("\n".join(f"{k:<14} {v}" for k, v in COMMANDS.items()))
            else:
                io.info(f"Unknown command {cmd}; /help lists them.")
            continue
        with stop_on_ctrl_c() as stopped:
            _, stats = chat.turn(text, io.write, stopped)
        io.end_answer(chat.turn_line(stats))


def chat_command(
    model: str = opts.MODEL,
    drafter: str = opts.DRAFTER,
    max_tokens: int = typer.Option(512, "--max-tokens", "-n", min=1, help="Per answer."),
    temp: float = opts.TEMP,
    top_p: float = opts.TOP_P,
    top_k: int = opts.TOP_K,
    seed: int = opts.SEED,
    mode: str = opts.MODE,
    block_size: int = opts.BLOCK_SIZE,
    budget: str = opts.BUDGET,
    chat_template: bool = opts.CHAT_TEMPLATE,
    system: str = opts.SYSTEM,
) -> None:
    """Chat with a model in the terminal (/help for commands); scriptable through stdin."""
    check_mode(mode)
    target, runner = load_pair(model, drafter, mode)
    cfg = generation_config(target, max_tokens, temp, top_p, top_k, seed, mode, block_size, budget)
    chat = Chat(target, runner, cfg, system, chat_template)
    io = RichIO() if sys.stdin.isatty() and sys.stdout.isatty() else PlainIO()
    if isinstance(io, RichIO):
        io.notice(f"dflash-mlx chat ({mode}) - /help for commands, /exit to quit")
    if not chat.templated:
        io.notice("This model has no chat template: turns are joined as plain text.")
    run_chat(chat, io)
