"""Training data for a DFlash drafter: prompts answered by the target itself (docs/training.md).

A drafter learns to predict what *its* target will say, so the responses come from the target
(greedy or sampled), never from the dataset. Each answered prompt becomes one JSONL record
`{"id", "tokens", "prompt_len", "temp"}`; the loss mask is implicit (positions >= prompt_len are
the response). Shards are appended batch by batch and re-reading them skips answered ids, so an
interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import DFlashError
from ..prompt_files import read_prompt_file
from ..prompts import encode_prompt, stop_ids


def read_prompts(paths: Iterable[str | Path]) -> list[str]:
    """Prompt strings from prompt files (prompt_files.py: the first known text field of each
    record, or a chat record's first turn)."""
    return [p for path in paths for p in read_prompt_file(path)]


def encode(tokenizer, prompt: str) -> list[int]:
    """Through the chat template when the target has one, else BOS + text (as generate does)."""
    return encode_prompt(tokenizer, prompt)


def eos_ids(tokenizer) -> set[int]:
    return set(stop_ids(tokenizer))


def _pick(logits: mx.array, temps: mx.array) -> mx.array:
    """Per-row greedy (temp 0) or temperature sampling, in one batched op."""
    greedy = mx.argmax(logits, axis=-1)
    t = mx.maximum(temps, 1e-4)[:, None]
    sampled = mx.random.categorical(logits / t)
    return mx.where(temps > 0, sampled, greedy)


def batch_generate(
    model,
    prompts: list[list[int]],
    temps: list[float],
    max_tokens: int,
    stop: set[int],
) -> list[list[int]]:
    """Answer left-padded prompts together with mlx-lm's BatchKVCache; each stops at its EOS."""
    from mlx_lm.models.cache import BatchKVCache

    B = len(prompts)
    width = max(len(p) for p in prompts)
    pad = [width - len(p) for p in prompts]
    rows = np.zeros((B, width), dtype=np.int32)
    for i, p in enumerate(prompts):
        rows[i, pad[i] :] = p
    cache = [BatchKVCache(pad) for _ in model.layers]
    t = mx.array(temps, dtype=mx.float32)
    logits = model(mx.array(rows), cache=cache)[:, -1, :]
    out: list[list[int]] = [[] for _ in range(B)]
    live = np.arange(B)  # the rows still answering, in the cache's current order
    stop_arr = np.array(sorted(stop), dtype=np.int64)
    for _ in range(max_tokens):
        tok = _pick(logits.astype(mx.float32), t)
        mx.eval(tok)
        toks = np.array(tok)
        for j, i in enumerate(live):
            out[i].append(int(toks[j]))
        going = ~np.isin(toks, stop_arr)
        if not going.any():
            break
        if not going.all():
            # Finished rows leave the batch: a third of GSM8K answers run to max_tokens, and
            # computing the others' padding until then was ~27% of the work.
            keep = mx.array(np.flatnonzero(going))
            for c in cache:
                c.filter(keep)
            live, tok, t = live[going], tok[keep], t[keep]
        logits = model(tok[:, None], cache=cache)[:, -1, :]
    return out


def done_ids(shard: Path) -> set[int]:
    """Ids already answered in a shard (a truncated last line from a crash is ignored)."""
    if not shard.exists():
        return set()
    ids = set()
    for line in shard.read_text().splitlines():
        try:
            ids.add(int(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return ids


def answer_prompts(
    target,
    prompts: list[str],
    shard: str | Path,
    *,
    temps: tuple[float, ...] = (0.0,),
    max_tokens: int = 256,
    batch: int = 32,
    seed: int = 0,
    on_batch: Callable[[int], None] | None = None,
) -> Path:
    """Answer every prompt not yet in `shard` with the target; prompt i uses temps[i % len]."""
    shard = Path(shard)
    shard.parent.mkdir(parents=True, exist_ok=True)
    skip = done_ids(shard)
    todo = [i for i in range(len(prompts)) if i not in skip]
    tok = target.tokenizer
    stop = eos_ids(tok)
    mx.random.seed(seed + len(skip))
    encoded = {i: encode(tok, prompts[i]) for i in todo}
    # Similar lengths together: less padding.
    todo.sort(key=lambda i: len(encoded[i]))
    with shard.open("a") as f:
        for b in range(0, len(todo), batch):
            ids = todo[b : b + batch]
            ts = [float(temps[i % len(temps)]) for i in ids]
            answers = batch_generate(target.model, [encoded[i] for i in ids], ts, max_tokens, stop)
            for i, t, ans in zip(ids, ts, answers, strict=True):
                rec = {"id": i, "prompt_len": len(encoded[i]), "temp": t}
                rec["tokens"] = encoded[i] + ans
                f.write(json.dumps(rec) + "\n")
            f.flush()
            if on_batch is not None:
                on_batch(len(ids))
    return shard


def story_prompts(target, n: int, seed: int = 0, batch: int = 64, max_words: int = 6) -> list[str]:
    """Openings of the target's own sampled stories (first 2..max_words words).

    Sampled at temperature 1, so they are diverse yet in the target's own vocabulary; longer
    openings make even greedy answers diverse (short ones all fall into the same few stories).
    """
    rng = np.random.default_rng(seed)
    tok = target.tokenizer
    bos = tok.bos_token_id if tok.bos_token_id is not None else 1
    mx.random.seed(seed)
    out: list[str] = []
    while len(out) < n:
        b = min(batch, n - len(out))
        stories = batch_generate(target.model, [[bos]] * b, [1.0] * b, 4 * max_words, eos_ids(tok))
        for s in stories:
            words = tok.decode(s).split()
            if len(words) >= 2:
                out.append(" ".join(words[: int(rng.integers(2, max_words + 1))]))
    return out[:n]


def load_records(paths: Iterable[str | Path], min_response: int = 2) -> list[dict]:
    """Answered records from shards, keeping those with a response long enough to train on."""
    recs = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if len(rec["tokens"]) - rec["prompt_len"] >= min_response:
                recs.append(rec)
    if not recs:
        raise DFlashError("No usable training records (answered prompts) were found.")
    return recs
