"""`dflash-mlx train`: train a DFlash drafter for any target (algorithm.md §7).

The target stays frozen: its taps are computed on the fly for each batch, and its embeddings and
LM head are borrowed, never updated. Every sequence carries many blocks at random anchors inside
the response; all of them run in one batched attention whose boolean mask gives each block the
context strictly before its anchor, bidirectional attention inside itself and nothing of the
other blocks. The forward reuses `DFlashDrafter`'s own submodules, so the trained weights are
the inference weights, and the output folder is a z-lab checkpoint that `convert` and
`load_drafter` read as is.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import typer
from mlx.utils import tree_flatten, tree_unflatten

from .drafter import (
    DRAFT_VOCAB_FILE,
    DFlashDrafter,
    DrafterRunner,
    drafter_logits,
    init_drafter,
    load_drafter,
    write_draft_vocab,
)
from .drafter_config import DRAFTER_ARCHITECTURE, DrafterConfig, default_target_layer_ids
from .errors import DFlashError

STATE_FILE = "trainer_state.json"
OPT_FILE = "optimizer.npz"  # not *.safetensors: load_drafter reads those
TAPS_FILE = "cache/taps.safetensors"  # in a subfolder: load_drafter reads OUT/*.safetensors


@dataclass
class TrainConfig:
    steps: int = 1000
    lr: float = 1e-3
    warmup: int = 50
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    clip: float = 1.0
    batch: int = 8  # sequences per step
    anchors: int = 16  # blocks per sequence
    gamma: float = 7.0
    max_len: int = 512
    seed: int = 0
    eval_every: int = 0
    eval_tokens: int = 96
    save_every: int = 0
    cache_taps: bool = False
    loss_vocab: str = "full"  # "corpus": softmax over the response tokens + sampled negatives
    precondition: bool = True  # train fc on taps scaled to unit mean |x| per feature
    negatives: int = 1024
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------- drafter config


def new_drafter_config(
    target,
    layers: int = 2,
    taps: list[int] | None = None,
    block_size: int = 16,
    mask_token_id: int | None = None,
    heads: int | None = None,
    window: int | None = None,
) -> DrafterConfig:
    """A fresh drafter shaped like the target's layers (same width, heads and MLP).

    `heads` overrides the head count (head_dim = hidden / heads): fewer heads train faster.
    `window`: every layer sees only the last `window` positions (published `sliding_attention`
    layers, bidirectional inside the block): fewer keys to choose from, and cheaper layers.
    """
    tc = target.text_config
    hidden = target.hidden_size
    t_heads = int(tc["num_attention_heads"])
    t_kv = int(tc.get("num_key_value_heads") or t_heads)
    same = heads is None or heads == t_heads
    heads = heads or t_heads
    taps = taps or default_target_layer_ids(target.num_layers, layers)
    raw = {
        "architectures": [DRAFTER_ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": t_kv if same else math.gcd(heads, t_kv),
        "head_dim": int(tc.get("head_dim") or hidden // heads) if same else hidden // heads,
        "intermediate_size": int(tc["intermediate_size"]),
        "rms_norm_eps": float(tc.get("rms_norm_eps", 1e-6)),
        "vocab_size": target.vocab_size,
        "max_position_embeddings": int(tc.get("max_position_embeddings", 4096)),
        "rope_theta": float(tc.get("rope_theta", 10000.0)),
        "rope_scaling": tc.get("rope_scaling"),
        "num_target_layers": target.num_layers,
        "layer_types": ["sliding_attention" if window else "full_attention"] * layers,
        "sliding_window": window,
        "dflash_config": {
            "block_size": block_size,
            "mask_token_id": pick_mask_token(target) if mask_token_id is None else mask_token_id,
            "target_layer_ids": list(taps),
            **({"is_causal": False} if window else {}),
        },
    }
    return DrafterConfig.from_dict(raw)


def pick_mask_token(target) -> int:
    """A token the target should never emit: unk or pad when they are not an end token."""
    from .train_data import eos_ids

    tok = target.tokenizer
    stops = eos_ids(tok)
    for name in ("unk_token_id", "pad_token_id"):
        tid = getattr(tok, name, None)
        if tid is not None and tid not in stops and 0 <= tid < target.vocab_size:
            return int(tid)
    return target.vocab_size - 1


# ---------------------------------------------------------------- target taps


def target_taps(target, tokens: mx.array) -> mx.array:
    """Taps (B, T, n_taps*H) of right-padded sequences: one causal pass, no gradient.

    Right padding never reaches real positions under a causal mask, so no padding mask.
    """
    h = target.embed(tokens)
    wanted = {t: None for t in target.tap_ids}
    last = max(wanted)
    for i, layer in enumerate(target.layers[: last + 1]):
        h = layer(h, mask="causal", cache=None)
        if i in wanted:
            wanted[i] = h
    return mx.stop_gradient(mx.concatenate([wanted[t] for t in target.tap_ids], axis=-1))


# ---------------------------------------------------------------- training forward


def context_masks(cfg: DrafterConfig, anchors: mx.array, T: int) -> dict:
    """Per layer kind: (context mask (B, 1, 1, m*bs, T), in-block mask (bs, bs) or None).

    Context key p is visible to a block at anchor a iff p < a (its taps are known at
    inference); inside a block attention is bidirectional, except for sliding/causal layers,
    which get the restrictions `DFlashDrafter.block_mask` applies at inference.
    """
    B, m = anchors.shape
    bs = cfg.block_size
    q_pos = (anchors[..., None] + mx.arange(bs)).reshape(B, 1, 1, m * bs, 1)
    q_anchor = mx.repeat(anchors, bs, axis=1).reshape(B, 1, 1, m * bs, 1)
    ctx = mx.arange(T) < q_anchor
    slot = mx.arange(bs)
    masks = {}
    for i in range(cfg.num_hidden_layers):
        key = (cfg.layer_is_causal(i), cfg.layer_window(i))
        if key in masks:
            continue
        causal, window = key
        c, blk = ctx, None
        if causal:
            blk = slot[None, :] <= slot[:, None]
        if window is not None:
            c = c & (mx.arange(T) > q_pos - window)
            near = slot[None, :] > slot[:, None] - window
            blk = near if blk is None else blk & near
        masks[key] = (c, blk)
    return masks


def _heads(x: mx.array, proj, norm, n: int) -> mx.array:
    """(B, L, H) -> (B, n, L, d), with the per-head norm when given."""
    B, L, _ = x.shape
    y = proj(x).reshape(B, L, n, -1)
    if norm is not None:
        y = norm(y)
    return y.transpose(0, 2, 1, 3)


def _per_block(x: mx.array, m: int, bs: int) -> mx.array:
    """(B, n, m*bs, d) -> (B*m, n, bs, d): one block per batch row."""
    B, n, _, d = x.shape
    return x.reshape(B, n, m, bs, d).transpose(0, 2, 1, 3, 4).reshape(B * m, n, bs, d)


def block_attention(a, q, ck, cv, bk, bv, masks) -> mx.array:
    """Blocks attend over [their visible context ; their own block] with one joint softmax.

    q, bk, bv: (B*m, n, bs, d) per block; ck, cv: (B, n_kv, T, d). Scoring each block only
    against itself (not against every other block) keeps the cost at m*bs*(T + bs).
    Returns (B, m*bs, n_heads*d).
    """
    ctx_mask, blk_mask = masks
    Bm, n, bs, d = q.shape
    B, nkv, T, _ = ck.shape
    m, rep = Bm // B, n // nkv
    qc = q.reshape(B, m, nkv, rep, bs, d).transpose(0, 2, 3, 1, 4, 5)
    qc = qc.reshape(B, nkv, rep, m * bs, d)
    s_ctx = (qc * a.scale) @ ck[:, :, None].swapaxes(-1, -2)  # (B, nkv, rep, m*bs, T)
    s_ctx = mx.where(ctx_mask, s_ctx, -mx.inf)
    qb = q.reshape(Bm, nkv, rep, bs, d)
    s_blk = (qb * a.scale) @ bk[:, :, None].swapaxes(-1, -2)  # (B*m, nkv, rep, bs, bs)
    if blk_mask is not None:
        s_blk = mx.where(blk_mask, s_blk, -mx.inf)
    s_blk = s_blk.reshape(B, m, nkv, rep, bs, bs).transpose(0, 2, 3, 1, 4, 5)
    s_blk = s_blk.reshape(B, nkv, rep, m * bs, bs)
    p = mx.softmax(mx.concatenate([s_ctx, s_blk], axis=-1), axis=-1, precise=True)
    out_ctx = p[..., :T] @ cv[:, :, None]  # (B, nkv, rep, m*bs, d)
    pb = p[..., T:].reshape(B, nkv, rep, m, bs, bs).transpose(0, 3, 1, 2, 4, 5)
    out_blk = pb.reshape(Bm, nkv, rep, bs, bs) @ bv[:, :, None]  # (B*m, nkv, rep, bs, d)
    out_blk = out_blk.reshape(B, m, nkv, rep, bs, d).transpose(0, 2, 3, 1, 4, 5)
    out = (out_ctx + out_blk.reshape(B, nkv, rep, m * bs, d)).reshape(B, n, m * bs, d)
    return out.transpose(0, 2, 1, 3).reshape(B, m * bs, n * d)


def drafter_blocks(
    drafter: DFlashDrafter, target, taps: mx.array, tokens: mx.array, anchors: mx.array
) -> mx.array:
    """Hidden states (B, m, bs, H) of every block [tokens[a], MASK...] at its anchor a."""
    cfg = drafter.cfg
    B, T = tokens.shape
    m, bs = anchors.shape[1], cfg.block_size
    first = mx.take_along_axis(tokens, anchors, axis=1)  # (B, m)
    block = mx.where(mx.arange(bs) == 0, first[..., None], cfg.mask_token_id)
    h = target.embed(block).reshape(B, m * bs, -1)
    if cfg.input_embedding_scale is not None:
        h = h * cfg.input_embedding_scale
    c = drafter.hidden_norm(drafter.fc(taps))
    masks = context_masks(cfg, anchors, T)
    offsets = anchors.reshape(-1)
    for i, layer in enumerate(drafter.layers):
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q = a.rope(_per_block(_heads(x, a.q_proj, a.q_norm, a.n_heads), m, bs), offset=offsets)
        bk = a.rope(_per_block(_heads(x, a.k_proj, a.k_norm, a.n_kv_heads), m, bs), offset=offsets)
        bv = _per_block(_heads(x, a.v_proj, None, a.n_kv_heads), m, bs)
        ck = a.rope(_heads(c, a.k_proj, a.k_norm, a.n_kv_heads), offset=0)
        cv = _heads(c, a.v_proj, None, a.n_kv_heads)
        key = (cfg.layer_is_causal(i), cfg.layer_window(i))
        h = h + a.o_proj(block_attention(a, q, ck, cv, bk, bv, masks[key]))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.norm(h).reshape(B, m, bs, -1)


def slot_weights(bs: int, gamma: float) -> mx.array:
    """exp(-(k-1)/gamma) for slots k = 1..bs-1: a miss early ends the round, so early counts."""
    k = mx.arange(1, bs, dtype=mx.float32)
    return mx.exp(-(k - 1) / gamma)


def block_loss(drafter, target, batch: dict, gamma: float):
    """Position-decayed cross-entropy over all blocks; also per-slot hits for the metrics.

    With `batch["vocab"]` the softmax runs over that sub-vocabulary only (every label is in
    it; `batch["lookup"]` maps token ids to its rows): a 49K-word LM head otherwise costs more
    than the whole drafter on a CPU.
    """
    cfg = drafter.cfg
    bs = cfg.block_size
    tokens, anchors, lengths = batch["tokens"], batch["anchors"], batch["lengths"]
    h = drafter_blocks(drafter, target, batch["taps"], tokens, anchors)
    vocab = batch.get("vocab")
    logits = drafter_logits(cfg, target, h[:, :, 1:], vocab).astype(mx.float32)
    pos = anchors[..., None] + mx.arange(1, bs)  # (B, m, bs-1)
    labels = mx.take_along_axis(
        tokens, mx.minimum(pos, tokens.shape[1] - 1).reshape(pos.shape[0], -1), axis=1
    ).reshape(pos.shape)
    if vocab is not None:
        labels = batch["lookup"][labels]
    valid = (pos < lengths[:, None, None]).astype(mx.float32)
    w = slot_weights(bs, gamma) * valid
    ce = nn.losses.cross_entropy(logits, labels)
    loss = (ce * w).sum() / mx.maximum(w.sum(), 1.0)
    hits = (mx.argmax(logits, axis=-1) == labels).astype(mx.float32) * valid
    return loss, (mx.stop_gradient(hits), valid)


# ---------------------------------------------------------------- batches


def make_batch(
    recs: list[dict], rng: np.random.Generator, cfg: TrainConfig, target, taps=None
) -> dict:
    """Right-padded sequences, their taps, and `anchors` random anchors inside each response.

    `taps`: the records' cached taps (each (len, n*H)), else computed here.
    """
    seqs = [r["tokens"][: cfg.max_len] for r in recs]
    T = max(len(s) for s in seqs)
    T = int(math.ceil(T / 32) * 32)  # few distinct shapes
    tokens = np.zeros((len(seqs), T), dtype=np.int32)
    anchors = np.zeros((len(seqs), cfg.anchors), dtype=np.int32)
    for i, (s, r) in enumerate(zip(seqs, recs, strict=True)):
        tokens[i, : len(s)] = s
        lo, hi = r["prompt_len"], len(s) - 2  # slot 1 must have a label
        anchors[i] = rng.integers(lo, max(lo, hi) + 1, size=cfg.anchors)
    tok = mx.array(tokens)
    if taps is None:
        taps = target_taps(target, tok)
    else:
        taps = mx.stack([mx.pad(x, [(0, T - x.shape[0]), (0, 0)]) for x in taps])
        taps = taps.astype(mx.float32)
    return {
        "tokens": tok,
        "anchors": mx.array(anchors),
        "lengths": mx.array([len(s) for s in seqs], dtype=mx.int32),
        "taps": taps,
    }


def cache_all_taps(
    target, recs: list[dict], max_len: int, group: int = 16, path: Path | None = None
) -> list[mx.array]:
    """Every record's taps, once: groups of similar length share a pass.

    With `path` they are also kept on disk (float16, keyed by record id, tapped layers and
    max_len), so a second run or a resumed one skips the target's forward passes entirely.
    """
    key = {"taps": ",".join(map(str, target.tap_ids)), "max_len": str(max_len)}
    saved = _load_taps(path, key) if path is not None else {}
    out: list[mx.array | None] = [saved.get(str(r["id"])) for r in recs]
    for i, x in enumerate(out):
        if x is not None and x.shape[0] != min(len(recs[i]["tokens"]), max_len):
            out[i] = None  # a record that changed since the cache was written
    todo = sorted((i for i, x in enumerate(out) if x is None), key=lambda i: len(recs[i]["tokens"]))
    if not todo:
        return out
    with _progress(path is not None) as progress:
        task = progress.add_task("target taps", total=len(todo), info="")
        for g in range(0, len(todo), group):
            idx = todo[g : g + group]
            seqs = [recs[i]["tokens"][:max_len] for i in idx]
            T = max(len(s) for s in seqs)
            rows = np.zeros((len(seqs), T), dtype=np.int32)
            for j, s in enumerate(seqs):
                rows[j, : len(s)] = s
            taps = target_taps(target, mx.array(rows)).astype(mx.float16)
            mx.eval(taps)
            for j, i in enumerate(idx):
                out[i] = taps[j, : len(seqs[j])]
            progress.advance(task, len(idx))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {str(r["id"]): x for r, x in zip(recs, out, strict=True)}
        _atomic(path, lambda p: mx.save_safetensors(p, arrays, metadata=key))
    return out


def _load_taps(path: Path, key: dict) -> dict:
    """A tap cache written for the same tapped layers and max_len, else nothing."""
    if not path.exists():
        return {}
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError):
        return {}  # damaged: recomputed
    return arrays if all(meta.get(k) == v for k, v in key.items()) else {}


def tap_scale(taps: list[mx.array]) -> mx.array:
    """1 / mean |x| of each tap feature, from (a sample of) the training taps.

    Target residual streams carry a few features hundreds of times larger than the rest
    (SmolLM2: mean |x| 340 against ~10, peaks of 25000). Fed raw to `fc`, under Adam's
    per-weight step those columns move the output hundreds of times more per step than the
    others. fc has no bias, so training `fc' = fc * diag(1/scale)` on `taps * scale` and saving
    `fc' * scale` is the same drafter at inference, with every feature on the same footing.
    """
    total, count = None, 0
    for x in taps[:256]:
        a = mx.abs(x.astype(mx.float32)).sum(axis=0)
        total = a if total is None else total + a
        count += x.shape[0]
    return 1.0 / mx.maximum(total / count, 1e-3)


def loss_vocabulary(recs: list[dict], max_len: int) -> np.ndarray:
    """Every token that is ever a label (response tokens), sorted."""
    seen: set[int] = set()
    for r in recs:
        seen.update(r["tokens"][r["prompt_len"] + 1 : max_len])
    return np.array(sorted(seen), dtype=np.int32)


def usable(recs: list[dict], max_len: int) -> list[dict]:
    """Records with at least two response tokens inside max_len."""
    return [r for r in recs if min(len(r["tokens"]), max_len) - r["prompt_len"] >= 2]


# ---------------------------------------------------------------- evaluation


def eval_tau(drafter: DFlashDrafter, target, prompts: list[list[int]], max_tokens: int) -> dict:
    """Mean tau of real DFlash greedy decoding (the engine itself) on held-out prompts."""
    from .engine import GenerationConfig, Session, generate_rounds
    from .generate import Stats, stop_ids

    target.set_taps(drafter.cfg.target_layer_ids)
    cfg = GenerationConfig(max_tokens=max_tokens, stop_ids=stop_ids(target.tokenizer))
    total, per_prompt = Stats(), []
    for ids in prompts:
        session = Session(target, DrafterRunner(drafter, target))
        stats = Stats()
        for rnd in generate_rounds(session, ids, cfg):
            stats.add(rnd)
            total.add(rnd)
        if stats.taus:
            per_prompt.append(stats.mean_tau)
    return {
        "tau": total.mean_tau,
        "tau_per_response": float(np.mean(per_prompt)) if per_prompt else 0.0,
        "rounds": len(total.taus),
        "histogram": total.histogram,
    }


# ---------------------------------------------------------------- checkpoints


def save_checkpoint(out: Path, drafter: DFlashDrafter, opt, step: int, meta: dict) -> None:
    """z-lab layout (config.json + model.safetensors) plus the optimizer state to resume, and
    the draft vocabulary when the drafter has one (see drafter.DRAFT_VOCAB_FILE)."""
    out.mkdir(parents=True, exist_ok=True)
    if drafter.draft_vocab is not None:
        write_draft_vocab(out, drafter.draft_vocab)
    elif (out / DRAFT_VOCAB_FILE).exists():
        (out / DRAFT_VOCAB_FILE).unlink()
    cfg = drafter.cfg.to_dict()
    cfg["torch_dtype"] = "float32"
    weights = dict(tree_flatten(drafter.parameters()))
    _atomic(
        out / "model.safetensors",
        lambda p: mx.save_safetensors(p, weights, metadata={"format": "pt"}),
    )
    if opt is not None:
        state = dict(tree_flatten(opt.state))
        _atomic(out / OPT_FILE, lambda p: mx.savez(p, **state))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / STATE_FILE).write_text(json.dumps({"step": step, **meta}, indent=2))


def _atomic(path: Path, write) -> None:
    """Write beside, then rename: a crash never leaves a half-written checkpoint file."""
    tmp = path.parent / ".partial" / path.name
    tmp.parent.mkdir(exist_ok=True)
    write(str(tmp))
    tmp.replace(path)
    tmp.parent.rmdir()


def load_checkpoint(out: Path, num_target_layers: int):
    """(drafter, optimizer state or None, step) from a folder `save_checkpoint` wrote."""
    drafter = load_drafter(out, num_target_layers=num_target_layers)
    state_file = out / STATE_FILE
    step = json.loads(state_file.read_text())["step"] if state_file.exists() else 0
    opt_state = None
    if (out / OPT_FILE).exists():
        opt_state = tree_unflatten(list(mx.load(str(out / OPT_FILE)).items()))
    return drafter, opt_state, step


def make_optimizer(cfg: TrainConfig) -> optim.Optimizer:
    """AdamW, linear warm-up then cosine decay to min_lr_ratio * lr."""
    warm = max(1, min(cfg.warmup, cfg.steps - 1))
    schedule = optim.join_schedules(
        [
            optim.linear_schedule(cfg.lr / warm, cfg.lr, warm),
            optim.cosine_decay(cfg.lr, max(1, cfg.steps - warm), cfg.lr * cfg.min_lr_ratio),
        ],
        [warm],
    )
    return optim.AdamW(learning_rate=schedule, weight_decay=cfg.weight_decay)


# ---------------------------------------------------------------- the loop


@dataclass
class Trainer:
    """Owns the drafter, the optimizer and the step; `run` trains up to cfg.steps."""

    target: object
    drafter: DFlashDrafter
    records: list[dict]
    cfg: TrainConfig
    out: Path | None = None
    eval_prompts: list[list[int]] = field(default_factory=list)
    step: int = 0
    opt_state: dict | None = None
    history: list[dict] = field(default_factory=list)
    fresh: bool = False  # a new random drafter: its fc init is drawn in the preconditioned space

    def __post_init__(self):
        self.target.set_taps(self.drafter.cfg.target_layer_ids)
        self.records = usable(self.records, self.cfg.max_len)
        if not self.records:
            raise DFlashError("No training record has a response of at least two tokens.")
        if self.cfg.loss_vocab not in ("full", "corpus"):
            raise DFlashError(f"--loss-vocab is 'full' or 'corpus', not '{self.cfg.loss_vocab}'.")
        self.taps = None
        if self.cfg.cache_taps:
            path = None if self.out is None else self.out / TAPS_FILE
            self.taps = cache_all_taps(self.target, self.records, self.cfg.max_len, path=path)
        self.vocab = None
        if self.cfg.loss_vocab == "corpus":
            self.vocab = loss_vocabulary(self.records, self.cfg.max_len)
            self.others = np.setdiff1d(np.arange(self.target.vocab_size), self.vocab)
        # Trained to rank only these tokens, it drafts only these (cheaper LM head at inference).
        self.drafter.draft_vocab = self.vocab
        self.scale = None
        if self.cfg.precondition:
            self.scale = tap_scale(self.taps or self._first_batch_taps())
            if self.fresh:
                self.drafter.fc.weight = self.drafter.fc.weight * self.scale
        self.opt = make_optimizer(self.cfg)
        if self.opt_state is not None:
            self.opt.state = self.opt_state
        self._grad = nn.value_and_grad(self.drafter, self._loss)

    def _first_batch_taps(self) -> list[mx.array]:
        """Uncached taps: the first batch's rows without their padding."""
        b = self.batch(0)
        return [b["taps"][i, :n] for i, n in enumerate(b["lengths"].tolist())]

    def _loss(self, model, batch):
        return block_loss(model, self.target, batch, self.cfg.gamma)

    def batch(self, step: int) -> dict:
        """Deterministic in (seed, step), so a resumed run sees the batches it would have."""
        rng = np.random.default_rng([self.cfg.seed, step])
        n = len(self.records)
        idx = rng.choice(n, size=self.cfg.batch, replace=n < self.cfg.batch)
        taps = None if self.taps is None else [self.taps[i] for i in idx]
        batch = make_batch([self.records[i] for i in idx], rng, self.cfg, self.target, taps)
        if self.vocab is not None:
            k = min(self.cfg.negatives, len(self.others))
            vocab = np.concatenate([self.vocab, rng.choice(self.others, size=k, replace=False)])
            lookup = np.zeros(self.target.vocab_size, dtype=np.int32)
            lookup[vocab] = np.arange(len(vocab))
            batch["vocab"], batch["lookup"] = mx.array(vocab), mx.array(lookup)
        return batch

    def train_step(self) -> dict:
        """One update; with preconditioning, in the scaled space (see `tap_scale`), and back."""
        batch = self.batch(self.step)
        fc = self.drafter.fc
        if self.scale is not None:
            batch["taps"] = batch["taps"] * self.scale
            fc.weight = fc.weight / self.scale
        (loss, (hits, valid)), grads = self._grad(self.drafter, batch)
        grads, norm = optim.clip_grad_norm(grads, self.cfg.clip)
        self.opt.update(self.drafter, grads)
        if self.scale is not None:
            fc.weight = fc.weight * self.scale
        mx.eval(loss, hits, valid, norm, self.drafter.parameters(), self.opt.state)
        self.step += 1
        return metrics(loss, hits, valid, norm)

    def evaluate(self) -> dict | None:
        if not self.eval_prompts:
            return None
        return eval_tau(self.drafter, self.target, self.eval_prompts, self.cfg.eval_tokens)

    def save(self) -> None:
        if self.out is not None:
            meta = {"config": asdict(self.cfg), "history": self.history[-50:]}
            save_checkpoint(self.out, self.drafter, self.opt, self.step, meta)

    def run(self, show: bool = True) -> list[dict]:
        """Train to cfg.steps with a progress bar; evaluate and save on schedule and at the end."""
        with _progress(show) as progress:
            task = progress.add_task("train", total=self.cfg.steps, completed=self.step, info="")
            t0 = time.perf_counter()
            while self.step < self.cfg.steps:
                m = self.train_step()
                m["step"] = self.step
                progress.update(task, completed=self.step, info=_info(m))
                if show and not progress.console.is_terminal and self.step % 25 == 0:
                    progress.console.print(f"step {self.step}: {_info(m)}")
                if self.cfg.eval_every and self.step % self.cfg.eval_every == 0:
                    m.update(self._eval_line(progress))
                if self.cfg.save_every and self.step % self.cfg.save_every == 0:
                    self.save()
                self.history.append(m)
            if self.history:
                self.history[-1]["elapsed_s"] = time.perf_counter() - t0
        self.save()
        return self.history

    def _eval_line(self, progress) -> dict:
        ev = self.evaluate()
        if ev is None:
            return {}
        hist = " ".join(f"{k}:{v}" for k, v in ev["histogram"].items())
        progress.console.print(
            f"step {self.step}: eval tau {ev['tau']:.2f} "
            f"(per response {ev['tau_per_response']:.2f}, {ev['rounds']} rounds) [{hist}]"
        )
        return {"eval_tau": ev["tau"], "eval_tau_per_response": ev["tau_per_response"]}


