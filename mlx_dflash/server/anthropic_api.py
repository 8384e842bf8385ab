"""Anthropic's Messages API: the answer as content blocks (thinking, text, tool_use), or
streamed as its typed events (message_start, content_block_*, message_delta, message_stop)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from . import protocol as P
from .collect import collect
from .events import Done, Failed, Text, ToolCalls
from .worker import Job

if TYPE_CHECKING:
    from .http import Handler


def answer(h: Handler, req: P.Request, job: Job) -> None:
    a = collect(h, job)
    if a.error is not None:
        return h.error(P.APIError(500, a.error, type="api_error"))
    if a.done is None:
        return
    done = a.done
    use = P.usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens)
    body = messages_response(P.new_id("msg"), h.app.config.model_name, a.content, a.reasoning,
                               done.finish, done.stop_string, use, done.stats, a.calls)  # fmt: skip
    h.send_json(200, body)


class _Blocks:
    """The content blocks of a streamed message, opened and closed in order."""

    def __init__(self, h: Handler):
        self.h, self.index = h, -1
        self.kind: str | None = None  # the open block's

    def open(self, kind: str, empty: dict | None = None) -> None:
        if self.kind is not None:
            self.close()
        self.kind, self.index = kind, self.index + 1
        if empty is None:
            empty = {"type": "thinking", "thinking": ""} if kind == "thinking" else None
            empty = empty or {"type": "text", "text": ""}
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
    start: dict[str, Any] = {"id": rid, "type": "message", "role": "assistant", "model": name,
                             "content": []}  # fmt: skip
    start.update(stop_reason=None, stop_sequence=None, usage={"input_tokens": 0})
    h.sse({"type": "message_start", "message": start}, "message_start")
    blocks = _Blocks(h)
    for ev in h.events(job):
        if isinstance(ev, Text):
            for kind, text in (("thinking", ev.reasoning), ("text", ev.content)):
                if not text:
                    continue
                if blocks.kind != kind:
                    blocks.open(kind)
                field = "thinking" if kind == "thinking" else "text"
                blocks.delta({"type": f"{field}_delta", field: text})
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


def messages_response(rid, model, content, reasoning, finish, stop_seq, use, stats, calls=()):
    blocks: list[dict[str, Any]] = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning})
    if content or not calls:
        blocks.append({"type": "text", "text": content})
    for c in calls:
        fn = c["function"]
        blocks.append({"type": "tool_use", "id": c["id"], "name": fn["name"],
                       "input": json.loads(fn["arguments"] or "{}")})  # fmt: skip
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": anthropic_stop(finish, stop_seq),
        "stop_sequence": stop_seq,
        "usage": {
            "input_tokens": use["prompt_tokens"],
            "output_tokens": use["completion_tokens"],
        },
        "dflash": stats,
    }
