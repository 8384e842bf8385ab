"""A whole answer, gathered from a job's events (engine -> worker -> here): what the wire
APIs' non-streamed answers write (openai_api.py, anthropic_api.py, responses_api.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .events import Done, Failed, Logprobs, Text, ToolCalls
from .worker import Job

if TYPE_CHECKING:
    from .http import Handler


@dataclass
class Answer:
    content: str = ""
    reasoning: str = ""
    calls: list[dict] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)  # OpenAI's per-token entries
    done: Done | None = None  # None: the client left before it ended
    error: str | None = None


def collect(h: Handler, job: Job) -> Answer:
    out = Answer()
    content, reasoning = [], []
    for ev in h.events(job):
        if isinstance(ev, Logprobs):
            out.logprobs += token_entries(h.app.tokenizer, ev.logprobs, ev.tokens)
        elif isinstance(ev, Text):
            reasoning.append(ev.reasoning or "")
            content.append(ev.content or "")
        elif isinstance(ev, ToolCalls):
            out.calls += ev.calls
        elif isinstance(ev, Done):
            out.done = ev
        elif isinstance(ev, Failed):
            out.error = ev.message
    out.content, out.reasoning = "".join(content), "".join(reasoning)
    return out


def token_entries(tokenizer, logprobs: list, tokens: list[int]) -> list[dict]:
    """OpenAI's per-token logprobs entries (chat's shape) for emitted tokens."""

    def one(t: int, lp: float) -> dict:
        text = tokenizer.decode([t])
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return [
        {**one(t, lp), "top_logprobs": [one(a, v) for a, v in top]}
        for t, (lp, top) in zip(tokens, logprobs, strict=True)
    ]