def metrics(loss, hits, valid, norm) -> dict:
    """Loss, per-slot accuracy and the acceptance length the blocks would have had."""
    acc = (hits.sum(axis=(0, 1)) / mx.maximum(valid.sum(axis=(0, 1)), 1.0)).tolist()
    accepted = mx.cumprod(hits, axis=-1).sum(axis=-1) + 1.0  # tau of each block, bonus included
    return {
        "loss": loss.item(),
        "acc": [round(a, 4) for a in acc],
        "block_tau": accepted.mean().item(),
        "grad_norm": norm.item(),
    }


def _info(m: dict) -> str:
    acc = " ".join(f"{100 * a:.0f}" for a in m["acc"][:6])
    return f"loss {m['loss']:.3f} | acc% {acc} … | block tau {m['block_tau']:.2f}"


def _progress(show: bool):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
        disable=not show,
    )


# ---------------------------------------------------------------- data preparation


def prepare_prompts(
    target, data: list[Path], out: Path, n: int, seed: int, story_words: int = 6
) -> list[str]:
    """The prompt list, fixed once in out/prompts.jsonl so a resumed run sees the same split."""
    from .train_data import read_prompts, story_prompts

    saved = out / "prompts.jsonl"
    if saved.exists():
        return [json.loads(line)["prompt"] for line in saved.read_text().splitlines() if line]
    if data:
        prompts = read_prompts(data)
        if n:
            prompts = prompts[:n]
    elif getattr(target.tokenizer, "chat_template", None):
        raise DFlashError("This target has a chat template: pass prompts with --data FILE.jsonl.")
    else:
        prompts = story_prompts(target, n or 1024, seed=seed, max_words=story_words)
    out.mkdir(parents=True, exist_ok=True)
    saved.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return prompts


