"""The model's one owner: a thread that runs generations in arrival order, one at a time or
`max_batch` at once (batched rounds, engine/batch.py: each generation a greenlet on this
thread, their target forwards packed into one).

HTTP threads submit Jobs and read their events (text pieces, then one "done" or "error");
a Job whose client went away is cancelled and its generation stops at the next round, which
frees its place for the next request. MLX models and Sessions are not shared across threads:
only this one touches them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from ..distributed import LOCAL
from ..engine import GenerationConfig, SamplingParams, Stats, stream_generate
from ..engine.batch import BatchedTarget, Batcher
from ..engine.corpus import AnswerCorpus
from ..engine.device import wired
from ..engine.grammar import GrammarSpec
from ..engine.session import uses_drafter
from ..errors import DFlashError
from .events import Done, Failed, Logprobs
from .kept_answers import AnswerLog
from .sessions import SessionPool
from .text import AnswerText, StopStrings
from .tools import Tools

# Prefill chunk of a batched row: each chunk rides in a packed forward with the other rows'
# rounds, so a shorter one keeps their tokens coming while a long prompt is read.
BATCH_CHUNK = 128


@dataclass
class Job:
    prompt: list[int]
    cfg: GenerationConfig
    stop: list[str] = field(default_factory=list)
    thinking: bool | None = None  # None: no thinking split; else whether the answer starts in it
    tags: tuple[str, str] = ("<think>", "</think>")
    tools: Tools | None = None  # tool calls are parsed out of the answer (unless choice "none")
    inside: str | None = None  # the answer starts inside a call the prompt opened (forced choice)
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


class Worker:
    """On a sharded target (`world`), rank 0's worker sends each job to the other ranks, whose
    `follow()` runs the same generations in the same order (their text goes nowhere)."""

    def __init__(
        self, target, runner, mode: str, pool: SessionPool, world=LOCAL, max_batch: int = 1
    ):
        self.target, self.runner, self.mode, self.pool = target, runner, mode, pool
        self.world = world
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        # The pool's Sessions run on a BatchedTarget where rows batch (serving_target).
        self.batcher = pool.target.batcher
        self.max_batch = max(1, max_batch) if self.batcher is not None else 1
        self.running = 0  # generations under way
        self.served = 0
        self.finishes: list[str] = []  # how each job ended, in order (health, tests)
        # called with each job's Done (the server's metrics)
        self.on_done: Callable[[Done], None] | None = None
        # serve --keep-answers: where rank 0 keeps each answer
        self.answer_log: AnswerLog | None = None
        # Set while the worker waits for a job with nothing under way: every row has ended
        # and left the batch's arena (a client has its answer a little before that).
        self.quiet = threading.Event()
        self.thread = None
        if world.is_main:
            self.thread = threading.Thread(target=self._loop, name="dflash-worker", daemon=True)
            self.thread.start()

    def follow(self, base: GenerationConfig) -> None:
        """A follower rank: run rank 0's jobs until it stops."""
        while True:
            with self.world.idle():
                spec = self.world.send_text(None)
            if spec is None:
                return
            job = job_from_json(base, spec)
            with contextlib.suppress(Exception):  # rank 0 reports errors; a follower moves on
                self._run(job)

    def submit(self, job: Job) -> Job:
        self.jobs.put(job)
        return job

    @property
    def waiting(self) -> int:
        return self.jobs.qsize()

    @property
    def busy(self) -> bool:
        return self.running > 0

    def wait_quiet(self, timeout: float) -> bool:
        """Wait until nothing is under way or waiting (False if `timeout` seconds pass)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.quiet.wait(deadline - time.monotonic()) and self.jobs.empty():
                return True
            time.sleep(0.01)
        return False

    def stop(self) -> None:
        if self.thread is not None:
            self.jobs.put(None)
            self.thread.join(timeout=10)

    def _next(self, block: bool = True) -> Job | None | Literal[False]:
        """The next job not cancelled while it waited (None: stop; False: none waiting and
        `block` off); sent to the follower ranks of a sharded target."""
        while True:
            try:
                with self.world.idle():
                    if block:
                        self.quiet.set()
                    job = self.jobs.get(block=block)
            except queue.Empty:
                return False
            finally:
                self.quiet.clear()
            if job is None or not job.cancelled.is_set():
                break
        if self.world.sharded:  # to the follower ranks (None: shutting down); one process has none
            self.world.send_text(None if job is None else job_to_json(job))
        return job

    def _loop(self) -> None:
        if self.batcher is not None:
            self._loop_batched(self.batcher)
            return
        while True:
            job = self._next()
            if not isinstance(job, Job):
                return
            self._serve(job)

    def _loop_batched(self, batcher: Batcher) -> None:
        """Admit jobs up to max_batch between packed forwards; each runs as a row."""
        with wired(self.target.model):  # once for all rows (theirs nest inside it)
            while True:
                while batcher.active < self.max_batch:
                    job = self._next(block=batcher.active == 0)
                    if job is None:
                        return
                    if job is False:
                        break
                    batcher.add(functools.partial(self._serve, job))
                batcher.tick()

    def _serve(self, job: Job) -> None:
        """One job to its end; its errors go to its client, never past it."""
        self.running += 1
        try:
            self._run(job)
        except DFlashError as e:
            job.events.put(Failed(str(e)))
        except Exception as e:  # the server keeps serving; the client gets the reason
            job.events.put(Failed(f"{type(e).__name__}: {e}"))
            self.finishes.append("error")
        finally:
            self.running -= 1
            self.served += 1

    def _run(self, job: Job) -> None:
        session, _ = self.pool.take(job.prompt, uses_drafter(self.mode))
        stats = Stats()  # (the last chunk's running totals)
        answer: list[int] = []  # its tokens, stop tokens aside (the count, the lookup corpus)
        stops = StopStrings(job.stop)
        out = AnswerText(job, self.target.tokenizer)
        finish, hit = None, None
        stop_ids = job.cfg.stop_ids
        cfg = job.cfg
        if self.batcher is not None:  # a long prompt's chunks delay every row's next token
            cfg = dataclasses.replace(cfg, prefill_chunk=min(cfg.prefill_chunk, BATCH_CHUNK))
        gen = stream_generate(session, job.prompt, cfg)
        try:
            for chunk in gen:
                stats = chunk.stats
                answer += [t for t in chunk.tokens if t not in stop_ids]
                if chunk.round.logprobs is not None:
                    pairs = zip(chunk.tokens, chunk.round.logprobs, strict=True)
                    kept = [(t, lp) for t, lp in pairs if t not in stop_ids]
                    if kept:
                        job.events.put(Logprobs([t for t, _ in kept], [lp for _, lp in kept]))
                text, hit = stops.feed(chunk.text)
                # (out.feed is True when a call ended and parallel calls are off)
                if out.feed(text) or hit is not None:
                    finish = "stop"
                    break
                if chunk.round.finished:
                    finish = chunk.round.finished
                    break
                # Rank 0's client decides for every rank of a sharded target.
                if self.world.agree([job.cancelled.is_set()])[0]:
                    finish = "cancelled"
                    break
        finally:
            gen.close()
            self.pool.give_back(session)
            # Later requests look up in this answer (every rank of a sharded target adds the
            # same one, so their trees stay the same); a copy of the server's, never a file's.
            if isinstance(cfg.lookup_corpus, AnswerCorpus):
                cfg.lookup_corpus.add(answer)
                if self.answer_log is not None:
                    self.answer_log.append(answer)
        if hit is None:
            out.feed(stops.flush())
        out.flush()
        if out.called and finish in ("stop", None):
            finish = "tool_calls"
        self.finishes.append(finish or "length")
        d = stats.to_dict()
        info = {
            k: d[k]
            for k in ("mean_tau", "tau_histogram", "rounds", "draft_rounds", "generation_tps")
        }
        info.update(mode=self.mode, prompt_tps=d["prompt_tps"])
        info.update(time_prefill_s=d["time_prefill_s"], time_decode_s=stats.t_decode)
        done = Done(
            finish or "length", hit, len(job.prompt), len(answer), len(job.prompt) - stats.prompt_tokens,
            info,
        )  # fmt: skip
        if self.on_done is not None:
            self.on_done(done)
        job.events.put(done)


# What a request sets in the server's GenerationConfig (http.py), and what a Job carries beside
# it: all of it reaches the follower ranks of a sharded target, which must run the same rounds
# (a grammar, or logprobs, changes which forwards a round makes).
REQUEST_SETTINGS = ("max_tokens", "sampling", "seed", "logprobs", "grammar")
JOB_FIELDS = ("prompt", "stop", "thinking", "tags", "tools", "inside")


def job_to_json(job: Job) -> str:
    """A job as rank 0 sends it to the followers: its fields and the request's settings."""
    cfg = {k: getattr(job.cfg, k) for k in REQUEST_SETTINGS}
    for k in ("sampling", "grammar"):
        cfg[k] = None if cfg[k] is None else dataclasses.asdict(cfg[k])
    fields = {k: getattr(job, k) for k in JOB_FIELDS}
    fields["tools"] = None if job.tools is None else dataclasses.asdict(job.tools)
    return json.dumps({"job": fields, "cfg": cfg})


def job_from_json(base: GenerationConfig, text: str) -> Job:
    """A follower's copy of rank 0's job (job_to_json), on its own server settings `base`."""
    d = json.loads(text)
    cfg, fields = d["cfg"], d["job"]
    cfg["sampling"] = SamplingParams(**cfg["sampling"])
    cfg["grammar"] = None if cfg["grammar"] is None else GrammarSpec(**cfg["grammar"])
    fields["tags"] = tuple(fields["tags"])
    fields["tools"] = None if fields["tools"] is None else Tools(**fields["tools"])
    return Job(cfg=dataclasses.replace(base, **cfg), **fields)


def serving_target(target, world, max_batch: int):
    """The target a server's Sessions run on: where up to `max_batch` > 1 rows batch, one whose
    forwards meet in a Batcher (engine/batch.py); else the target itself. Batched rounds need
    every row on this process: a sharded target runs one request at a time."""
    if max_batch > 1 and not world.sharded:
        return BatchedTarget(target, Batcher(target))
    return target


def job_config(base: GenerationConfig, **changes) -> GenerationConfig:
    """The server's settings with a request's overrides (checked again by GenerationConfig)."""
    return dataclasses.replace(base, **{k: v for k, v in changes.items() if v is not None})
