"""The training forward (docs/training.md): many blocks per sequence in one batched attention.

Every sequence carries blocks at random anchors inside the response; all of them run in one
attention whose boolean mask gives each block the target's context strictly before its anchor,
bidirectional attention inside itself and nothing of the other blocks. The forward reuses
`DFlashDrafter`'s own submodules, so the trained weights are the inference weights. The loss is
position-decayed cross-entropy (early slots matter most: a miss ends the round).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..errors import DFlashError
from ..models.drafter import DFlashDrafter, drafter_logits, split_heads
from ..models.drafter_config import DrafterConfig


def target_taps(target, tokens: mx.array, final: bool = False):
    """Taps (B, T, n_taps*H) of right-padded sequences: one causal pass, no gradient.

    Right padding never reaches real positions under a causal mask, so no padding mask.
    final: run every layer and also return the final normed hidden states (B, T, H), from
    which the target's own distributions (soft targets) follow.
    """
    h = target.embed(tokens)
    wanted = {t: None for t in target.tap_ids}
    last = target.num_layers - 1 if final else max(wanted)
    for i, layer in enumerate(target.layers[: last + 1]):
        h = layer(h, mask="causal", cache=None)
        if i in wanted:
            wanted[i] = h
    taps = mx.stop_gradient(mx.concatenate([wanted[t] for t in target.tap_ids], axis=-1))
    return (taps, target.inner.norm(h)) if final else taps


def top_logprobs(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The k most likely ids of each row of logits (N, V) and their log-probabilities."""
    logp = logits.astype(mx.float32)
    logp = logp - mx.logsumexp(logp, axis=-1, keepdims=True)
    top = mx.argpartition(-logp, k - 1, axis=-1)[:, :k]
    return top, mx.take_along_axis(logp, top, axis=-1)


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


def _per_block(x: mx.array, m: int, bs: int, proj, n: int, norm=None) -> mx.array:
    """x (B, m*bs, H) as heads (`split_heads`), one block per batch row: (B*m, n, bs, d)."""
    y = split_heads(x, proj, n, norm)
    B, _, _, d = y.shape
    return y.reshape(B, n, m, bs, d).transpose(0, 2, 1, 3, 4).reshape(B * m, n, bs, d)


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
    check_trainable(cfg)
    B, T = tokens.shape
    m, bs = anchors.shape[1], cfg.block_size
    first = mx.take_along_axis(tokens, anchors, axis=1)  # (B, m)
    block = mx.where(mx.arange(bs) == 0, first[..., None], cfg.mask_token_id)
    h = target.token_embeddings(block).reshape(B, m * bs, -1)
    if cfg.input_embedding_scale is not None:
        h = h * cfg.input_embedding_scale
    c = drafter.hidden_norm(drafter.fc(taps))
    masks = context_masks(cfg, anchors, T)
    offsets = anchors.reshape(-1)
    for i, layer in enumerate(drafter.layers):
        a = layer.self_attn
        conv = getattr(layer, "attention_conv", None)  # DFlash 2
        x, d = _prepare(conv, layer.input_layernorm(h), bs)
        q = a.rope(_per_block(x, m, bs, a.q_proj, a.n_heads, a.q_norm), offset=offsets)
        bk = a.rope(_per_block(x, m, bs, a.k_proj, a.n_kv_heads, a.k_norm), offset=offsets)
        bv = _per_block(x, m, bs, a.v_proj, a.n_kv_heads)
        ck, cv = a.project_kv(c, 0)  # (no value scale: check_trainable)
        key = (cfg.layer_is_causal(i), cfg.layer_window(i))
        h = h + _finish(conv, a.o_proj(block_attention(a, q, ck, cv, bk, bv, masks[key])), d)
        conv = getattr(layer, "mlp_conv", None)
        x, d = _prepare(conv, layer.post_attention_layernorm(h), bs)
        h = h + _finish(conv, layer.mlp(x), d)
    return drafter.norm(h).reshape(B, m, bs, -1)


def check_trainable(cfg: DrafterConfig) -> None:
    """block_attention computes z-lab's attention only: a drafter with sink logits, a value
    scale or a value head size of its own (MiMo's) is refused rather than trained wrongly."""
    if cfg.attention_sink_bias or cfg.attention_value_scale is not None or cfg.v_head_dim:
        raise DFlashError(
            "Training does not model attention sinks, value scales or a separate value head "
            "size yet, so this drafter cannot be trained here."
        )


def _prepare(conv, x: mx.array, bs: int):
    """A DFlash 2 layer's convolution before its sublayer, over each block's own positions
    (B, m*bs, H); without a convolution (DFlash 1) x as is."""
    if conv is None:
        return x, None
    y, d = conv.prepare(x.reshape(-1, bs, x.shape[-1]))
    return y.reshape(x.shape), d


def _finish(conv, y: mx.array, d):
    """The convolution after the sublayer, over the blocks `_prepare` cut (d: (B*m, bs, ...))."""
    if conv is None:
        return y
    return conv.finish(y.reshape(*d.shape[:2], -1), d).reshape(y.shape)


def slot_weights(bs: int, gamma: float) -> mx.array:
    """exp(-(k-1)/gamma) for slots k = 1..bs-1: a miss early ends the round, so early counts."""
    k = mx.arange(1, bs, dtype=mx.float32)
    return mx.exp(-(k - 1) / gamma)


