"""Training data for a DFlash drafter: prompts answered by the target itself (docs/training.md).

A drafter learns to predict what *its* target will say, so the responses come from the target
(greedy or sampled), never from the dataset. Each answered prompt becomes one JSONL record
`{"id", "tokens", "prompt_len", "temp"}`; the loss mask is implicit (positions >= prompt_len are
the response). Shards are appended batch by batch and re-reading them skips answered ids, so an
interrupted run resumes where it stopped.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterable
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import DFlashError
from ..prompts import encode_prompt, stop_ids
from .forward import top_logprobs
from .tapstore import SOFT_IDS, SOFT_LOGP, SOFT_TOP_K, TapStore, record_key


def encode(tokenizer, prompt: str) -> list[int]:
    """Through the chat template when the target has one, else BOS + text (as generate does)."""
    return encode_prompt(tokenizer, prompt)


def batch_generate(
    model,
    prompts: list[list[int]],
    temps: list[float],
    max_tokens: int,
    stop: Iterable[int],
    tapper: TapRecorder | None = None,
) -> list[list[int]]:
    """Answer left-padded prompts together with mlx-lm's BatchKVCache; each stops at its EOS.

    With a `tapper` the layers run here (not through `model`) so the tapped hidden states the
    answer passes through anyway are kept: training then needs no second pass over the data.
    """
    from mlx_lm.models.cache import BatchKVCache

    B = len(prompts)
    width = max(len(p) for p in prompts)
    pad = [width - len(p) for p in prompts]
    rows = np.zeros((B, width), dtype=np.int32)
    for i, p in enumerate(prompts):
        rows[i, pad[i] :] = p
    cache = [BatchKVCache(pad) for _ in model.layers]
    forward = model if tapper is None else tapper.forward
    t = mx.array(temps, dtype=mx.float32)
    live = np.arange(B)  # the rows still answering, in the cache's current order
    if tapper is not None:
        tapper.start(pad, live)
    logits = forward(mx.array(rows), cache=cache)[:, -1, :]
    out: list[list[int]] = [[] for _ in range(B)]
    stop_arr = np.array(sorted(stop), dtype=np.int64)
    for n in range(max_tokens):
        # Per row, greedy (temp 0) or temperature sampling, in one batched op.
        logits = logits.astype(mx.float32)
        sampled = mx.random.categorical(logits / mx.maximum(t, 1e-4)[:, None])
        tok = mx.where(t > 0, sampled, mx.argmax(logits, axis=-1))
        mx.eval(tok)
        toks = np.array(tok)
        for j, i in enumerate(live):
            out[i].append(int(toks[j]))
        going = ~np.isin(toks, stop_arr)
        if not going.any() or n == max_tokens - 1:  # nothing follows the last token
            break
        if not going.all():
            # Finished rows leave the batch: a third of GSM8K answers run to max_tokens, and
            # computing the others' padding until then was ~27% of the work.
            keep = mx.array(np.flatnonzero(going))
            for c in cache:
                c.filter(keep)
            live, tok, t = live[going], tok[keep], t[keep]
            if tapper is not None:
                tapper.live = live
        logits = forward(tok[:, None], cache=cache)[:, -1, :]
    return out


class TapRecorder:
    """Keeps the tapped layers' hidden states of every row while `batch_generate` answers.

    Only for targets whose layers all take one attention mask (llama, qwen2, qwen3, mistral
    without sliding windows: the families the trainer supports). Each row's taps cover its
    prompt and every answer token that was fed back; the last token is never fed (nothing
    follows it), and its taps, which no training block reads (context stops before the
    anchor), are left as zeros.
    """

    def __init__(self, target, tap_ids, top_k: int = SOFT_TOP_K):
        self.target, self.tap_ids, self.top_k = target, list(tap_ids), top_k
        self.keep = set(self.tap_ids)

    @staticmethod
    def supports(target) -> bool:
        inner = target.inner
        return getattr(inner, "swa_idx", None) is None and all(
            hasattr(layer, "self_attn") for layer in target.layers
        )

    def start(self, pad: list[int], live: np.ndarray) -> None:
        self.pad, self.live, self.rows = pad, live, None

    def forward(self, tokens: mx.array, cache: list) -> mx.array:
        from mlx_lm.models.base import create_attention_mask

        target = self.target
        h = target.embed(tokens)
        mask = create_attention_mask(h, cache[0])
        tapped = {}
        for i, (layer, c) in enumerate(zip(target.layers, cache, strict=True)):
            h = layer(h, mask, cache=c)
            if i in self.keep:
                tapped[i] = h
        taps = mx.concatenate([tapped[i] for i in self.tap_ids], axis=-1).astype(mx.float16)
        logits = target.output_logits(target.inner.norm(h[:, -1:]))
        # The distribution the next answer token is drawn from, as its top_k log-probabilities:
        # soft targets for distillation, free here, a full forward pass later.
        top, top_logp = top_logprobs(logits[:, 0], self.top_k)
        top_logp = top_logp.astype(mx.float16)
        mx.eval(taps, logits, top, top_logp)
        taps, top, top_logp = np.array(taps), np.array(top), np.array(top_logp)
        if self.rows is None:  # the prompts' prefill: drop each row's left padding
            self.rows = [[taps[i, p:]] for i, p in enumerate(self.pad)]
            self.soft = [[(top[i], top_logp[i])] for i in range(len(self.pad))]
        else:
            for j, i in enumerate(self.live):
                self.rows[i].append(taps[j])
                self.soft[i].append((top[j], top_logp[j]))
        return logits

    def soft_targets(self, i: int, answer_len: int) -> tuple[np.ndarray, np.ndarray]:
        """Row i's (top ids (answer_len, k) int32, their log-probs float16): entry j is the
        distribution answer token j was drawn from."""
        ids, logp = zip(*self.soft[i][:answer_len], strict=True)
        return np.stack(ids).astype(np.int32), np.stack(logp)

    def row(self, i: int, length: int) -> np.ndarray:
        """Row i's taps for a sequence of `length` tokens (zeros where none were computed)."""
        x = np.concatenate([np.atleast_2d(a) for a in self.rows[i]])[:length]
        if x.shape[0] < length:
            x = np.concatenate([x, np.zeros((length - x.shape[0], x.shape[1]), x.dtype)])
        return x


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
    tap_ids=None,
) -> Path:
    """Answer every prompt not yet in `shard` with the target; prompt i uses temps[i % len].

    With `tap_ids` each batch's taps, and the target's top-k log-probabilities at every answer
    token (soft targets), are also written to the tap store beside the shard
    (`tapstore.TapStore`), keyed by prompt id, as training reads them.
    """
    shard = Path(shard)
    shard.parent.mkdir(parents=True, exist_ok=True)
    skip = done_ids(shard)
    todo = [i for i in range(len(prompts)) if i not in skip]
    tok = target.tokenizer
    stop = stop_ids(tok)
    mx.random.seed(seed + len(skip))
    encoded = {i: encode(tok, prompts[i]) for i in todo}
    # Similar lengths together: less padding.
    todo.sort(key=lambda i: len(encoded[i]))
    tapper = store = None
    if tap_ids is not None and TapRecorder.supports(target):
        tapper, store = TapRecorder(target, tap_ids), TapStore(shard.parent, tap_ids)
    with shard.open("a") as f:
        for b in range(0, len(todo), batch):
            ids = todo[b : b + batch]
            ts = [float(temps[i % len(temps)]) for i in ids]
            answers = batch_generate(
                target.model, [encoded[i] for i in ids], ts, max_tokens, stop, tapper
            )
            if store is not None:  # before the answers: an answer in the shard has its taps
                arrays = {}
                for j, (i, ans) in enumerate(zip(ids, answers, strict=True)):
                    key = record_key({"id": i})
                    arrays[key] = tapper.row(j, len(encoded[i]) + len(ans))
                    top, top_logp = tapper.soft_targets(j, len(ans))
                    arrays[key + SOFT_IDS], arrays[key + SOFT_LOGP] = top, top_logp
                store.add(arrays)
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
        stories = batch_generate(target.model, [[bos]] * b, [1.0] * b, 4 * max_words, stop_ids(tok))
        for s in stories:
            words = tok.decode(s).split()
            if len(words) >= 2:
                out.append(" ".join(words[: int(rng.integers(2, max_words + 1))]))
    return out[:n]


