"""What the server's handlers share: the loaded pair, the server's settings and defaults, the
worker; and a checked request turned into a Job (the prompt rendered, its settings and grammar,
its stop strings), before any wire API's answer is written (http.py routes to them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..distributed import LOCAL
from ..engine import GenerationConfig, SamplingParams
from ..engine.corpus import live_corpus
from ..prompts import has_template, render, stop_ids, xtc_special_ids
from . import protocol as P
from . import responses as R
from .kept_answers import open_answer_log
from .metrics import Metrics
from .sessions import SessionPool
from .structured import check_grammar, tool_grammar
from .text import prompt_opens_thinking, thinking_tags
from .tools import forced_prefix
from .worker import Job, Worker, job_config, serving_target


@dataclass
class ServerConfig:
    model_name: str
    aliases: tuple[str, ...] = ()
    api_key: str | None = None
    max_tokens: int = 512  # when a request does not say
    thinking: bool | None = None  # server-wide enable_thinking (None: the template's default)
    cache_bytes: int = 2 * 2**30
    cache_sessions: int = 8
    # A quantized KV cache for every session (--kv-bits; models/cache.py KVQuantization)
    kv: Any = None
    max_kv_size: int | None = None  # a rotating KV cache for every session (--max-kv-size)
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
        self.xtc_special = xtc_special_ids(self.tokenizer)  # (a request's XTC spares these)
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
        pool = SessionPool(served, runner, config.cache_bytes, config.cache_sessions, config.kv,
                           config.max_kv_size)  # fmt: skip
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
            s.min_p if req.min_p is None else float(req.min_p),
            s.min_tokens_to_keep,
            s.xtc_probability if req.xtc_probability is None else float(req.xtc_probability),
            s.xtc_threshold if req.xtc_threshold is None else float(req.xtc_threshold),
            s.xtc_special or self.xtc_special,
        )
        cfg = job_config(self.base, max_tokens=max_tokens, sampling=sampling, seed=req.seed,
                         logprobs=req.logprobs, grammar=self._grammar(req, thinking))  # fmt: skip
        tags = self.tags or ("<think>", "</think>")
        return Job(ids, cfg, req.stop, thinking, tags, req.tools, inside)

    def _grammar(self, req: P.Request, thinking: bool | None):
        """What the answer must follow: a forced call's strict arguments, else the requested
        format; compiled here so that a bad schema is a 400 before anything streams."""
        tools = req.tools
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
