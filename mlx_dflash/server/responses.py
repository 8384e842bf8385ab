"""The OpenAI Responses API (`/v1/responses`) as Codex CLI uses it: input items in, output items
and typed stream events out, over the same job and tool-call path as chat completions.

Input items become chat messages (a `function_call` is an assistant tool call, its
`function_call_output` a tool message), so the chat template sees what it sees on
`/v1/chat/completions`. `previous_response_id` prepends that response's conversation, kept in
memory for the last `KEPT` responses; the session pool then finds its prefix cached.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from . import protocol as P

KEPT = 64  # responses remembered for previous_response_id


TEXT_PARTS = ("input_text", "output_text", "text")  # the content parts read as text


def input_messages(body: dict) -> list[dict[str, Any]]:
    """`input` (a string or a list of items) as chat messages."""
    raw = body.get("input")
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise P.APIError(400, "'input' must be a string or a list of items.", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            role = "system" if role == "developer" else role
            if role not in ("system", "user", "assistant"):
                raise P.APIError(400, f"{where} has an unknown role '{role}'.", param="input")
            content = P._text(item.get("content"), where, TEXT_PARTS, param="input")
            out.append({"role": role, "content": content})
        elif kind == "function_call":
            call = P._call_in({"id": item.get("call_id"), "function": {
                "name": item.get("name"), "arguments": item.get("arguments")}}, where)  # fmt: skip
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # calls after its text
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            text = P._text(item.get("output"), where, TEXT_PARTS, param="input")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""),
                        "content": text})  # fmt: skip
        elif kind == "reasoning":
            continue  # the model's earlier thinking is not sent back to templates
        else:
            raise P.APIError(
                400, f"{where}: items of type '{kind}' are not supported.", param="input"
            )
    if not out:
        raise P.APIError(400, "'input' holds no messages.", param="input")
    return out


def _tools(body: dict) -> dict:
    """The Responses API's flat function tools in chat completions' nested shape."""
    tools = body.get("tools")
    if tools is None:
        return body
    if not isinstance(tools, list):
        raise P.APIError(400, "'tools' must be a list.", param="tools")
    nested = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise P.APIError(
                400, f"tools[{i}]: only function tools are supported here, not '{kind}'.",
                param="tools",
            )  # fmt: skip
        fn = {
            k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None
        }
        nested.append({"type": "function", "function": fn})
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return {**body, "tools": nested, "tool_choice": choice}


def parse_responses(body: dict) -> P.Request:
    """A /v1/responses body as a Request (kind "responses")."""
    req = P.parse_request("responses", {
        **_tools(body),
        "messages": input_messages(body),
        "max_tokens": body.get("max_output_tokens"),
        "stop": None, "n": None, "stream_options": None,
    })  # fmt: skip
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise P.APIError(400, "'instructions' must be a string.", param="instructions")
    req.system = instructions or None
    prev = body.get("previous_response_id")
    if prev is not None and not isinstance(prev, str):
        raise P.APIError(
            400, "'previous_response_id' must be a string.", param="previous_response_id"
        )
    req.previous = prev
    return req


class ResponseStore:
    """The conversations of the last KEPT responses, for previous_response_id."""

    def __init__(self, kept: int = KEPT):
        self.kept = kept
        self.items: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self.lock = threading.Lock()

    def conversation(self, rid: str) -> list[dict[str, Any]]:
        with self.lock:
            if rid not in self.items:
                raise P.APIError(
                    400,
                    f"previous_response_id '{rid}' is not kept by this server (it keeps the last "
                    f"{self.kept} responses, in memory, until it restarts); send the whole input.",
                    param="previous_response_id",
                )
            return list(self.items[rid])

    def keep(self, rid: str, messages: list[dict[str, Any]]) -> None:
        with self.lock:
            self.items[rid] = messages
            while len(self.items) > self.kept:
                self.items.popitem(last=False)


# ---- output ----------------------------------------------------------------------------------


def response_body(rid, model, req: P.Request, items, done, status: str) -> dict[str, Any]:
    text = "".join(
        part["text"]
        for item in items
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )
    tools = req.tools
    choice: Any = tools.choice if tools else "auto"
    if tools and choice == "function":
        choice = {"type": "function", "name": tools.name}
    use = None
    if done is not None:
        use = {
            "input_tokens": done.prompt_tokens,
            "input_tokens_details": {"cached_tokens": done.cached_tokens},
            "output_tokens": done.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": done.prompt_tokens + done.completion_tokens,
        }
    incomplete = done is not None and done.finish == "length"
    return {
        "id": rid,
        "object": "response",
        "created_at": P.now(),
        "status": "incomplete" if incomplete and status == "completed" else status,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": model,
        "instructions": req.system,
        "previous_response_id": req.previous,
        "output": items,
        "output_text": text,
        "parallel_tool_calls": tools.parallel if tools else True,
        "tool_choice": choice,
        "tools": [{"type": "function", **t["function"]} for t in (tools.specs if tools else [])],
        "temperature": req.temperature,
        "top_p": req.top_p,
        "max_output_tokens": req.max_tokens,
        "usage": use,
        "metadata": {},
        "dflash": done.stats if done is not None else None,
    }


def as_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the chat messages a follow-up's history holds."""
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in items:
        if item["type"] == "message":
            msg["content"] += "".join(p["text"] for p in item["content"])
        elif item["type"] == "function_call":
            args = json.loads(item["arguments"] or "{}")
            msg.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function",
                                                     "function": {"name": item["name"], "arguments": args}})  # fmt: skip
    return [msg]