def answer(target, prompts: list[str], shard: Path, temps, max_tokens: int, batch: int, seed: int):
    """Answer the prompts not yet in the shard, with a progress bar."""
    from .train_data import answer_prompts, done_ids

    done = len(done_ids(shard) & set(range(len(prompts))))
    with _progress(True) as progress:
        task = progress.add_task("answer", total=len(prompts), completed=done, info="")
        answer_prompts(
            target,
            prompts,
            shard,
            temps=temps,
            max_tokens=max_tokens,
            batch=batch,
            seed=seed,
            on_batch=lambda k: progress.advance(task, k),
        )


def load_training_target(model: str | None, dequantize: bool):
    """The target (default: the embedded stories260K), optionally dequantized to float32."""
    from .generate import DEFAULT_TARGET
    from .resolve import resolve_model
    from .target import load_target

    target = load_target(resolve_model(model or str(DEFAULT_TARGET), "target"))
    if dequantize and target.config.get("quantization"):
        from mlx_lm.utils import dequantize_model

        target.model = dequantize_model(target.model)
        target.model.set_dtype(mx.float32)
        target.inner = target.model.model
        target.layers = target.inner.layers
    target.model.freeze()
    return target


def _parse_ints(s: str | None) -> list[int] | None:
    if not s:
        return None
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise DFlashError(f"Expected comma-separated integers, not '{s}'.") from None


