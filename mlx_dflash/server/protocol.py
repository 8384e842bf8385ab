"""Requests in, JSON out: the OpenAI (and Anthropic messages) shapes, checked field by field.

Every bad request becomes an APIError, which the HTTP layer answers as
`{"error": {"message", "type", "param", "code"}}` with a 4xx status; nothing here touches the
model.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..engine.grammar import GrammarSpec
from .errors import APIError
from .structured import response_format, strict_names
from .tools import Tools, parse_tools

MAX_STOPS = 256  # stop strings a request may list (each is searched for in every chunk)


@dataclass
class Request:
    """One generation request, whatever endpoint it came in by."""

    kind: str  # "chat" | "completion" | "messages"
    model: str | None
    messages: list[dict[str, Any]] | None = None  # chat, messages
    prompt: str | None = None  # completion
    system: str | None = None  # messages: Anthropic puts it at the top level
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: Tools | None = None
    previous: str | None = None  # responses: previous_response_id
    logprobs: int | None = None  # top alternatives per token (0: just the token's); None: off
    grammar: GrammarSpec | None = None  # response_format / text.format / output_format
    strict: set[str] = field(default_factory=set)  # tools whose arguments follow their schema


def parse_json(raw: bytes) -> dict:
    """The request object; every string in it is valid Unicode (JSON's \\ud800 escapes can
    carry a lone surrogate, which no tokenizer can encode) and nesting is bounded."""
    try:
        body = json.loads(raw or b"")
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise APIError(400, "The request body nests too deeply.") from None
    except UnicodeEncodeError:
        raise APIError(
            400, "The request body holds a string that is not valid Unicode (a lone surrogate)."
        ) from None
    except (ValueError, UnicodeDecodeError):
        raise APIError(400, "The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.")
    return body


def _get(body: dict, name: str, types: tuple, default=None, check=None, what: str = ""):
    """body[name] if present and of `types` (bool is never a number), else an APIError."""
    if name not in body or body[name] is None:
        return default
    v = body[name]
    ok = isinstance(v, types) and (bool in types or not isinstance(v, bool))
    if not ok or (check is not None and not check(v)):
        raise APIError(400, f"'{name}' must be {what}, not {json.dumps(v)[:80]}.", param=name)
    return v


def _text(content: Any, where: str, kinds: tuple = ("text", str), param: str | None = None) -> str:
    """Message content: a string, or a list of parts whose type is one of `kinds` (`str`: a bare
    string), read as text; images and the rest are not supported."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part)
            if kind not in kinds:
                name = kind.__name__ if isinstance(kind, type) else kind
                raise APIError(400, f"{where}: content parts of type '{name}' are not supported.",
                               param=param)  # fmt: skip
            out.append(part if isinstance(part, str) else str(part.get("text", "")))
        return "".join(out)
    if content is None:
        return ""
    raise APIError(400, f"{where}: 'content' must be a string or a list of text parts.",
                   param=param)  # fmt: skip


