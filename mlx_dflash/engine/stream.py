"""Rounds to text: the streaming generator every command (and the server) builds on."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from .loop import generate_rounds
from .session import GenerationConfig, Round, Session


@dataclass
class Chunk:
    text: str
    tokens: list[int]
    round: Round


def stream_generate(session: Session, prompt: list[int], cfg: GenerationConfig) -> Iterator[Chunk]:
    """Decode rounds into text as tokens are accepted (stop tokens are not printed)."""
    detok = session.target.tokenizer.detokenizer
    detok.reset()
    for rnd in generate_rounds(session, prompt, cfg):
        for t in rnd.tokens:
            if t not in cfg.stop_ids:
                detok.add_token(t)
        if rnd.finished:
            detok.finalize()
        yield Chunk(detok.last_segment, rnd.tokens, rnd)
