"""The model's one owner: a thread that runs generations one at a time, in arrival order.

HTTP threads submit Jobs and read their events (text pieces, then one "done" or "error");
a Job whose client went away is cancelled and its generation stops at the next round, which
frees the worker for the next request. MLX models and Sessions are not shared across
threads: only this one touches them.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time
from dataclasses import dataclass, field

from ..distributed import LOCAL
from ..engine import GenerationConfig, SamplingParams, Stats, stream_generate
from ..engine.session import uses_drafter
from ..errors import DFlashError
from .sessions import SessionPool
from .text import StopStrings, ThinkingSplitter


@dataclass
class Job:
    prompt: list[int]
    cfg: GenerationConfig
    stop: list[str] = field(default_factory=list)
    thinking: bool | None = None  # None: no thinking split; else whether the answer starts in it
    tags: tuple[str, str] = ("<think>", "</think>")
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass
class Done:
    finish: str  # "stop" | "length" | "cancelled"
    stop_string: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    stats: dict


class Worker:
    """On a sharded target (`world`), rank 0's worker sends each job to the other ranks, whose
    `follow()` runs the same generations in the same order (their text goes nowhere)."""

    def __init__(self, target, runner, mode: str, pool: SessionPool, world=LOCAL):
        self.target, self.runner, self.mode, self.pool = target, runner, mode, pool
        self.world = world
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.busy = False
        self.served = 0
        self.finishes: list[str] = []  # how each job ended, in order (health, tests)
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
            d = json.loads(spec)
            sampling = SamplingParams(d["temperature"], d["top_p"], d["top_k"])
            cfg = job_config(base, max_tokens=d["max_tokens"], sampling=sampling, seed=d["seed"])
            job = Job(d["prompt"], cfg, d["stop"], d["thinking"], tuple(d["tags"]))
            try:
                self._run(job)
            except Exception:  # rank 0 reports errors; a follower just moves on
                pass

    def _send(self, job: Job | None) -> None:
        """Rank 0: the next job (None: shutting down) to the follower ranks."""
        if job is None:
            self.world.send_text(None)
            return
        s = job.cfg.sampling
        spec = {
            "prompt": job.prompt,
            "max_tokens": job.cfg.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "seed": job.cfg.seed,
            "stop": job.stop,
            "thinking": job.thinking,
            "tags": list(job.tags),
        }
        self.world.send_text(json.dumps(spec))

    def submit(self, job: Job) -> Job:
        self.jobs.put(job)
        return job

    @property
    def waiting(self) -> int:
        return self.jobs.qsize()

    def stop(self) -> None:
        if self.thread is not None:
            self.jobs.put(None)
            self.thread.join(timeout=10)

    def _next(self) -> Job | None:
        """The next job not cancelled while it waited (None: stop); sent to the follower ranks
        of a sharded target."""
        with self.world.idle():
            job = self.jobs.get()
        while job is not None and job.cancelled.is_set():
            job = self.jobs.get()
        if self.world.sharded:  # the spec's JSON is for followers; one process has none
            self._send(job)
        return job

    def _loop(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            self.busy = True
            try:
                self._run(job)
            except DFlashError as e:
                job.events.put(("error", str(e)))
            except Exception as e:  # the server keeps serving; the client gets the reason
                job.events.put(("error", f"{type(e).__name__}: {e}"))
                self.finishes.append("error")
            finally:
                self.busy = False
                self.served += 1

    def _run(self, job: Job) -> None:
        session, _ = self.pool.take(job.prompt, uses_drafter(self.mode))
        stats, tokens = Stats(), 0  # (stats: the last chunk's running totals)
        stops = StopStrings(job.stop)
        split = ThinkingSplitter(job.thinking, job.tags) if job.thinking is not None else None
        finish, hit = None, None
        stop_ids = job.cfg.stop_ids
        gen = stream_generate(session, job.prompt, job.cfg)
        try:
            for chunk in gen:
                stats = chunk.stats
                tokens += sum(1 for t in chunk.tokens if t not in stop_ids)
                text, hit = stops.feed(chunk.text)
                self._emit(job, split, text)
                if hit is not None:
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
        if hit is None:
            self._emit(job, split, stops.flush())
        if split is not None:
            reasoning, content = split.flush()
            if reasoning or content:
                job.events.put(("text", reasoning, content))
        self.finishes.append(finish or "length")
        d = stats.to_dict()
        info = {
            k: d[k]
            for k in ("mean_tau", "tau_histogram", "rounds", "draft_rounds", "generation_tps")
        }
        info.update(mode=self.mode, prompt_tps=d["prompt_tps"])
        job.events.put(
            (
                "done",
                Done(
                    finish or "length",
                    hit,
                    len(job.prompt),
                    tokens,
                    len(job.prompt) - stats.prompt_tokens,
                    info,
                ),
            )
        )

    @staticmethod
    def _emit(job: Job, split: ThinkingSplitter | None, text: str) -> None:
        if not text:
            return
        if split is None:
            job.events.put(("text", None, text))
            return
        reasoning, content = split.feed(text)
        if reasoning or content:
            job.events.put(("text", reasoning, content))


def job_config(base: GenerationConfig, **changes) -> GenerationConfig:
    """The server's settings with a request's overrides (checked again by GenerationConfig)."""
    return dataclasses.replace(base, **{k: v for k, v in changes.items() if v is not None})
