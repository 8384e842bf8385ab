"""Rounds to text: the streaming generator every command (and the server) builds on.

Each chunk describes itself, as mlx-lm's GenerationResponse does: its text and tokens, and the
generation's running totals (tokens, tokens/s, tau so far, peak memory, finish reason), so that
no caller counts rounds again.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import mlx.core as mx

from .loop import generate_rounds
from .session import GenerationConfig, Round, Session
from .stats import Stats


@dataclass
class Chunk:
    """One round's new text, and the generation so far.

    `stats` is the generation's running Stats (one object, updated as the rounds come: at the
    last chunk it is the whole generation's); the other numbers are its values at this chunk.
    """

    text: str
    tokens: list[int]
    round: Round
    stats: Stats
    prompt_tokens: int  # prefilled by this generation (a cached prefix is not)
    generation_tokens: int
    generation_tps: float
    mean_tau: float
    peak_memory: float  # GB
    finish_reason: str | None  # "stop" | "length" on the last chunk, else None


def stream_generate(
    session: Session, prompt: list[int], cfg: GenerationConfig
) -> Generator[Chunk, None, None]:
    """Decode rounds into text as tokens are accepted (stop tokens are not printed)."""
    detok = session.target.tokenizer.detokenizer
    detok.reset()
    stats = Stats()
    for rnd in generate_rounds(session, prompt, cfg):
        for t in rnd.tokens:
            if t not in cfg.stop_ids:
                detok.add_token(t)
        if rnd.finished:
            detok.finalize()
        stats.add(rnd)
        stats.peak_memory = mx.get_peak_memory() / 1e9
        yield Chunk(
            detok.last_segment,
            rnd.tokens,
            rnd,
            stats,
            stats.prompt_tokens,
            stats.tokens,
            stats.generation_tps,
            stats.mean_tau,
            stats.peak_memory,
            rnd.finished,
        )
