"""The HTTP layer: routes, authentication, server-sent events, disconnects.

Built on the standard library's ThreadingHTTPServer, as mlx-lm's own server is: no extra
dependency, and since generation is one blocking loop on the worker thread, an async stack
would add a thread hop without making streaming or cancellation simpler. A client that goes
away is noticed at the next write (streaming) or by polling its socket while it waits (not
streaming); either way its job is cancelled and the worker moves on.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import select
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..distributed import LOCAL
from ..engine import GenerationConfig, SamplingParams
from ..engine.corpus import live_corpus
from ..errors import DFlashError
from ..prompts import has_template, render, stop_ids
from . import protocol as P
from . import responses as R
from .kept_answers import open_answer_log
from .metrics import Metrics
from .sessions import SessionPool
from .structured import check_grammar, tool_grammar
from .text import prompt_opens_thinking, thinking_tags
from .tools import forced_prefix
from .worker import (
    Done,
    Failed,
    Job,
    Logprobs,
    Text,
    ToolCalls,
    Worker,
    job_config,
    serving_target,
)

MAX_BODY = 16 * 2**20
# POST routes -> the request kind; GET routes (/v1/models/ID aside). /metrics counts by these.
POST_KINDS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
}
GET_ROUTES = ("/health", "/v1/health", "/metrics", "/v1/models")
SOCKET_TIMEOUT_S = 30.0
POLL_S = 0.1


@dataclass
class ServerConfig:
    model_name: str
    aliases: tuple[str, ...] = ()
    api_key: str | None = None
    max_tokens: int = 512  # when a request does not say
    thinking: bool | None = None  # server-wide enable_thinking (None: the template's default)
    cache_bytes: int = 2 * 2**30
    cache_sessions: int = 8
    # Generations whose rounds share each target forward (engine/batch.py); 1: one at a time.
    max_batch: int = 1
    # A streamed answer sends an SSE comment after this many idle seconds (a long prefill):
    # clients with idle timeouts keep the stream.
    keepalive_s: float = 3.0
    # serve --keep-answers: the file its corpus's answers are kept in across restarts.
    keep_answers: str | None = None


class App:
    """What the handlers share: the loaded pair, the server's defaults, the worker."""

    def __init__(self, target, runner, base: GenerationConfig, config: ServerConfig, world=LOCAL):
        self.target, self.tokenizer, self.config = target, target.tokenizer, config
        # The corpus grows with the answers served (Worker._run adds each).
        self.corpus = live_corpus(base.lookup_corpus) if base.lookup else None
        if base.lookup:
            base = dataclasses.replace(base, lookup_corpus=self.corpus)
        log = None
        if config.keep_answers:
            log = open_answer_log(config.keep_answers, self.corpus, bool(base.lookup),
                                  target.tokenizer, config.model_name, world)  # fmt: skip
        self.base = GenerationConfig(
            **{**vars(base), "stop_ids": stop_ids(target.tokenizer), "max_tokens": 1}
        )
        self.mode = base.mode
        served = serving_target(target, world, config.max_batch)
        pool = SessionPool(served, runner, config.cache_bytes, config.cache_sessions)
        self.pool = pool
        self.worker = Worker(target, runner, base.mode, pool, world, config.max_batch)
        self.worker.answer_log = log
        self.context = int(target.text_config.get("max_position_embeddings") or 0) or None
        self.templated = has_template(self.tokenizer)
        self.tags = thinking_tags(self.tokenizer) if self.templated else None
        self.responses = R.ResponseStore()
        self.metrics = Metrics(self.worker, pool)
        self.worker.on_done = self.metrics.generation

    def check_model(self, name: str | None) -> None:
        ok = {self.config.model_name, *self.config.aliases}
        if name is not None and name not in ok:
            raise P.APIError(
                404,
                f"The model '{name}' does not exist: this server serves "
                f"'{self.config.model_name}'.",
                param="model",
                code="model_not_found",
            )

    def prepare(self, req: P.Request) -> Job:
        """Prompt ids, settings and stop strings for a checked request."""
        self.check_model(req.model)
        if req.previous is not None:  # responses: the earlier conversation comes first
            req.messages = self.responses.conversation(req.previous) + (req.messages or [])
        thinking, inside = None, None
        if req.kind == "completion":
            assert req.prompt is not None  # (protocol.py checked it)
            if not req.prompt.strip():
                raise P.APIError(400, "The prompt is empty.", param="prompt")
            ids = render(self.tokenizer, [{"role": "user", "content": req.prompt}], None, False)
        else:
            kwargs = {}
            if self.config.thinking is not None:
                kwargs["enable_thinking"] = self.config.thinking
            kwargs.update(req.template_kwargs)
            if not any(
                m["content"].strip() or m.get("tool_calls") for m in req.messages or []
            ) and (not req.system):
                raise P.APIError(400, "The messages are empty.", param="messages")
            ids, thinking, inside = self._render_chat(req, kwargs)
        if self.context is not None and len(ids) >= self.context:
            raise P.APIError(
                400,
                f"The prompt is {len(ids)} tokens; this model's context is {self.context}.",
                param="messages" if req.kind != "completion" else "prompt",
                code="context_length_exceeded",
            )
        room = self.context - len(ids) if self.context is not None else None
        if req.max_tokens is not None:
            if room is not None and req.max_tokens > room:
                raise P.APIError(
                    400,
                    f"max_tokens {req.max_tokens} plus the prompt's {len(ids)} tokens exceed "
                    f"this model's context of {self.context}.",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
            max_tokens = req.max_tokens
        else:
            max_tokens = min(self.config.max_tokens, room) if room else self.config.max_tokens
        s = self.base.sampling
        sampling = SamplingParams(
            s.temperature if req.temperature is None else float(req.temperature),
            s.top_p if req.top_p is None else float(req.top_p),
            s.top_k if req.top_k is None else int(req.top_k),
        )
        cfg = job_config(self.base, max_tokens=max_tokens, sampling=sampling, seed=req.seed,
                         logprobs=req.logprobs, grammar=self._grammar(req, thinking))  # fmt: skip
        tags = self.tags or ("<think>", "</think>")
        tools = req.tools if req.kind != "completion" else None
        return Job(ids, cfg, req.stop, thinking, tags, tools, inside if tools else None)

    def _grammar(self, req: P.Request, thinking: bool | None):
        """What the answer must follow: a forced call's strict arguments, else the requested
        format; compiled here so that a bad schema is a 400 before anything streams."""
        tools = req.tools if req.kind != "completion" else None
        spec, param = req.grammar, {"chat": "response_format", "responses": "text.format",
                                    "messages": "output_format"}.get(req.kind, "")  # fmt: skip
        forced = tools is not None and tools.choice in ("required", "function")
        # Under auto, strict calls follow free text; an answer that opens in a thinking block
        # is left free (its markers are the template's, not the grammar's).
        if tools is not None and (forced or (req.strict and not thinking and spec is None)):
            spec, param = tool_grammar(self.tokenizer, tools, req.strict), "tools"
        check_grammar(spec, self.target, self.base.stop_ids, param)
        return spec

    def _render_chat(
        self, req: P.Request, kwargs: dict
    ) -> tuple[list[int], bool | None, str | None]:
        """Prompt ids through the chat template (with the request's tools), whether the answer
        starts inside a thinking block, and what a forced tool_choice wrote after the call's
        start marker (the answer continues that call)."""
        tools, prefix = req.tools, ""
        if tools is not None:
            if not getattr(self.tokenizer, "has_tool_calling", False):
                raise P.APIError(
                    400,
                    "This model's chat template has no tool-call support, so it cannot take "
                    "'tools'.",
                    param="tools",
                )
            if tools.choice != "none":
                kwargs["tools"] = tools.specs
                prefix = forced_prefix(self.tokenizer, tools)
        ids, thinking = self._template(req, kwargs)
        if prefix and thinking:  # a forced call skips thinking (the template's own switch)
            ids, thinking = self._template(req, {**kwargs, "enable_thinking": False})
            if thinking:
                raise P.APIError(
                    400,
                    "This model thinks before it answers, so its tool call cannot be forced; "
                    "use tool_choice 'auto'.",
                    param="tool_choice",
                )
        if prefix:
            ids = ids + list(self.tokenizer.encode(prefix, add_special_tokens=False))
        return ids, thinking, prefix[len(self.tokenizer.tool_call_start) :] if prefix else None

    def _template(self, req: P.Request, kwargs: dict) -> tuple[list[int], bool | None]:
        try:
            ids = render(self.tokenizer, req.messages or [], req.system, self.templated, **kwargs)
        except Exception as e:  # a template that rejects these messages (roles, order)
            raise P.APIError(400, f"The chat template rejected the messages: {e}") from None
        thinking = None
        if self.tags is not None:
            thinking = prompt_opens_thinking(self.tokenizer.decode(ids[-16:]), self.tags)
        return ids, thinking


class Handler(BaseHTTPRequestHandler):
    server_version = "dflash-mlx"
    app: App  # set on the subclass made by make_server
    # Seconds a socket read or write may stall: a client that announces more body than it sends
    # (or stops reading) is dropped instead of holding a handler thread forever.
    timeout = SOCKET_TIMEOUT_S

    def log_message(self, fmt, *args):  # quiet by default; `serve --verbose` turns it on
        if getattr(self.server, "verbose", False):
            super().log_message(fmt, *args)

    # ---- plumbing -----------------------------------------------------------------------

    status = 0  # of the response sent, for /metrics

    def send_response(self, code, message=None):
        self.status = code
        super().send_response(code, message)

    def _count(self, path: str) -> None:
        known = path in GET_ROUTES or path in POST_KINDS
        endpoint = path if known else "/v1/models/*" if path.startswith("/v1/models/") else "other"
        self.app.metrics.request(endpoint, self.status)

    def _send_json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, e: P.APIError) -> None:
        try:
            self._send_json(e.status, e.body(anthropic=self.path.startswith("/v1/messages")))
        except OSError:
            pass

    def _authorized(self) -> bool:
        key = self.app.config.api_key
        if not key:
            return True
        auth = self.headers.get("Authorization", "")
        return auth == f"Bearer {key}" or self.headers.get("x-api-key") == key

    def _body(self) -> dict:
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            n = -1
        if n < 0:
            raise P.APIError(400, "Bad Content-Length header.")
        if n > MAX_BODY:
            raise P.APIError(413, f"The request body is over {MAX_BODY // 2**20} MB.")
        try:
            raw = self.rfile.read(n) if n else b""
        except TimeoutError:  # the socket's timeout (Handler.timeout): a body that never came
            raw = b""
        if len(raw) < n:
            self.close_connection = True
            raise P.APIError(
                400, f"The request body is shorter than its Content-Length ({n} bytes)."
            )
        return P.parse_json(raw)

    def _client_gone(self) -> bool:
        try:
            r, _, _ = select.select([self.connection], [], [], 0)
            return bool(r) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _events(self, job: Job):
        """The job's events as they come; cancels it if the client goes away meanwhile. A
        streamed answer (SSE started) gets a comment frame whenever it has been idle for
        `keepalive_s`; an event still goes out the moment it exists."""
        checked = last = time.monotonic()
        while True:
            try:
                ev = job.events.get(timeout=POLL_S)
            except queue.Empty:
                ev = None
            now = time.monotonic()
            if ev is not None:
                last = now
            elif self.streaming and now - last >= self.app.config.keepalive_s:
                self.wfile.write(b": keep-alive\n\n")
                self.wfile.flush()
                last = now
            if time.monotonic() - checked >= POLL_S:
                checked = time.monotonic()
                if self._client_gone():
                    job.cancel()
                    return
            if ev is None:
                continue
            yield ev
            if isinstance(ev, Done | Failed):
                return

    streaming = False  # set once the SSE headers went out

    def _start_sse(self) -> None:
        self.streaming = True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self.close_connection = True

    def _sse(self, data: Any, event: str | None = None) -> None:
        head = f"event: {event}\n" if event else ""
        payload = data if isinstance(data, str) else json.dumps(data)
        self.wfile.write(f"{head}data: {payload}\n\n".encode())
        self.wfile.flush()

    # ---- routes -------------------------------------------------------------------------

    def do_GET(self):
        path = self.path.split("?")[0].rstrip("/")
        try:
            self._get(path)
        finally:
            self._count(path)

    def _get(self, path: str) -> None:
        if path in ("/health", "/v1/health"):
            app = self.app
            return self._send_json(
                200,
                {
                    "status": "ok",
                    "model": app.config.model_name,
                    "mode": app.mode,
                    "busy": app.worker.busy,
                    "running": app.worker.running,
                    "max_batch": app.worker.max_batch,
                    "queued": app.worker.waiting,
                    "cached_prefixes": len(app.pool.idle),
                    "lookup_corpus_tokens": None if app.corpus is None else len(app.corpus),
                },
            )
        if not self._authorized():
            return self._error(P.APIError(401, "Missing or wrong API key.", "authentication_error"))
        if path == "/metrics":
            data = self.app.metrics.render()
            self.send_response(200)
            self.send_header("Content-Type", self.app.metrics.content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        if path == "/v1/models":
            return self._send_json(200, {"object": "list", "data": [self._model_card()]})
        if path.startswith("/v1/models/"):
            try:
                self.app.check_model(path[len("/v1/models/") :])
            except P.APIError as e:
                return self._error(e)
            return self._send_json(200, self._model_card())
        self._error(P.APIError(404, f"No route for GET {path}.", "not_found_error"))

    def _model_card(self) -> dict:
        return {
            "id": self.app.config.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "dflash-mlx",
        }

    def do_POST(self):
        path = self.path.split("?")[0].rstrip("/")
        try:
            self._post(path)
        finally:
            self._count(path)

    def _post(self, path: str) -> None:
        try:
            if path not in POST_KINDS:
                raise P.APIError(404, f"No route for POST {path}.", "not_found_error")
            if not self._authorized():
                raise P.APIError(401, "Missing or wrong API key.", "authentication_error")
            body = self._body()
            if POST_KINDS[path] == "responses":
                req = R.parse_responses(body)
            else:
                req = P.parse_request(POST_KINDS[path], body)
            job = self.app.prepare(req)
        except P.APIError as e:
            return self._error(e)
        except DFlashError as e:
            return self._error(P.APIError(400, str(e)))
        self.app.worker.submit(job)
        try:
            if req.kind == "messages":
                (self._stream_messages if req.stream else self._answer_messages)(req, job)
            elif req.kind == "responses":
                (self._stream_responses if req.stream else self._answer_responses)(req, job)
            elif req.stream:
                self._stream(req, job)
            else:
                self._answer(req, job)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError):
            job.cancel()

    def _collect(self, job: Job) -> tuple[str, str, list[dict], Done | None, str | None]:
        content, reasoning, calls, done, error = [], [], [], None, None
        self.entries: list[dict] = []
        for ev in self._events(job):
            if isinstance(ev, Logprobs):
                self.entries += P.token_entries(self.app.tokenizer, ev.logprobs, ev.tokens)
            elif isinstance(ev, Text):
                reasoning.append(ev.reasoning or "")
                content.append(ev.content or "")
            elif isinstance(ev, ToolCalls):
                calls += ev.calls
            elif isinstance(ev, Done):
                done = ev
            else:
                error = ev.message
        return "".join(content), "".join(reasoning), calls, done, error

    def _answer(self, req: P.Request, job: Job) -> None:
        content, reasoning, calls, done, error = self._collect(job)
        if error is not None:
            return self._error(P.APIError(500, error, "server_error"))
        if done is None:  # the client left
            return
        name = self.app.config.model_name
        use = P.usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens)
        if req.kind == "chat":
            thinking = reasoning if job.thinking is not None else None
            lps = self.entries if req.logprobs is not None else None
            body = P.chat_response(P.new_id("chatcmpl"), name, content, thinking, done.finish, use,
                                   done.stats, calls, lps)  # fmt: skip
        else:
            lps = self.entries if req.logprobs is not None else None
            body = P.completion_response(
                P.new_id("cmpl"), name, content, done.finish, use, done.stats, lps
            )
        self._send_json(200, body)

    def _stream(self, req: P.Request, job: Job) -> None:
        name, chat = self.app.config.model_name, req.kind == "chat"
        rid = P.new_id("chatcmpl" if chat else "cmpl")
        self._start_sse()
        if chat:
            self._sse(P.chat_chunk(rid, name, {"role": "assistant", "content": ""}))
        n_calls = 0
        for ev in self._events(job):
            if isinstance(ev, Logprobs):
                entries = P.token_entries(self.app.tokenizer, ev.logprobs, ev.tokens)
                if chat:
                    self._sse(P.chat_chunk(rid, name, {}, logprobs=entries))
                else:
                    self._sse(P.completion_chunk(rid, name, "", logprobs=entries))
            elif isinstance(ev, Text):
                reasoning, content = ev.reasoning, ev.content
                if chat:
                    delta = {}
                    if reasoning:
                        delta["reasoning_content"] = reasoning
                    if content:
                        delta["content"] = content
                    self._sse(P.chat_chunk(rid, name, delta))
                else:
                    self._sse(P.completion_chunk(rid, name, content))
            elif isinstance(ev, ToolCalls):
                for call in ev.calls:
                    for delta in P.tool_call_deltas(call, n_calls):
                        self._sse(P.chat_chunk(rid, name, {"tool_calls": [delta]}))
                    n_calls += 1
            elif isinstance(ev, Failed):
                self._sse(P.APIError(500, ev.message, "server_error").body())
                break
            elif isinstance(ev, Done):
                done = ev
                if chat:
                    self._sse(P.chat_chunk(rid, name, {}, done.finish, done.stats))
                else:
                    self._sse(P.completion_chunk(rid, name, "", done.finish, done.stats))
                if req.include_usage:
                    use = P.usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens)
                    self._sse(P.usage_chunk(rid, name, req.kind, use))
        self._sse("[DONE]")

    def _answer_messages(self, req: P.Request, job: Job) -> None:
        content, reasoning, calls, done, error = self._collect(job)
        if error is not None:
            return self._error(P.APIError(500, error, "api_error"))
        if done is None:
            return
        use = P.usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens)
        body = P.messages_response(
            P.new_id("msg"),
            self.app.config.model_name,
            content,
            reasoning,
            done.finish,
            done.stop_string,
            use,
            done.stats,
            calls,
        )
        self._send_json(200, body)

    def _answer_responses(self, req: P.Request, job: Job) -> None:
        content, reasoning, calls, done, error = self._collect(job)
        if error is not None:
            return self._error(P.APIError(500, error, "server_error"))
        if done is None:
            return
        rid, items = P.new_id("resp"), _response_items(content, reasoning, calls)
        body = R.response_body(rid, self.app.config.model_name, req, items, done, "completed")
        self.app.responses.keep(rid, list(req.messages or []) + R.as_messages(items))
        self._send_json(200, body)

    def _stream_responses(self, req: P.Request, job: Job) -> None:
        rid = P.new_id("resp")
        self._start_sse()
        out = R.EventStream(lambda data, event: self._sse(data, event), rid,
                            self.app.config.model_name, req)  # fmt: skip
        out.start()
        for ev in self._events(job):
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
                messages = list(req.messages or []) + R.as_messages(body["output"])
                self.app.responses.keep(rid, messages)

    def _stream_messages(self, req: P.Request, job: Job) -> None:
        rid, name = P.new_id("msg"), self.app.config.model_name
        self._start_sse()
        start: dict[str, Any] = {
            "id": rid,
            "type": "message",
            "role": "assistant",
            "model": name,
            "content": [],
        }
        start.update(stop_reason=None, stop_sequence=None, usage={"input_tokens": 0})
        self._sse({"type": "message_start", "message": start}, "message_start")
        block, index = None, -1

        def open_block(kind: str, empty: dict | None = None):
            nonlocal block, index
            if block is not None:
                self._sse({"type": "content_block_stop", "index": index}, "content_block_stop")
            block, index = kind, index + 1
            if empty is None:
                empty = {"type": "thinking", "thinking": ""} if kind == "thinking" else None
                empty = empty or {"type": "text", "text": ""}
            self._sse(
                {"type": "content_block_start", "index": index, "content_block": empty},
                "content_block_start",
            )

        for ev in self._events(job):
            if isinstance(ev, Text):
                for kind, text in (("thinking", ev.reasoning), ("text", ev.content)):
                    if not text:
                        continue
                    if block != kind:
                        open_block(kind)
                    key = "thinking_delta" if kind == "thinking" else "text_delta"
                    field = "thinking" if kind == "thinking" else "text"
                    self._sse(
                        {
                            "type": "content_block_delta",
                            "index": index,
                            "delta": {"type": key, field: text},
                        },
                        "content_block_delta",
                    )
            elif isinstance(ev, ToolCalls):
                for call in ev.calls:
                    fn = call["function"]
                    open_block("tool_use", {"type": "tool_use", "id": call["id"],
                                            "name": fn["name"], "input": {}})  # fmt: skip
                    for piece in P.fragments(fn["arguments"]):
                        delta = {"type": "input_json_delta", "partial_json": piece}
                        self._sse(
                            {"type": "content_block_delta", "index": index, "delta": delta},
                            "content_block_delta",
                        )
            elif isinstance(ev, Failed):
                self._sse(P.APIError(500, ev.message, "api_error").body(anthropic=True), "error")
                return
            elif isinstance(ev, Done):
                done = ev
                if block is None:
                    open_block("text")
                self._sse({"type": "content_block_stop", "index": index}, "content_block_stop")
                self._sse(
                    {
                        "type": "message_delta",
                        "delta": {
                            "stop_reason": P.anthropic_stop(done.finish, done.stop_string),
                            "stop_sequence": done.stop_string,
                        },
                        "usage": {"output_tokens": done.completion_tokens},
                        "dflash": done.stats,
                    },
                    "message_delta",
                )
                self._sse({"type": "message_stop"}, "message_stop")


