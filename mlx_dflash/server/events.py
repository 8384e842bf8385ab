"""A job's events, in order, from the worker to the handler that answers it: pieces of text,
logprobs and tool calls as the answer goes, then one Done or Failed; and the whole answer
gathered from them, which the wire APIs' non-streamed answers write."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import APIError

if TYPE_CHECKING:
    from .http import Handler
    from .worker import Job


@dataclass
class Text:
    reasoning: str | None  # inside the thinking block
    content: str | None


@dataclass
class Logprobs:
    tokens: list[int]
    logprobs: list  # per token: (its logprob, [(alternative, logprob)])


@dataclass
class ToolCalls:
    calls: list[dict]


@dataclass
class Failed:
    message: str


@dataclass
class Done:
    finish: str  # "stop" | "length" | "cancelled" | "tool_calls"
    stop_string: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    stats: dict


@dataclass
class Answer:
    done: Done
    content: str
    reasoning: str
    calls: list[dict]
    logprobs: list[dict]  # OpenAI's per-token entries


def collect(h: Handler, job: Job, error_type: str = "server_error") -> Answer | None:
    """The job's whole answer; None when it failed (its 500 is sent here, as the API's
    `error_type`) or the client left before it ended."""
    content, reasoning, calls, logprobs = [], [], [], []
    done = None
    for ev in h.events(job):
        if isinstance(ev, Logprobs):
            logprobs += token_entries(h.app.tokenizer, ev.logprobs, ev.tokens)
        elif isinstance(ev, Text):
            reasoning.append(ev.reasoning or "")
            content.append(ev.content or "")
        elif isinstance(ev, ToolCalls):
            calls += ev.calls
        elif isinstance(ev, Done):
            done = ev
        elif isinstance(ev, Failed):
            h.error(APIError(500, ev.message, type=error_type))
    if done is None:
        return None
    return Answer(done, "".join(content), "".join(reasoning), calls, logprobs)


def token_entries(tokenizer, logprobs: list, tokens: list[int]) -> list[dict]:
    """OpenAI's per-token logprobs entries (chat's shape) for emitted tokens."""

    def one(t: int, lp: float) -> dict:
        text = tokenizer.decode([t])
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return [
        {**one(t, lp), "top_logprobs": [one(a, v) for a, v in top]}
        for t, (lp, top) in zip(tokens, logprobs, strict=True)
    ]
