"""Anthropic's Messages API: the answer as content blocks (thinking, text, tool_use), or
streamed as its typed events (message_start, content_block_*, message_delta, message_stop)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from . import protocol as P
from .events import Done, Failed, Text, ToolCalls, collect
from .worker import Job

if TYPE_CHECKING:
    from .http import Handler


def answer(h: Handler, req: P.Request, job: Job) -> None:
    a = collect(h, job, "api_error")
    if a is None:
        return
    blocks: list[dict[str, Any]] = []
    if a.reasoning:
        blocks.append({"type": "thinking", "thinking": a.reasoning})
    if a.content or not a.calls:
        blocks.append({"type": "text", "text": a.content})
    for c in a.calls:
        fn = c["function"]
        blocks.append({"type": "tool_use", "id": c["id"], "name": fn["name"],
                       "input": json.loads(fn["arguments"] or "{}")})  # fmt: skip
    d = a.done
    use = {"input_tokens": d.prompt_tokens, "output_tokens": d.completion_tokens}
    body = _message(P.new_id("msg"), h.app.config.model_name, blocks, d, use)
    h.send_json(200, {**body, "dflash": d.stats})


def _message(rid: str, model: str, content: list, done: Done | None, usage: dict) -> dict:
    """A message's frame: the whole answer's, or (no `done` yet) a stream's message_start."""
    stop = None if done is None else done.stop_string
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": None if done is None else anthropic_stop(done.finish, stop),
        "stop_sequence": stop,
        "usage": usage,
    }


class _Blocks:
    """The content blocks of a streamed message, opened and closed in order."""

    def __init__(self, h: Handler):
        self.h, self.index = h, -1
        self.kind: str | None = None  # the open block's

    def open(self, kind: str, empty: dict | None = None) -> None:
        if self.kind is not None:
            self.close()
        self.kind, self.index = kind, self.index + 1
        empty = empty or {"type": kind, kind: ""}  # thinking or text
        start = {"type": "content_block_start", "index": self.index, "content_block": empty}
        self.h.sse(start, "content_block_start")

    def close(self) -> None:
        self.h.sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")

    def delta(self, delta: dict) -> None:
        body = {"type": "content_block_delta", "index": self.index, "delta": delta}
        self.h.sse(body, "content_block_delta")


def stream(h: Handler, req: P.Request, job: Job) -> None:
    rid, name = P.new_id("msg"), h.app.config.model_name
    h.start_sse()
    start = _message(rid, name, [], None, {"input_tokens": 0})
    h.sse({"type": "message_start", "message": start}, "message_start")
    blocks = _Blocks(h)
    for ev in h.events(job):
        if isinstance(ev, Text):
            for kind, text in (("thinking", ev.reasoning), ("text", ev.content)):
                if not text:
                    continue
                if blocks.kind != kind:
                    blocks.open(kind)
                blocks.delta({"type": f"{kind}_delta", kind: text})
        elif isinstance(ev, ToolCalls):
            for call in ev.calls:
                fn = call["function"]
                blocks.open("tool_use", {"type": "tool_use", "id": call["id"],
                                         "name": fn["name"], "input": {}})  # fmt: skip
                for piece in P.fragments(fn["arguments"]):
                    blocks.delta({"type": "input_json_delta", "partial_json": piece})
        elif isinstance(ev, Failed):
            h.sse(P.APIError(500, ev.message, type="api_error").body(anthropic=True), "error")
            return
        elif isinstance(ev, Done):
            _finish(h, blocks, ev)


def _finish(h: Handler, blocks: _Blocks, done: Done) -> None:
    if blocks.kind is None:
        blocks.open("text")
    blocks.close()
    stop = {"stop_reason": anthropic_stop(done.finish, done.stop_string),
            "stop_sequence": done.stop_string}  # fmt: skip
    h.sse({"type": "message_delta", "delta": stop, "usage": {"output_tokens": done.completion_tokens},
           "dflash": done.stats}, "message_delta")  # fmt: skip
    h.sse({"type": "message_stop"}, "message_stop")


# ---- bodies ----------------------------------------------------------------------------


def anthropic_stop(finish: str, stop_string: str | None) -> str:
    if stop_string is not None:
        return "stop_sequence"
    if finish == "tool_calls":
        return "tool_use"
    return "max_tokens" if finish == "length" else "end_turn"
