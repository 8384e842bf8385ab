"""Streamed text, cut where the client wants: stop strings, the thinking split and tool calls
(AnswerText: a job's text on its way out as events).

Both work on text as it arrives in pieces, holding back only what could still turn out to be
the start of a stop string or of a `<think>` / `</think>` tag.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .events import Text, ToolCalls
from .tools import parse_call

if TYPE_CHECKING:
    from .worker import Job

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def _hold(buf: str, patterns: list[str]) -> tuple[str, str]:
    """`buf` split before its longest end that begins one of `patterns` (not all of it): what
    is safe to send, and what is held back."""
    best = 0
    for p in patterns:
        for k in range(min(len(p) - 1, len(buf)), best, -1):
            if p.startswith(buf[-k:]):
                best = k
                break
    return buf[: len(buf) - best], buf[len(buf) - best :]


class StopStrings:
    """feed(text) -> (text safe to send, the stop string hit or None)."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        if not self.stops:
            return text, None
        self.buf += text
        hits = [(self.buf.find(s), s) for s in self.stops if s in self.buf]
        if hits:
            i, s = min(hits)
            out, self.buf = self.buf[:i], ""
            return out, s
        out, self.buf = _hold(self.buf, self.stops)
        return out, None

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


def thinking_tags(tokenizer) -> tuple[str, str] | None:
    """The model's thinking tags: mlx-lm's reading of the vocabulary (<think>, and the other
    formats it knows), else <think> if the chat template writes it; None: not a thinking model."""
    if getattr(tokenizer, "has_thinking", False):
        return tokenizer.think_start, tokenizer.think_end
    if THINK_OPEN in str(getattr(tokenizer, "chat_template", None) or ""):
        return THINK_OPEN, THINK_CLOSE
    return None


def prompt_opens_thinking(prompt_text: str, tags=(THINK_OPEN, THINK_CLOSE)) -> bool:
    """The rendered prompt ends inside a thinking block (Qwen3.5-style templates write
    `<think>` into the generation prompt; the model then only closes it)."""
    return prompt_text.rfind(tags[0]) > prompt_text.rfind(tags[1])


class ThinkingSplitter:
    """feed(text) -> (reasoning, content): what is inside <think>...</think> and what is not.

    `thinking`: the answer starts inside a thinking block. A `<think>` opening the answer
    starts one too (Qwen3 writes it itself). The newlines around the tags are dropped.
    """

    def __init__(self, thinking: bool = False, tags=(THINK_OPEN, THINK_CLOSE)):
        self.open, self.close = tags
        self.thinking = thinking
        self.started = thinking  # a <think> is only honoured at the start of the answer
        self.buf = ""
        self.strip = True  # drop newlines that open a section

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        while self.buf:
            if self.strip:
                self.buf = self.buf.lstrip("\n")
                if not self.buf:
                    break
            if not self.thinking and not self.started:
                if self.open.startswith(self.buf) and self.buf != self.open:
                    break  # could still become <think>
                self.started = True
                if self.buf.startswith(self.open):
                    self.buf = self.buf[len(self.open) :]
                    self.thinking, self.strip = True, True
                    continue
            if not self.thinking:
                content += self.buf
                self.buf, self.strip = "", False
                break
            i = self.buf.find(self.close)
            if i >= 0:
                reasoning += self.buf[:i].rstrip("\n") if i else ""
                self.buf = self.buf[i + len(self.close) :]
                self.thinking, self.strip = False, True
                continue
            safe, self.buf = _hold(self.buf, [self.close])
            reasoning += safe
            self.strip = False
            break
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        out, self.buf = self.buf, ""
        return (out, "") if self.thinking else ("", out)


class ToolCallSplitter:
    """feed(text) -> [(kind, text)], in order: "text" outside tool calls, and "call" for the
    text of each call completed in it (between the model's start and end markers, dropped).

    `inside`: the answer starts inside a call (a forced tool_choice wrote the start marker,
    and maybe more, into the prompt): that text begins the first call.
    """

    def __init__(self, start: str, end: str, inside: str | None = None):
        self.start, self.end = start, end
        self.calling = inside is not None
        self.buf = inside or ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        while self.buf:
            if self.calling:
                i = self.buf.find(self.end)
                if i < 0:
                    break
                out.append(("call", self.buf[:i]))
                self.buf, self.calling = self.buf[i + len(self.end) :], False
                continue
            i = self.buf.find(self.start)
            if i >= 0:
                out.append(("text", self.buf[:i]))
                self.buf, self.calling = self.buf[i + len(self.start) :], True
                continue
            safe, self.buf = _hold(self.buf, [self.start])
            out.append(("text", safe))
            break
        return [(k, t) for k, t in out if t or k == "call"]

    def flush(self) -> tuple[str, str | None]:
        """(content left, the text of a call the answer ended inside, or None)."""
        out, self.buf = self.buf, ""
        return ("", out) if self.calling else (out, None)


class AnswerText:
    """A job's text on its way out: the thinking split, then tool calls cut out of the content
    and parsed (a call the parser cannot read goes out as the text it was)."""

    def __init__(self, job: Job, tokenizer):
        self.job, self.tokenizer = job, tokenizer
        thinking = job.thinking
        self.split = ThinkingSplitter(thinking, job.tags) if thinking is not None else None
        self.calls = None
        if job.tools is not None and job.tools.choice != "none":
            start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
            self.calls = ToolCallSplitter(start, end, job.inside)
        self.called = 0

    def feed(self, text: str) -> bool:
        """Send `text` on; True when the answer should end here (a call, no parallel calls)."""
        if not text:
            return False
        reasoning, content = self.split.feed(text) if self.split else (None, text)
        return self._send(reasoning, content)

    def _send(self, reasoning: str | None, content: str) -> bool:
        if reasoning:
            self.job.events.put(Text(reasoning, ""))
        if self.calls is None:
            if content:
                self.job.events.put(Text(None, content))
            return False
        for kind, text in self.calls.feed(content) if content else []:
            if kind == "text":
                self.job.events.put(Text(None, text))
            elif self._call(text):
                return True
        return False

    def _call(self, text: str, closed: bool = True) -> bool:
        """A call's text parsed and sent; True when no call may follow. `closed`: the model
        wrote the end marker (not when the answer ended inside the call)."""
        tools = self.job.tools
        assert tools is not None
        parsed = parse_call(self.tokenizer, text, tools)
        if parsed is None:  # unreadable: the client gets the text as the model wrote it
            end = self.tokenizer.tool_call_end if closed else ""
            self.job.events.put(Text(None, self.tokenizer.tool_call_start + text + end))
            return False
        self.called += len(parsed)
        self.job.events.put(ToolCalls(parsed))
        return not tools.parallel

    def flush(self) -> None:
        if self.split is not None:
            reasoning, content = self.split.flush()
            self._send(reasoning, content)
        if self.calls is not None:
            content, unfinished = self.calls.flush()
            if content:
                self.job.events.put(Text(None, content))
            if unfinished:  # the answer ended inside a call (length, or no end marker)
                self._call(unfinished, closed=False)