def block_loss(drafter, target, batch: dict, gamma: float, kl_weight: float = 0.0):
    """Position-decayed cross-entropy over all blocks; also per-slot hits for the metrics.

    With `batch["vocab"]` the softmax runs over that sub-vocabulary only (every label is in
    it; `batch["lookup"]` maps token ids to its rows, -1 when absent): a 49K-word LM head
    otherwise costs more than the whole drafter on a CPU.

    kl_weight > 0 (distillation): where the batch has the target's soft targets (its top-k
    log-probabilities, renormalised over the ids in the loss vocabulary), each slot's loss is
    (1 - w) * cross-entropy against the answer token + w * cross-entropy against that
    distribution (its KL divergence up to the target's entropy, a constant).
    """
    cfg = drafter.cfg
    bs = cfg.block_size
    tokens, anchors, lengths = batch["tokens"], batch["anchors"], batch["lengths"]
    h = drafter_blocks(drafter, target, batch["taps"], tokens, anchors)
    vocab = batch.get("vocab")
    logits = drafter_logits(cfg, target, h[:, :, 1:], vocab).astype(mx.float32)
    pos = anchors[..., None] + mx.arange(1, bs)  # (B, m, bs-1)
    flat = mx.minimum(pos, tokens.shape[1] - 1).reshape(pos.shape[0], -1)  # (B, m*(bs-1))
    labels = mx.take_along_axis(tokens, flat, axis=1).reshape(pos.shape)
    if vocab is not None:
        labels = batch["lookup"][labels]
    valid = (pos < lengths[:, None, None]).astype(mx.float32)
    w = slot_weights(bs, gamma) * valid
    ce = nn.losses.cross_entropy(logits, labels)
    if kl_weight > 0 and "soft_ids" in batch:
        ce = _with_soft_targets(ce, logits, batch, flat, kl_weight)
    hits = mx.argmax(logits, axis=-1) == labels
    if cfg.kind == "dflash2":
        prev = mx.concatenate(
            [mx.take_along_axis(tokens, anchors, axis=1)[..., None], _token_ids(labels, vocab)],
            axis=-1,
        )[..., :-1]  # each slot's predecessor: the anchor, then the true tokens (teacher forcing)
        sel_ce, hits = selector_loss(drafter.candidate_selector, h[:, :, 1:], logits, labels,
                                     prev, vocab)  # fmt: skip
        ce = ce + sel_ce
    loss = (ce * w).sum() / mx.maximum(w.sum(), 1.0)
    hits = hits.astype(mx.float32) * valid
    return loss, (mx.stop_gradient(hits), valid)


def _token_ids(idx: mx.array, vocab: mx.array | None) -> mx.array:
    """Token ids of indices into the loss vocabulary (the indices themselves without one)."""
    return idx if vocab is None else vocab[idx]


def selector_loss(selector, h, logits, labels, prev, vocab=None):
    """DFlash 2's candidate selector, teacher-forced: per slot, cross-entropy of the true token
    among the top-k candidates of the (detached) logits, scored as at inference (unary logit +
    <P[prev], g, S[c]>) with the true predecessor. Where the truth is not a candidate it
    replaces one, so every slot teaches the pairwise term. Returns (loss per slot, and whether
    the selector's pick is the truth: what the greedy chain would accept)."""
    k = selector.top_k
    cand = mx.argpartition(mx.stop_gradient(logits), -k, axis=-1)[..., -k:]
    present = (cand == labels[..., None]).any(axis=-1, keepdims=True)
    last = mx.where(present, cand[..., -1:], labels[..., None])
    cand = mx.concatenate([cand[..., :-1], last], axis=-1)
    unary = mx.take_along_axis(logits, cand, axis=-1)
    g = selector.hidden_projection(h)  # (..., r)
    pred = selector.predecessor_codebook(prev)
    succ = selector.successor_codebook(_token_ids(cand, vocab))  # (..., k, r)
    scores = unary + ((pred * g)[..., None, :] * succ).sum(axis=-1)
    truth = mx.argmax(cand == labels[..., None], axis=-1)
    ce = nn.losses.cross_entropy(scores, truth)
    hits = mx.argmax(scores, axis=-1) == truth
    return ce, hits & present[..., 0]


def _with_soft_targets(ce, logits, batch, flat, kl_weight: float):
    """(1 - w) * ce + w * cross-entropy against the target's top-k distribution, per slot
    (ce: (B, m, n); flat: the (B, m*n) positions of their labels)."""
    k = batch["soft_ids"].shape[-1]
    ids = mx.take_along_axis(batch["soft_ids"], flat[..., None], axis=1).reshape(*ce.shape, k)
    logp = mx.take_along_axis(batch["soft_logp"], flat[..., None], axis=1).reshape(*ce.shape, k)
    if "lookup" in batch:
        ids = batch["lookup"][ids]
        logp = mx.where(ids >= 0, logp, -mx.inf)
        ids = mx.maximum(ids, 0)
    has = mx.isfinite(logp).any(axis=-1)
    p = mx.softmax(mx.where(has[..., None], logp, 0.0), axis=-1, precise=True)
    logq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    soft = -(p * mx.take_along_axis(logq, ids, axis=-1)).sum(axis=-1)
    return mx.where(has, (1 - kl_weight) * ce + kl_weight * soft, ce)


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
