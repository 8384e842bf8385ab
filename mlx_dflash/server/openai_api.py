"""OpenAI's chat completions and completions: the answer as one JSON body, or streamed as
chunks, with their body builders (protocol.py reads the requests)."""

from __future__ import annotations

from itertools import accumulate
from typing import TYPE_CHECKING, Any

from . import protocol as P
from .events import Done, Failed, Logprobs, Text, ToolCalls, collect, token_entries
from .worker import Job

if TYPE_CHECKING:
    from .http import Handler


def answer(h: Handler, req: P.Request, job: Job) -> None:
    a = collect(h, job)
    if a is None:
        return
    done, chat = a.done, req.kind == "chat"
    lps = a.logprobs if req.logprobs is not None else None
    if chat:
        thinking = a.reasoning if job.thinking is not None else None
        choices = choice("message", chat_message(a.content, thinking, a.calls), done.finish, lps)
    else:
        choices = choice("text", a.content, done.finish, lps)
    use = P.usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens)
    body = envelope(P.new_id("chatcmpl" if chat else "cmpl"), h.app.config.model_name,
                    "chat.completion" if chat else "text_completion", choices,
                    usage=use, dflash=done.stats)  # fmt: skip
    h.send_json(200, body)


def stream(h: Handler, req: P.Request, job: Job) -> None:
    name, chat = h.app.config.model_name, req.kind == "chat"
    rid = P.new_id("chatcmpl" if chat else "cmpl")
    obj, key = ("chat.completion.chunk", "delta") if chat else ("text_completion", "text")
    empty: Any = {} if chat else ""  # a chunk with nothing new: chat's delta, or the text

    def send(piece, finish=None, logprobs=None, **rest) -> None:
        h.sse(envelope(rid, name, obj, choice(key, piece, finish, logprobs), **rest))

    h.start_sse()
    if chat:
        send({"role": "assistant", "content": ""})
    n_calls = 0
    for ev in h.events(job):
        if isinstance(ev, Logprobs):
            send(empty, logprobs=token_entries(h.app.tokenizer, ev.logprobs, ev.tokens))
        elif isinstance(ev, Text):
            pairs = (("reasoning_content", ev.reasoning), ("content", ev.content))
            send({k: v for k, v in pairs if v} if chat else ev.content)
        elif isinstance(ev, ToolCalls):  # chat only: completions have no tools
            for call in ev.calls:
                for delta in tool_call_deltas(call, n_calls):
                    send({"tool_calls": [delta]})
                n_calls += 1
        elif isinstance(ev, Failed):
            h.sse(P.APIError(500, ev.message, type="server_error").body())
            break
        elif isinstance(ev, Done):
            send(empty, ev.finish, dflash=ev.stats)  # only the last chunk carries the stats
            if req.include_usage:
                use = P.usage(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens)
                h.sse(envelope(rid, name, obj, [], usage=use))
    h.sse("[DONE]")


# ---- bodies ----------------------------------------------------------------------------


def completion_logprobs(entries: list[dict]) -> dict:
    """Chat-shaped entries in the legacy completions shape."""
    tokens = [e["token"] for e in entries]
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{a["token"]: a["logprob"] for a in e["top_logprobs"]} for e in entries],
        "text_offset": [0, *accumulate(map(len, tokens))][: len(tokens)],
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


def envelope(rid, model, obj: str, choices: list[dict], **rest) -> dict:
    """The frame of every body and chunk; `rest` (usage, dflash) follows the choices."""
    return {"id": rid, "object": obj, "created": P.now(), "model": model, "choices": choices,
            **rest}  # fmt: skip


def choice(key: str, value, finish=None, logprobs=None) -> list[dict]:
    """The one choice: chat's `message` or `delta`, or a completion's `text`, with the
    logprobs entries in that API's shape."""
    if logprobs is not None:
        chat = key != "text"
        logprobs = {"content": logprobs, "refusal": None} if chat else completion_logprobs(logprobs)
    return [{"index": 0, key: value, "finish_reason": finish, "logprobs": logprobs}]