def _parse_floats(s: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise DFlashError(f"Expected comma-separated numbers, not '{s}'.") from None


def train_command(
    model: str = typer.Option(
        None, "--model", "-m", help="Target model folder (default: embedded stories260K)."
    ),
    data: list[Path] = typer.Option(
        [], "--data", help="Prompt JSONL file(s) (prompt/question/text field); repeatable."
    ),
    out: Path = typer.Option(..., "--out", "-o", help="Output folder: checkpoint and data."),
    layers: int = typer.Option(2, "--layers", min=1, help="Drafter decoder layers."),
    heads: int = typer.Option(None, "--heads", min=1, help="Drafter heads (default: target's)."),
    window: int = typer.Option(
        None, "--window", min=1, help="Sliding-window attention over the last N positions."
    ),
    taps: str = typer.Option(None, "--taps", help="Tapped target layers, e.g. 1,3."),
    block_size: int = typer.Option(16, "--block-size", min=2),
    mask_token_id: int = typer.Option(None, "--mask-token-id", help="Default: unk/pad."),
    init: Path = typer.Option(None, "--init", help="Start from this drafter checkpoint."),
    steps: int = typer.Option(1000, "--steps", min=1),
    lr: float = typer.Option(1e-3, "--lr"),
    warmup: int = typer.Option(50, "--warmup", min=0),
    batch: int = typer.Option(8, "--batch", min=1, help="Sequences per step."),
    anchors: int = typer.Option(16, "--anchors", min=1, help="Blocks per sequence."),
    gamma: float = typer.Option(7.0, "--gamma", help="Loss decay over block slots."),
    max_len: int = typer.Option(512, "--max-len", help="Truncate sequences to this."),
    clip: float = typer.Option(1.0, "--clip", help="Gradient norm clip."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the checkpoint in --out."),
    eval_every: int = typer.Option(200, "--eval-every", min=0, help="0: only at the end."),
    eval_prompts: int = typer.Option(8, "--eval-prompts", min=0, help="Held-out prompts."),
    eval_tokens: int = typer.Option(96, "--eval-tokens", min=2),
    save_every: int = typer.Option(200, "--save-every", min=0),
    cache_taps: bool = typer.Option(
        None, "--cache-taps/--no-cache-taps", help="Keep all taps in memory (default: if < 2 GB)."
    ),
    loss_vocab: str = typer.Option(
        "full",
        "--loss-vocab",
        help="full, or corpus: softmax over the tokens the answers use plus --negatives "
        "random others (much faster with a large vocabulary).",
    ),
    negatives: int = typer.Option(1024, "--negatives", min=0, help="See --loss-vocab."),
    precondition: bool = typer.Option(
        True, "--precondition/--no-precondition", help="Scale tap features to equal size for fc."
    ),
    num_prompts: int = typer.Option(0, "--num-prompts", min=0, help="Use the first N (0: all)."),
    story_words: int = typer.Option(
        6, "--story-words", min=2, help="No --data, no chat template: openings of 2..N words."
    ),
    gen_temps: str = typer.Option("0,0.7", "--gen-temps", help="Answer temperatures, cycled."),
    gen_max_tokens: int = typer.Option(256, "--gen-max-tokens", min=1),
    gen_batch: int = typer.Option(32, "--gen-batch", min=1),
    gen_only: bool = typer.Option(False, "--gen-only", help="Only answer prompts, no training."),
    gen: bool = typer.Option(
        True, "--gen/--no-gen", help="--no-gen: train on the answers already in OUT, answer none."
    ),
    dequantize: bool = typer.Option(True, "--dequantize/--keep-quantized"),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Train a DFlash drafter for a target on prompts answered by the target itself."""
    from .train_data import encode, load_records

    target = load_training_target(model, dequantize)
    prompts = prepare_prompts(target, data, out, num_prompts, seed, story_words)
    if eval_prompts >= len(prompts):
        raise DFlashError(f"Only {len(prompts)} prompts: fewer than --eval-prompts + 1.")
    train_prompts = prompts[: len(prompts) - eval_prompts]
    held_out = prompts[len(prompts) - eval_prompts :]
    shard = out / "answers.jsonl"
    if gen:
        temps = _parse_floats(gen_temps)
        answer(target, train_prompts, shard, temps, gen_max_tokens, gen_batch, seed)
    elif not shard.exists():
        raise DFlashError(f"--no-gen needs answers in {shard}; run without it first.")
    if gen_only:
        typer.echo(f"Answers in {shard}")
        return
    cfg = TrainConfig(
        steps=steps,
        lr=lr,
        warmup=warmup,
        batch=batch,
        anchors=anchors,
        gamma=gamma,
        max_len=max_len,
        clip=clip,
        seed=seed,
        eval_every=eval_every,
        eval_tokens=eval_tokens,
        save_every=save_every,
        loss_vocab=loss_vocab,
        negatives=negatives,
        precondition=precondition,
    )
    records = load_records([shard])
    opt_state, step, fresh = None, 0, False
    if resume and (out / "model.safetensors").exists():
        drafter, opt_state, step = load_checkpoint(out, target.num_layers)
    elif init is not None:
        drafter = load_drafter(init, num_target_layers=target.num_layers)
    else:
        dcfg = new_drafter_config(
            target, layers, _parse_ints(taps), block_size, mask_token_id, heads, window
        )
        drafter = init_drafter(dcfg, seed=seed)
        fresh = True
    from .checkpoint import check_pair

    check_pair(drafter.cfg, target.config)
    if cache_taps is None:
        n_tok = sum(min(len(r["tokens"]), max_len) for r in records)
        cache_taps = n_tok * drafter.cfg.num_taps * target.hidden_size * 2 < 2**31
    cfg.cache_taps = cache_taps
    trainer = Trainer(
        target,
        drafter,
        records,
        cfg,
        out=out,
        eval_prompts=[encode(target.tokenizer, p) for p in held_out],
        step=step,
        opt_state=opt_state,
        fresh=fresh,
    )
    t0 = time.perf_counter()
    trainer.run()
    ev = trainer.evaluate()
    if ev is not None:
        typer.echo(
            f"final eval tau {ev['tau']:.2f} (per response {ev['tau_per_response']:.2f}) "
            f"over {len(held_out)} held-out prompts"
        )
    typer.echo(f"Trained {trainer.step} steps in {time.perf_counter() - t0:.0f}s; wrote {out}")
