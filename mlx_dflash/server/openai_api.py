"""OpenAI's chat completions and completions: the answer as one JSON body, or streamed as
chunks, with their body builders (protocol.py reads the requests)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import protocol as P
from .collect import collect, token_entries
from .events import Done, Failed, Logprobs, Text, ToolCalls
from .worker import Job

if TYPE_CHECKING:
    from .http import Handler


def answer(h: Handler, req: P.Request, job: Job) -> None:
    a = collect(h, job)
    if a.error is not None:
        return h.error(P.APIError(500, a.error, "server_error"))
    if a.done is None:  # the client left
        return
    done, name = a.done, h.app.config.model_name
    use = P.usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens)
    lps = a.logprobs if req.logprobs is not None else None
    if req.kind == "chat":
        thinking = a.reasoning if job.thinking is not None else None
        body = chat_response(P.new_id("chatcmpl"), name, a.content, thinking, done.finish, use,
                               done.stats, a.calls, lps)  # fmt: skip
    else:
        body = completion_response(
            P.new_id("cmpl"), name, a.content, done.finish, use, done.stats, lps
        )
    h.send_json(200, body)


def stream(h: Handler, req: P.Request, job: Job) -> None:
    name, chat = h.app.config.model_name, req.kind == "chat"
    rid = P.new_id("chatcmpl" if chat else "cmpl")
    h.start_sse()
    if chat:
        h.sse(chat_chunk(rid, name, {"role": "assistant", "content": ""}))
    n_calls = 0
    for ev in h.events(job):
        if isinstance(ev, Logprobs):
            entries = token_entries(h.app.tokenizer, ev.logprobs, ev.tokens)
            if chat:
                h.sse(chat_chunk(rid, name, {}, logprobs=entries))
            else:
                h.sse(completion_chunk(rid, name, "", logprobs=entries))
        elif isinstance(ev, Text):
            if chat:
                delta = {}
                if ev.reasoning:
                    delta["reasoning_content"] = ev.reasoning
                if ev.content:
                    delta["content"] = ev.content
                h.sse(chat_chunk(rid, name, delta))
            else:
                h.sse(completion_chunk(rid, name, ev.content))
        elif isinstance(ev, ToolCalls):
            for call in ev.calls:
                for delta in tool_call_deltas(call, n_calls):
                    h.sse(chat_chunk(rid, name, {"tool_calls": [delta]}))
                n_calls += 1
        elif isinstance(ev, Failed):
            h.sse(P.APIError(500, ev.message, "server_error").body())
            break
        elif isinstance(ev, Done):
            _finish(h, req, rid, name, chat, ev)
    h.sse("[DONE]")


def _finish(h: Handler, req: P.Request, rid: str, name: str, chat: bool, done: Done) -> None:
    if chat:
        h.sse(chat_chunk(rid, name, {}, done.finish, done.stats))
    else:
        h.sse(completion_chunk(rid, name, "", done.finish, done.stats))
    if req.include_usage:
        use = P.usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens)
        h.sse(usage_chunk(rid, name, req.kind, use))


# ---- bodies ----------------------------------------------------------------------------


def completion_logprobs(entries: list[dict], offset: int = 0) -> dict:
    """Chat-shaped entries in the legacy completions shape."""
    offsets, at = [], offset
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{a["token"]: a["logprob"] for a in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


def chat_message(content: str, reasoning: str | None, calls: list[dict] | None = None) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = calls
        msg["content"] = content or None  # OpenAI's: no text beside the calls is null
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    return msg


def tool_call_deltas(call: dict, index: int) -> list[dict]:
    """OpenAI's streamed shape of one call: id, type and name (empty arguments) first, then
    the arguments in fragments."""
    fn = call["function"]
    first = {"index": index, "id": call["id"], "type": "function",
             "function": {"name": fn["name"], "arguments": ""}}  # fmt: skip
    rest = [{"index": index, "function": {"arguments": p}} for p in P.fragments(fn["arguments"])]
    return [first, *rest]


def chat_response(
    rid, model, content, reasoning, finish, use, stats, calls=None, logprobs=None
) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": P.now(),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": chat_message(content, reasoning, calls),
                "finish_reason": finish,
                "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
            }
        ],
        "usage": use,
        "dflash": stats,
    }


def chat_chunk(rid, model, delta: dict, finish=None, stats=None, logprobs=None) -> dict:
    lp = None if logprobs is None else {"content": logprobs, "refusal": None}
    out = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": P.now(),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}],
    }
    if stats is not None:
        out["dflash"] = stats
    return out


def completion_response(rid, model, text, finish, use, stats, logprobs=None) -> dict:
    lp = None if logprobs is None else completion_logprobs(logprobs)
    return {
        "id": rid,
        "object": "text_completion",
        "created": P.now(),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": lp}],
        "usage": use,
        "dflash": stats,
    }


def completion_chunk(rid, model, text, finish=None, stats=None, logprobs=None) -> dict:
    lp = None if logprobs is None else completion_logprobs(logprobs)
    out = {
        "id": rid,
        "object": "text_completion",
        "created": P.now(),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": lp}],
    }
    if stats is not None:
        out["dflash"] = stats
    return out


def usage_chunk(rid, model, kind: str, use: dict) -> dict:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": P.now(),
        "model": model,
        "choices": [],
        "usage": use,
    }


# Anthropic messages: the same core, another envelope.