def _messages(body: dict, anthropic: bool = False) -> list[dict[str, Any]]:
    """The conversation as chat templates take it: role and content, plus the assistant's
    `tool_calls` (arguments as objects, which templates iterate) and the tool results'
    `tool_call_id`; Anthropic's tool_use / tool_result blocks become the same."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "'messages' must be a non-empty list.", param="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a 'role'.", param="messages")
        role = "system" if m["role"] == "developer" else m["role"]
        if role not in ("system", "user", "assistant", "tool"):
            raise APIError(
                400, f"messages[{i}] has an unknown role '{m['role']}'.", param="messages"
            )
        where = f"messages[{i}]"
        if anthropic and isinstance(m.get("content"), list):
            out += _anthropic_blocks(role, m["content"], where)
            continue
        msg: dict[str, Any] = {"role": role, "content": _text(m.get("content"), where)}
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = [_call_in(c, f"{where}.tool_calls[{j}]")
                                 for j, c in enumerate(_list(m["tool_calls"], where))]  # fmt: skip
        if role == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id") or "")
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _list(v: Any, where: str) -> list:
    if not isinstance(v, list):
        raise APIError(400, f"{where}: 'tool_calls' must be a list.", param="messages")
    return v


def _call_in(c: Any, where: str) -> dict:
    """An earlier assistant tool call, its arguments parsed (templates write them out)."""
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(400, f"{where} needs a 'function' with a 'name'.", param="messages")
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise APIError(
                400, f"{where}: 'arguments' is not valid JSON.", param="messages"
            ) from None
    if not isinstance(args, dict):
        raise APIError(400, f"{where}: 'arguments' must be a JSON object.", param="messages")
    return {
        "id": c.get("id"),
        "type": "function",
        "function": {"name": fn["name"], "arguments": args},
    }


def _anthropic_blocks(role: str, blocks: list, where: str) -> list[dict[str, Any]]:
    """One Anthropic message's content blocks: text (and thinking, dropped), tool_use calls
    on the assistant's side, tool_result messages on the user's (before the user's text)."""
    text, calls, results = [], [], []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            text.append(str(b.get("text", "")))
        elif kind in ("thinking", "redacted_thinking"):
            continue
        elif kind == "tool_use" and role == "assistant":
            fn = {"name": b.get("name"), "arguments": b.get("input") or {}}
            calls.append(_call_in({"id": b.get("id"), "function": fn}, f"{where}.content[{j}]"))
        elif kind == "tool_result" and role == "user":
            content = _text(b.get("content"), f"{where}.content[{j}]")
            results.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id") or ""),
                            "content": content})  # fmt: skip
        else:
            raise APIError(400, f"{where}: content blocks of type '{kind}' are not supported.")
    out: list[dict[str, Any]] = list(results)
    if text or calls or not results:
        msg: dict[str, Any] = {"role": role, "content": "".join(text)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def parse_request(kind: str, body: dict) -> Request:
    """Check a chat / completion / messages body and return what the engine needs."""
    number = (int, float)
    req = Request(kind=kind, model=_get(body, "model", (str,), what="a string"))
    if kind == "completion":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise APIError(400, "'prompt' must be a string.", param="prompt")
        req.prompt = prompt
    else:
        req.messages = _messages(body, anthropic=kind == "messages")
        req.tools = parse_tools(body, anthropic=kind == "messages")
        req.grammar = response_format(body, kind)
        req.strict = strict_names(body, anthropic=kind == "messages")
        if kind == "messages":
            system = body.get("system")
            req.system = _text(system, "system") if system is not None else None
    positive = lambda v: v >= 1  # noqa: E731
    req.max_tokens = _get(body, "max_completion_tokens", (int,), None, positive, "an integer >= 1")
    req.max_tokens = _get(body, "max_tokens", (int,), req.max_tokens, positive, "an integer >= 1")
    if kind == "messages" and req.max_tokens is None:
        raise APIError(400, "'max_tokens' is required.", param="max_tokens")
    req.temperature = _get(body, "temperature", number, None, lambda v: 0 <= v <= 2, "in [0, 2]")
    req.top_p = _get(body, "top_p", number, None, lambda v: 0 < v <= 1, "in (0, 1]")
    req.top_k = _get(body, "top_k", (int,), None, lambda v: v >= 0, "an integer >= 0")
    req.min_p = _get(body, "min_p", number, None, lambda v: 0 <= v <= 1, "in [0, 1]")
    unit = lambda v: 0 <= v <= 1  # noqa: E731
    req.xtc_probability = _get(body, "xtc_probability", number, None, unit, "in [0, 1]")
    req.xtc_threshold = _get(body, "xtc_threshold", number, None, lambda v: 0 <= v <= 0.5,
                             "in [0, 0.5]")  # fmt: skip
    req.seed = _get(body, "seed", (int,), what="an integer")
    n = _get(body, "n", (int,), 1, what="an integer")
    if n != 1:
        raise APIError(400, "Only n=1 is supported.", param="n")
    stop = body.get("stop_sequences" if kind == "messages" else "stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
    ):
        raise APIError(400, "'stop' must be a string or a list of non-empty strings.", param="stop")
    if stop is not None and len(stop) > MAX_STOPS:
        raise APIError(400, f"'stop' lists {len(stop)} strings; at most {MAX_STOPS}.", param="stop")
    req.stop = list(stop or [])
    req.stream = bool(_get(body, "stream", (bool,), False, what="true or false"))
    opts = _get(body, "stream_options", (dict,), {}, what="an object")
    req.include_usage = bool(opts.get("include_usage", False))
    req.logprobs = _logprobs(body, kind)
    req.template_kwargs = dict(
        _get(body, "chat_template_kwargs", (dict,), {}, what="an object") or {}
    )
    return req


def _logprobs(body: dict, kind: str) -> int | None:
    """Chat: logprobs (bool) and top_logprobs (0-20); completions: logprobs (0-5 alternatives)."""
    if kind == "completion":
        return _get(body, "logprobs", (int,), None, lambda v: 0 <= v <= 5, "an integer in 0..5")
    if kind != "chat":
        return None
    on = _get(body, "logprobs", (bool,), False, what="true or false")
    top = _get(body, "top_logprobs", (int,), None, lambda v: 0 <= v <= 20, "an integer in 0..20")
    if top is not None and not on:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    return (top or 0) if on else None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def fragments(arguments: str, size: int = 16) -> list[str]:
    """A call's arguments in the pieces a stream sends them in (at least one, maybe empty)."""
    return [arguments[i : i + size] for i in range(0, len(arguments), size)] or [""]