def _response_items(content: str, reasoning: str, calls: list[dict]) -> list[dict]:
    items = []
    if reasoning:
        item = R.Output.reasoning_item()
        item.update(status="completed", content=[{"type": "reasoning_text", "text": reasoning}])
        items.append(item)
    if content or not calls:
        item = R.Output.text_item()
        item.update(status="completed")
        item["content"].append({"type": "output_text", "text": content, "annotations": []})
        items.append(item)
    return items + [R.Output.call_item(c) for c in calls]


class Server(ThreadingHTTPServer):
    verbose = False  # log each request (serve --verbose)
    daemon_threads = True
    allow_reuse_address = True
    # The listening backlog: the standard library's 5 reset connections under bursts of
    # concurrent clients (an agent's parallel tool calls, a load test) before accept() ran.
    request_queue_size = 128


def make_server(app: App, host: str = "127.0.0.1", port: int = 8080, verbose: bool = False):
    """A ready server (not yet serving): `serve_forever()` blocks, `shutdown()` stops it."""
    handler = type("BoundHandler", (Handler,), {"app": app})
    server = Server((host, port), handler)
    server.verbose = verbose
    return server


def serve_in_thread(server) -> threading.Thread:
    t = threading.Thread(target=server.serve_forever, name="dflash-http", daemon=True)
    t.start()
    return t
