"""`serve --keep-answers FILE`: the answers a server adds to its lookup corpus, kept on disk
and read back at start, so what it learned from an agent's session survives a restart
(engine/corpus.py AnswerLog; docs/lookup.md)."""

from __future__ import annotations

import hashlib
import json

from ..engine.corpus import AnswerCorpus, AnswerLog, join_answers, split_answers
from ..errors import DFlashError


def tokenizer_id(tokenizer) -> str:
    """A fingerprint of the vocabulary: a log's token ids mean the same text only under it."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def open_answer_log(path: str, corpus: AnswerCorpus | None, lookup: bool, tokenizer, model: str,
                    world) -> AnswerLog | None:  # fmt: skip
    """The log at `path` (created if new), its answers added to the server's corpus on every
    rank (rank 0 reads the file: the others may run on Macs without it, and their trees must
    be rank 0's); only rank 0's log is returned for appending to, others get None."""
    if not lookup:
        raise DFlashError(
            "--keep-answers feeds the lookup corpus, and this mode drafts no lookup branches: "
            "use --mode ddtree --budget auto or --mode lookup."
        )
    if corpus is None:
        raise DFlashError(
            "--keep-answers feeds the lookup corpus, which --lookup-corpus none turns off."
        )
    log = AnswerLog(path, tokenizer_id(tokenizer))
    kept = log.read() if world.is_main else []
    if world.sharded:
        kept = split_answers(world.agree_seq(join_answers(kept)))
    corpus.extend(kept)
    if world.is_main:
        log.start(model)
        log.kept = len(kept)
        return log
    return None