def load_records(
    paths: Iterable[str | Path], min_response: int = 2, own: str | Path | None = None
) -> list[dict]:
    """Answered records from shards (.jsonl or .jsonl.gz), keeping those with a response long
    enough to train on.

    With `own` (the run's own answers), records of the other shards are keyed "<folder>/<id>"
    in the tap store, since every shard numbers its prompts from 0.
    """
    recs = []
    for path in paths:
        path = Path(path)
        opener = gzip.open if path.suffix == ".gz" else open
        prefix = "" if own is None or path == Path(own) else f"{path.parent.name}/"
        try:
            with opener(path, "rt") as f:
                lines = f.readlines()
        except (OSError, EOFError, UnicodeDecodeError) as e:
            raise DFlashError(f"{path} is not a readable answers file ({e}).") from None
        for line in lines:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a truncated last line from a crash
            if not isinstance(rec, dict) or not {"id", "tokens", "prompt_len"} <= rec.keys():
                raise DFlashError(
                    f"{path} is not an answers file: its lines need id, tokens and prompt_len."
                )
            if len(rec["tokens"]) - rec["prompt_len"] >= min_response:
                if prefix:
                    rec["key"] = f"{prefix}{rec['id']}"
                recs.append(rec)
    if not recs:
        raise DFlashError("No usable training records (answered prompts) were found.")
    return recs