class EventStream:
    """The typed events of one streamed response, in order, each with its sequence number:
    an item is added, its text or arguments arrive as deltas, then it is done."""

    def __init__(self, send, rid: str, model: str, req: P.Request):
        self.send, self.rid, self.model, self.req = send, rid, model, req
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the message or reasoning item being written

    def event(self, kind: str, **payload) -> None:
        self.send({"type": kind, "sequence_number": self.seq, **payload}, kind)
        self.seq += 1

    def start(self) -> None:
        body = response_body(self.rid, self.model, self.req, [], None, "in_progress")
        self.event("response.created", response=body)
        self.event("response.in_progress", response=body)

    def _add(self, item: dict[str, Any]) -> int:
        self.items.append(item)
        self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)
        return len(self.items) - 1

    def _part(self, kind: str) -> tuple[dict[str, Any], int]:
        """The open item of this kind (message or reasoning), opened with its one part."""
        item = self.open
        if item is None or item["type"] != kind:
            self.close()
            if kind == "message":
                item = {"type": "message", "id": P.new_id("msg"), "status": "in_progress",
                        "role": "assistant", "content": []}  # fmt: skip
                part = {"type": "output_text", "text": "", "annotations": []}
            else:
                item = {"type": "reasoning", "id": P.new_id("rs"), "summary": [], "content": [],
                        "status": "in_progress"}  # fmt: skip
                part = {"type": "reasoning_text", "text": ""}
            at = self._add(item)
            self.open = item
            item["content"].append(part)
            if kind == "message":
                self.event("response.content_part.added", item_id=item["id"], output_index=at,
                           content_index=0, part=dict(part))  # fmt: skip
        return item, self.items.index(item)

    def text(self, delta: str) -> None:
        item, at = self._part("message")
        item["content"][0]["text"] += delta
        self.event("response.output_text.delta", item_id=item["id"], output_index=at,
                   content_index=0, delta=delta, logprobs=[])  # fmt: skip

    def reasoning(self, delta: str) -> None:
        item, at = self._part("reasoning")
        item["content"][0]["text"] += delta
        self.event("response.reasoning_text.delta", item_id=item["id"], output_index=at,
                   content_index=0, delta=delta)  # fmt: skip

    def close(self) -> None:
        """Finish the open message or reasoning item."""
        item, self.open = self.open, None
        if item is None:
            return
        at, part = self.items.index(item), item["content"][0]
        if item["type"] == "message":
            self.event("response.output_text.done", item_id=item["id"], output_index=at,
                       content_index=0, text=part["text"], logprobs=[])  # fmt: skip
            self.event("response.content_part.done", item_id=item["id"], output_index=at,
                       content_index=0, part=part)  # fmt: skip
        else:
            self.event("response.reasoning_text.done", item_id=item["id"], output_index=at,
                       content_index=0, text=part["text"])  # fmt: skip
        item["status"] = "completed"
        self.event("response.output_item.done", output_index=at, item=item)

    def call(self, call: dict) -> None:
        self.close()
        name, args = call["function"]["name"], call["function"]["arguments"]
        item = {"type": "function_call", "id": P.new_id("fc"), "call_id": call["id"],
                "name": name, "arguments": "", "status": "in_progress"}  # fmt: skip
        at = self._add(dict(item))
        for piece in P.fragments(args):
            self.event("response.function_call_arguments.delta", item_id=item["id"],
                       output_index=at, delta=piece)  # fmt: skip
        self.event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                   arguments=args)  # fmt: skip
        item.update(arguments=args, status="completed")
        self.items[at] = item
        self.event("response.output_item.done", output_index=at, item=item)

    def finish(self, done) -> dict[str, Any]:
        self.close()
        body = response_body(self.rid, self.model, self.req, self.items, done, "completed")
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        self.event(kind, response=body)
        return body
