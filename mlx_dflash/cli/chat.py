"""`dflash-mlx chat`: a multi-turn terminal chat on the speculative engine (the conversation
itself is mlx_dflash.conversation). When stdin is not a terminal the loop is plain and
line-oriented (one message or command per line, answers on stdout, notices and stats on
stderr), so conversations can be scripted and tested.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from ..conversation import Conversation
from ..engine.choice import describe
from ..prompts import stop_ids
from . import options as opts

COMMANDS = {
    "/system TEXT": "set the system message (just /system clears it)",
    "/reset": "forget the conversation (the system message stays)",
    "/stats": "totals for this session",
    "/save FILE": "save the conversation and its caches (chat or generate --prompt-cache-file)",
    "/help": "this list",
    "/exit": "quit (also /quit or Ctrl-D)",
    "line\\": "a line ending in a backslash goes on on the next (a paste is one message)",
}


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


def join_message(first: str, pending: Callable[[], str | None], more: Callable[[], str]) -> str:
    """One message from a terminal: a paste's lines (already waiting: `pending`) join the
    first, and a line ending in a backslash asks for the next (`more`)."""
    lines = [first]
    while True:
        if lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1]
            nxt: str | None = more()
        else:
            nxt = pending()
        if nxt is None:
            return "\n".join(lines)
        lines.append(nxt)


def _pasted_line() -> str | None:
    """The next line if it is already waiting on stdin (the rest of a paste), else None."""
    import select

    return PlainIO().read() if select.select([sys.stdin], [], [], 0.03)[0] else None


class WordWrap:
    """Streamed text broken at spaces, never inside a word, for a terminal `width` wide: a
    word is held until it is whole (the next space, or `flush` at the answer's end)."""

    def __init__(self, width: int):
        self.width, self.col, self.word = max(width, 20), 0, ""

    def feed(self, text: str) -> str:
        out = []
        for ch in text:
            if not ch.isspace():
                self.word += ch
                continue
            out.append(self._word())
            if ch == "\n":
                out.append("\n")
                self.col = 0
            elif self.col < self.width:  # a space at the line's end is the line break
                out.append(ch)
                self.col += 1
        return "".join(out)

    def _word(self) -> str:
        word, self.word = self.word, ""
        if not word:
            return ""
        if self.col and self.col + len(word) > self.width:
            self.col = len(word)
            return "\n" + word
        self.col += len(word)
        return word

    def flush(self) -> str:
        out = self._word()
        self.col = 0
        return out


class RichIO:
    """A terminal: a coloured prompt, line editing, streamed answers (broken between words),
    dim stats."""

    def __init__(self):
        from rich.console import Console

        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
        self.console = Console(highlight=False)
        self.wrap = WordWrap(self.console.width)

    def read(self) -> str | None:
        while True:
            try:
                first = self.console.input("[bold green]>>> [/]")
                return join_message(first, _pasted_line, lambda: self.console.input("... "))
            except EOFError:
                self.console.print()
                return None
            except KeyboardInterrupt:
                self.console.print("\n[dim](/exit or Ctrl-D quits)[/]")

    def write(self, text: str) -> None:
        text = self.wrap.feed(text)
        if text:
            self.console.print(text, end="", markup=False, style="cyan", soft_wrap=True)

    def end_answer(self, line: str) -> None:
        rest = self.wrap.flush()
        self.console.print(rest, markup=False, style="cyan", soft_wrap=True)
        self.console.print(f"[dim]{line}[/]")

    def info(self, text: str) -> None:
        self.console.print(text, markup=False)

    def notice(self, text: str) -> None:
        self.console.print(f"[yellow]{text}[/]")


class SharedIO:
    """Rank 0 reads and writes, every rank gets its lines and follows its Ctrl-C, so all ranks
    of a sharded target (mlx.launch) run the same turns; on one process, the io itself."""

    def __init__(self, io, world):
        self.io, self.world = io, world
        # What goes out: the io's own on rank 0, nothing on the other ranks.
        out = (io.write, io.end_answer, io.info, io.notice)
        self.write, self.end_answer, self.info, self.notice = (
            out if world.is_main else (lambda text: None,) * 4
        )

    def read(self) -> str | None:
        with self.world.idle():
            line = self.io.read() if self.world.is_main else None
            return self.world.send_text(line)

    def stopped(self, local: Callable[[], bool]) -> Callable[[], bool]:
        return lambda: bool(self.world.agree([local()])[0])


def save(chat: Conversation, io, path: str, model: str | None) -> None:
    """/save FILE: the conversation and its caches; a bad path is one line, the chat goes on."""
    from ..errors import DFlashError
    from ..paths import DEFAULT_TARGET

    if not path:
        io.info("Give a file: /save FILE.safetensors")
        return
    try:
        n = chat.save(Path(path).expanduser(), model or str(DEFAULT_TARGET))
    except DFlashError as e:
        io.info(f"Not saved: {e}")
        return
    io.info(f"Saved {len(chat.messages)} messages, {n} tokens cached, to {path}.")


def run_chat(chat: Conversation, io, model: str | None = None) -> None:
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
            elif cmd == "/save":
                save(chat, io, arg.strip(), model)
            elif cmd == "/help":
                io.info("\n".join(f"{k:<14} {v}" for k, v in COMMANDS.items()))
            else:
                io.info(f"Unknown command {cmd}; /help lists them.")
            continue
        with stop_on_ctrl_c() as stopped:
            _, stats = chat.turn(text, io.write, io.stopped(stopped))
        io.end_answer(chat.turn_line(stats))


def banner(model: str | None, runner, cfg) -> str:
    """What the chat runs: the model, the drafter that drafts for it, and the configuration."""
    name = model or "stories260K (the embedded pair)"
    folder = runner.drafter.folder if runner is not None and cfg.uses_drafter else None
    drafts = f" + drafter {Path(folder).name}" if folder is not None else ""
    return f"dflash-mlx chat: {name}{drafts} ({describe(cfg, runner)})"


def chat_command(
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
    max_tokens: int = opts.max_tokens_option(512, "Per answer."),
) -> None:
    """Chat with a model in the terminal (/help for commands); scriptable through stdin."""
    flags = opts.Flags(max_tokens, temp, top_p, top_k, seed, mode, block_size, budget,
                       lookup, lookup_corpus, prefill=prefill_step_size, min_p=min_p,
                       min_keep=min_tokens_to_keep,
                       xtc=(xtc_probability, xtc_threshold))  # fmt: skip
    kv = opts.kv_quantization(kv_bits, kv_group_size, quantized_kv_start)
    saved, arrays, model, drafter, kv, max_kv_size = opts.read_prompt_cache(
        prompt_cache_file, model, drafter, kv, max_kv_size
    )
    world, target, runner, cfg = opts.load_settled(flags, model, drafter)
    cfg = dataclasses.replace(cfg, stop_ids=stop_ids(target.tokenizer))
    chat = Conversation(target, runner, cfg, system, chat_template, thinking, kv, max_kv_size)
    if saved is not None:
        chat.resume(saved, arrays)
    io = SharedIO(RichIO() if sys.stdin.isatty() and sys.stdout.isatty() else PlainIO(), world)
    if isinstance(io.io, RichIO):
        io.notice(f"{banner(model, runner, cfg)} - /help for commands, /exit to quit")
    if not chat.templated:
        io.notice("This model has no chat template: turns are joined as plain text.")
    if saved is not None:
        io.notice(f"Resumed {len(chat.messages)} messages ({len(saved.tokens)} tokens cached).")
    run_chat(chat, io, model)
