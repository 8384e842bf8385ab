"""OpenAI's Responses API: the answer as output items (reasoning, message, function calls), or
streamed as its typed events (responses.py EventStream); each response is kept so a later one
can continue it (previous_response_id)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import protocol as P
from . import responses as R
from .events import Done, Failed, Text, ToolCalls, collect
from .worker import Job

if TYPE_CHECKING:
    from .http import Handler


def answer(h: Handler, req: P.Request, job: Job) -> None:
    a = collect(h, job)
    if a is None:
        return
    rid = P.new_id("resp")
    out = R.EventStream(lambda *_: None, rid, h.app.config.model_name, req)  # no events sent
    if a.reasoning:
        out.reasoning(a.reasoning)
    if a.content or not a.calls:  # a message item, even empty, unless only calls came
        out.text(a.content)
    for call in a.calls:
        out.call(call)
    body = out.finish(a.done)
    h.app.responses.keep(rid, list(req.messages or []) + R.as_messages(body["output"]))
    h.send_json(200, body)


def stream(h: Handler, req: P.Request, job: Job) -> None:
    rid = P.new_id("resp")
    h.start_sse()
    out = R.EventStream(h.sse, rid, h.app.config.model_name, req)
    out.start()
    for ev in h.events(job):
        if isinstance(ev, Text):
            if ev.reasoning:
                out.reasoning(ev.reasoning)
            if ev.content:
                out.text(ev.content)
        elif isinstance(ev, ToolCalls):
            for call in ev.calls:
                out.call(call)
        elif isinstance(ev, Failed):
            out.event("error", code="server_error", message=ev.message, param=None)
            return
        elif isinstance(ev, Done):
            body = out.finish(ev)
            h.app.responses.keep(rid, list(req.messages or []) + R.as_messages(body["output"]))
