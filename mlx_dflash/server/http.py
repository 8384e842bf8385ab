"""The HTTP layer: routes, authentication, server-sent events, disconnects.

Built on the standard library's ThreadingHTTPServer, as mlx-lm's own server is: no extra
dependency, and since generation is one blocking loop on the worker thread, an async stack
would add a thread hop without making streaming or cancellation simpler. A client that goes
away is noticed at the next write (streaming) or by polling its socket while it waits (not
streaming); either way its job is cancelled and the worker moves on.
"""

from __future__ import annotations

import json
import queue
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..errors import DFlashError
from . import anthropic_api, openai_api, responses_api
from . import protocol as P
from . import responses as R
from .app import App
from .events import Done, Failed
from .worker import Job

MAX_BODY = 16 * 2**20
# POST routes -> the request kind; GET routes (/v1/models/ID aside). /metrics counts by these.
POST_KINDS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
}
GET_ROUTES = ("/health", "/v1/health", "/metrics", "/v1/models")
# Request kind -> how its body is read, and its answer written whole or streamed: one module
# per wire API.
PARSE = {"responses": R.parse_responses}
ANSWER = {
    "chat": (openai_api.answer, openai_api.stream),
    "completion": (openai_api.answer, openai_api.stream),
    "messages": (anthropic_api.answer, anthropic_api.stream),
    "responses": (responses_api.answer, responses_api.stream),
}
SOCKET_TIMEOUT_S = 30.0
POLL_S = 0.1


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

    def send_json(self, status: int, body: dict) -> None:
        self.send_bytes(status, json.dumps(body).encode(), "application/json")

    def send_bytes(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def error(self, e: P.APIError) -> None:
        try:
            self.send_json(e.status, e.body(anthropic=self.path.startswith("/v1/messages")))
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

    def events(self, job: Job):
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

    def start_sse(self) -> None:
        self.streaming = True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self.close_connection = True

    def sse(self, data: Any, event: str | None = None) -> None:
        head = f"event: {event}\n" if event else ""
        payload = data if isinstance(data, str) else json.dumps(data)
        self.wfile.write(f"{head}data: {payload}\n\n".encode())
        self.wfile.flush()

    # ---- routes -------------------------------------------------------------------------

    def do_GET(self):
        self._route(self._get)

    def do_POST(self):
        self._route(self._post)

    def _route(self, handle) -> None:
        path = self.path.split("?")[0].rstrip("/")
        try:
            handle(path)
        finally:
            self._count(path)

    def _get(self, path: str) -> None:
        if path in ("/health", "/v1/health"):
            app = self.app
            return self.send_json(
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
            return self.error(
                P.APIError(401, "Missing or wrong API key.", type="authentication_error")
            )
        if path == "/metrics":
            return self.send_bytes(200, self.app.metrics.render(), self.app.metrics.content_type)
        if path == "/v1/models":
            return self.send_json(200, {"object": "list", "data": [self._model_card()]})
        if path.startswith("/v1/models/"):
            try:
                self.app.check_model(path[len("/v1/models/") :])
            except P.APIError as e:
                return self.error(e)
            return self.send_json(200, self._model_card())
        self.error(P.APIError(404, f"No route for GET {path}.", type="not_found_error"))

    def _model_card(self) -> dict:
        return {
            "id": self.app.config.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "dflash-mlx",
        }

    def _post(self, path: str) -> None:
        try:
            if path not in POST_KINDS:
                raise P.APIError(404, f"No route for POST {path}.", type="not_found_error")
            if not self._authorized():
                raise P.APIError(401, "Missing or wrong API key.", type="authentication_error")
            body = self._body()
            kind = POST_KINDS[path]
            req = PARSE[kind](body) if kind in PARSE else P.parse_request(kind, body)
            job = self.app.prepare(req)
        except P.APIError as e:
            return self.error(e)
        except DFlashError as e:
            return self.error(P.APIError(400, str(e)))
        self.app.worker.submit(job)
        whole, streamed = ANSWER[req.kind]
        try:
            (streamed if req.stream else whole)(self, req, job)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError):
            job.cancel()


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
