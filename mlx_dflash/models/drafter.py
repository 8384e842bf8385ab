"""The DFlash block-diffusion drafter (docs/dflash.md, docs/checkpoints.md) and the state that runs it.

A few Qwen3-style layers that see the target's tapped hidden states through "KV injection":
each layer projects the (fc + hidden_norm) context with its own k/v projections into a cache,
and a block [last token, MASK x (bs-1)] attends bidirectionally over that cache plus itself.
The drafter has no embeddings or LM head: it borrows the target's. A DFlash 2 drafter
(`cfg.kind == "dflash2"`) wraps each sublayer in a dynamic convolution and proposes through its
candidate selector's lattice (models/dflash2.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.rope_utils import initialize_rope

from ..engine.contract import DraftAsk, Proposal
from ..engine.lattice import LatticeDrafts
from ..engine.marginals import Marginals
from ..errors import DFlashError
from ..kernels import cpu_math
from ..kernels.cpu_attention import cpu_attention, use_cpu_attention
from .attention import module_attr, rope_at
from .cache import ContextCache
from .compiled import compiled_once
from .dflash2 import CandidateSelector, GroupedDynamicConv
from .drafter_config import DrafterConfig

# Optional, beside config.json: {"token_ids": [...]}, the only tokens this drafter proposes.
# A drafter trained with a sub-vocabulary loss never learnt to rank the other tokens, and on a
# CPU the LM head over the full vocabulary is most of a draft's cost (EAGLE-3's draft vocabulary
# is the same idea). Other DFlash implementations ignore the file and use the full vocabulary.
DRAFT_VOCAB_FILE = "draft_vocab.json"
# Optional, beside config.json: the answers of the target the drafter was trained on (as
# `train` writes them), which lookup reads where no corpus is named (engine/corpus.py).
CORPUS_FILE = "lookup-corpus.jsonl.gz"


class DrafterAttention(nn.Module):
    """Qwen3 attention (q/k norms before RoPE), plus what published drafters add: q/k/v/o
    biases, partial RoPE, a value head size of its own, a value scale and per-head sink logits
    (an extra softmax column with no value, as gpt-oss and MiMo's sliding layers have)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, d, vd = cfg.hidden_size, cfg.head_dim, cfg.value_head_dim
        self.n_heads, self.n_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.scale = d**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv_heads * vd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * vd, h, bias=bias)
        self.q_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.rope = initialize_rope(
            cfg.rotary_dims, cfg.rope_theta, False, cfg.rope_scaling, cfg.max_position_embeddings
        )
        self.value_scale = cfg.attention_value_scale
        if cfg.attention_sink_bias:
            self.attention_sink_bias = mx.zeros((self.n_heads,))

    def project_kv(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array]:
        """K/V of x (B, L, H) at positions `offset` (attention.rope_at: packed blocks are a
        position per token), shaped (B, n_kv, L, d)."""
        k = split_heads(x, self.k_proj, self.n_kv_heads, self.k_norm)
        v = split_heads(x, self.v_proj, self.n_kv_heads)
        if self.value_scale is not None:
            v = v * self.value_scale
        return rope_at(self.rope, k, offset), v

    def project(self, x: mx.array, offset: int | mx.array):
        """q (1, heads, L, d), k and v (1, n_kv, L, d) of x at positions `offset` (rope_at)."""
        q = rope_at(self.rope, split_heads(x, self.q_proj, self.n_heads, self.q_norm), offset)
        return (q, *self.project_kv(x, offset))

    def attend(self, q, k, v, caches: list[ContextCache], masks) -> mx.array:
        """(1, L, heads * dv): the R blocks packed in q, k, v, block r over the layer's cached
        context in caches[r] plus itself, under masks[r]. A block's K/V go into its cache's
        buffer after the context (no copy of the context, which grows with the text) and are
        not kept: the next append overwrites them."""
        L, R = q.shape[2], len(caches)
        bs = L // R
        sinks = module_attr(self, "attention_sink_bias")
        # A block alone takes the CPU attention where it can (as the target's: exp is slow);
        # packed blocks, MLX's.
        cpu = R == 1 and sinks is None and k.shape[-1] == v.shape[-1] and use_cpu_attention()
        outs = []
        for r, (cache, mask) in enumerate(zip(caches, masks, strict=True)):
            # (a block alone is all of q, k and v: no slices to build)
            q_r, k_r, v_r = (
                (q, k, v) if R == 1 else (t[:, :, r * bs : (r + 1) * bs] for t in (q, k, v))
            )
            keys, values = cache.extend(k_r, v_r)
            if cpu:
                outs.append(cpu_attention(q_r, keys, values, self.scale, mask))
            else:
                outs.append(mx.fast.scaled_dot_product_attention(
                    q_r, keys, values, scale=self.scale, mask=mask, sinks=sinks))  # fmt: skip
        out = outs[0] if R == 1 else mx.concatenate(outs, axis=2)
        return out.transpose(0, 2, 1, 3).reshape(1, L, -1)


def split_heads(x: mx.array, proj, n: int, norm=None) -> mx.array:
    """proj(x) of x (B, L, H) as n heads (B, n, L, d), each normed by `norm` when given."""
    B, L, _ = x.shape
    y = proj(x).reshape(B, L, n, -1)
    return (y if norm is None else norm(y)).transpose(0, 2, 1, 3)


class DrafterMLP(nn.Module):
    def __init__(self, h: int, i: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))

    def infer(self, x):
        """The same function, its product's exponentials through kernels/cpu_math.py (numpy on
        x86 CPUs). Drafting only: numpy breaks the gradient tape training runs __call__ under."""
        return self.down_proj(cpu_math.silu_mul(self.gate_proj(x), self.up_proj(x)))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = DrafterAttention(cfg)
        self.mlp = DrafterMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, h: mx.array, caches, offset, masks, compile_=False) -> mx.array:
        """h (1, R * bs, H): R blocks at positions `offset` (attention.rope_at), block r
        over its context caches[r] under masks[r]. `compile_` (one block): the halves through
        mx.compile (models/compiled.py: the drafter's pass has the same shapes every round),
        the weights their inputs."""
        if compile_:
            before, after = compiled_once(self, self.halves)
            offset = mx.array(offset, dtype=mx.int32)
        else:
            before, after = self.halves(len(caches))
        q, k, v, *carried = before(h, offset)
        return after(h, self.self_attn.attend(q, k, v, caches, masks), *carried)

    def halves(self, blocks: int = 1):
        """The layer around its context cache: before(h, at) -> q, k, v and what after needs
        too; after(h, attention output, *that) -> the layer's output."""
        attn = self.self_attn

        def before(h, at):
            return attn.project(self.input_layernorm(h), at)

        def after(h, out):
            h = h + attn.o_proj(out)
            return h + self.mlp.infer(self.post_attention_layernorm(h))

        return before, after


class DFlash2Layer(DrafterLayer):
    """A DFlash 1 layer with each sublayer between the two halves of a dynamic convolution."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg)
        conv = (cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.attention_conv = GroupedDynamicConv(*conv)
        self.mlp_conv = GroupedDynamicConv(*conv)

    def halves(self, blocks: int = 1):
        """As DrafterLayer's, the attention convolution's second half carried; the
        convolutions run along each block."""
        attn = self.self_attn

        def split(t):  # (1, blocks * bs, H) <-> (blocks, bs, H)
            return t if blocks == 1 else t.reshape(blocks, -1, t.shape[-1])

        def packed(t):
            return t if blocks == 1 else t.reshape(1, -1, t.shape[-1])

        def before(h, at):
            x, d = self.attention_conv.prepare(split(self.input_layernorm(h)))
            return (*attn.project(packed(x), at), d)

        def after(h, out, d):
            h = h + packed(self.attention_conv.finish(split(attn.o_proj(out)), d))
            x, d = self.mlp_conv.prepare(split(self.post_attention_layernorm(h)))
            return h + packed(self.mlp_conv.finish(self.mlp.infer(x), d))

        return before, after


class DFlashDrafter(nn.Module):
    """Parameter names match the published z-lab checkpoints exactly."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.folder: Path | None = None  # where it was loaded from (load_drafter)
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_taps * h, h, bias=False)
        self.hidden_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        layer = DFlash2Layer if cfg.kind == "dflash2" else DrafterLayer
        self.layers = [layer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        if cfg.kind == "dflash2":
            vocab = cast(int, cfg.vocab_size)  # a DFlash 2 config always has one
            self.candidate_selector = CandidateSelector(
                vocab, h, cfg.selector_rank, cfg.selector_top_k
            )
        self.draft_vocab: np.ndarray | None = None  # see DRAFT_VOCAB_FILE (numpy: not a weight)

    def block_mask(self, i: int, start: int, ctx_len: int, bs: int):
        """None (bidirectional, full context) or a boolean (bs, ctx_len + bs) mask."""
        causal, window = self.cfg.layer_is_causal(i), self.cfg.layer_window(i)
        if not causal and window is None:
            return None
        q_pos = mx.arange(start, start + bs)[:, None]
        k_pos = mx.concatenate([mx.arange(start - ctx_len, start), mx.arange(start, start + bs)])
        k_pos = k_pos[None, :]
        in_block = k_pos >= start
        mask = mx.ones((bs, ctx_len + bs), dtype=mx.bool_)
        if causal:
            mask = mask & (~in_block | (k_pos <= q_pos))
        if window is not None:
            mask = mask & (k_pos > q_pos - window)
        return mask

    def context_rows(self) -> int | None:
        """How many of the newest context rows any layer can see (None: all of them). A block's
        first position sees `sliding_window - 1` rows before it, so no more are kept."""
        windows = [self.cfg.layer_window(i) for i in range(len(self.layers))]
        if any(w is None for w in windows):
            return None
        return max(cast(int, w) for w in windows) - 1

    def make_cache(self) -> list[ContextCache]:
        return [ContextCache(self.context_rows()) for _ in self.layers]

    def add_context(self, ctx: mx.array, cache: list[ContextCache]) -> None:
        """Project new target taps (n, n_taps*H) once and append them to every layer's cache.
        Rows no layer will see (a long prefill before a sliding-window drafter) are skipped
        before the projection."""
        keep = self.context_rows()
        if keep is not None and ctx.shape[0] > keep:
            for lc in cache:
                lc.skip(ctx.shape[0] - keep)
            ctx = ctx[ctx.shape[0] - keep :]
        c = self.hidden_norm(self.fc(ctx[None]))
        position = cache[0].end
        for layer, lc in zip(self.layers, cache, strict=True):
            k, v = layer.self_attn.project_kv(c, position)
            lc.append(k, v)

    def __call__(
        self,
        embeds: mx.array,
        caches: list[list[ContextCache]],
        starts: list[int],
        queue=False,
        compile_=False,
    ):
        """Hidden states (R * bs, H) of R blocks packed in `embeds` (R * bs, H), block r at
        positions starts[r].. over its own cached context (caches[r], a cache per layer): the
        projections, MLPs and convolutions run once for all of them. `queue`: each layer
        queued as it is built, as the target's verify is (models/queueing.py). `compile_`: a
        block alone runs each layer's halves compiled, as the target's (models/compiled.py)."""
        h, R = embeds[None], len(starts)
        bs = h.shape[1] // R
        offset: int | mx.array = starts[0]  # one block: RoPE at its start; packed, per token
        if R > 1:
            offset = mx.array(np.concatenate([s + np.arange(bs) for s in starts]), mx.int32)
        compile_ = compile_ and R == 1
        compile_ = compile_ and not cpu_math.applies(bs * self.cfg.intermediate_size, h.dtype)
        for i, layer in enumerate(self.layers):
            cs = [c[i] for c in caches]
            masks = [self.block_mask(i, s, c.visible, bs) for c, s in zip(cs, starts, strict=True)]
            h = layer(h, cs, offset, masks, compile_)
            if queue:
                mx.async_eval(h)
        return self.norm(h)[0]


class DrafterRunner:
    """A drafter bound to a target's embeddings and LM head, with its own context cache.

    The engine talks to every draft source through this interface (tests substitute oracle
    drafters): `add_context` feeds verified taps, `propose` returns logits for the n slots
    after the last verified token.
    """

    def __init__(self, drafter: DFlashDrafter, target):
        self.drafter = drafter
        self.cfg = drafter.cfg
        # The target's embeddings and head, read directly; in a batched row (a BatchedTarget)
        # its passes join the batch's (propose).
        self.target, self.batcher = target.unbatched, target.batcher
        self.block_size = self.cfg.block_size
        self.kind = self.cfg.kind
        corpus = None if drafter.folder is None else Path(drafter.folder) / CORPUS_FILE
        self.corpus_file = str(corpus) if corpus is not None and corpus.is_file() else None
        self._cache = drafter.make_cache()
        # Taps waiting to be projected: while plain steps run (auto's pauses, batched rows),
        # they pile up and are projected in one matmul when a draft next needs them.
        self._pending: list[mx.array] = []
        self._pending_rows = 0
        self.vocab = self.head_rows = self.outside = None
        if drafter.draft_vocab is not None:
            self.vocab = mx.array(drafter.draft_vocab.astype(np.int32))
            if target.vocab_sharding is None:
                self.head_rows = target.draft_head_rows(drafter.draft_vocab)  # (S, H), shared
            else:  # each rank holds a slice of the head: full logits, then the vocabulary
                outside = np.ones(target.vocab_size, dtype=bool)
                outside[drafter.draft_vocab] = False
                self.outside = mx.array(outside)

    @property
    def cache(self) -> list:
        """Every layer's context cache, the pending taps projected into it."""
        self._flush()
        return self._cache

    @property
    def context_len(self) -> int:
        return self._cache[0].end + self._pending_rows

    def reset(self, length: int = 0) -> None:
        for c in self.cache:
            c.trim(length)

    def add_context(self, taps: mx.array) -> None:
        self._pending.append(taps)
        self._pending_rows += int(taps.shape[0])

    def _flush(self) -> None:
        """Project the pending taps into every layer's context, all at once."""
        if self._pending:
            taps = self._pending[0] if len(self._pending) == 1 else mx.concatenate(self._pending)
            self._pending, self._pending_rows = [], 0
            self.drafter.add_context(taps, self._cache)

    def propose(self, last_token: int, start: int, n: int) -> Proposal:
        """The n positions start+1..start+n, from one drafter pass: logits, and a DFlash 2
        drafter's lattice. In a batched row (engine/batch.py) the pass joins the other rows'
        (propose_rows)."""
        if self.batcher is not None and self.batcher.in_row():
            return self.batcher.propose(self, last_token, start, n)
        return self.propose_alone(last_token, start, n)

    def propose_together(self, asks: list[DraftAsk]) -> list[Proposal]:
        """Batched rows' passes as one (propose_rows)."""
        return propose_rows([a.drafter for a in asks], [(a.last_token, a.start, a.n) for a in asks])

    def propose_alone(self, last_token: int, start: int, n: int) -> Proposal:
        """One drafter pass of its own."""
        return propose_rows([self], [(last_token, start, n)])[0]

    def logits(self, h: mx.array) -> mx.array:
        """Logits (n, V) of hidden states h, restricted to the draft vocabulary if it has one."""
        cfg, n = self.cfg, h.shape[0]
        if self.vocab is None:
            return drafter_logits(cfg, self.target, h)
        if self.outside is not None:
            return mx.where(self.outside, -mx.inf, drafter_logits(cfg, self.target, h))
        sub = drafter_logits(cfg, self.target, h, rows=self.head_rows)
        full = mx.full((n, self.target.vocab_size), -mx.inf, dtype=sub.dtype)
        full[:, self.vocab] = sub  # tokens outside the draft vocabulary are never proposed
        return full


def propose_rows(runners: list, requests: list[tuple[int, int, int]]) -> list[Proposal]:
    """Each runner's proposal for its request (last token, start, n: the n positions
    start+1..start+n) from one drafter pass: a row alone, or batched rows packed (engine/batch.py),
    each row's block over its own context, the projections, MLPs, convolutions and the LM head
    shared. Rows of one drafter and target share its draft vocabulary too; a DFlash 2 row's
    lattice is scored from its own slice. Rows of different drafters or targets go one by one."""
    first = runners[0]
    drafter, cfg = first.drafter, first.cfg
    if any(r.drafter is not drafter or r.target is not first.target for r in runners):
        return [propose_rows([r], [q])[0] for r, q in zip(runners, requests, strict=True)]
    bs, starts = cfg.block_size, [start for _, start, _ in requests]
    for r, start in zip(runners, starts, strict=True):
        assert start == r.context_len, "drafter context out of sync with the target"
    blocks = [t for last, _, _ in requests for t in [last] + [cfg.mask_token_id] * (bs - 1)]
    embed = first.target.token_embeddings(mx.array(blocks))
    if cfg.input_embedding_scale is not None:
        embed = embed * cfg.input_embedding_scale
    caches = [r.cache for r in runners]  # (pending taps projected first)
    h = drafter(embed, caches, starts, first.target.queue_layers, first.target.compiled)
    picks = [h[k * bs + 1 : k * bs + 1 + n] for k, (_, _, n) in enumerate(requests)]
    logits = first.logits(picks[0] if len(picks) == 1 else mx.concatenate(picks))
    out: list[Proposal] = []
    at = 0
    for (last, _, n), pick in zip(requests, picks, strict=True):
        rows = logits[at : at + n]
        at += n
        if cfg.kind == "dflash2":
            lattice = drafter.candidate_selector.lattice(pick, rows, last, first.target.compiled)
            out.append(LatticeDrafts(rows, lattice))
        else:
            out.append(Marginals(rows))
    return out


def drafter_logits(
    cfg: DrafterConfig,
    target,
    h: mx.array,
    vocab: mx.array | None = None,
    rows: mx.array | None = None,
):
    """The target's LM head plus the drafter's optional output transforms.

    `vocab`: only these token ids' logits (training's sub-vocabulary loss), in that order;
    `rows`: their LM head rows, when the caller has them already.
    """
    if rows is None and vocab is not None:
        rows = target.lm_head_rows(vocab)
    logits = target.lm_head(h) if rows is None else h @ rows.T
    if cfg.output_multiplier is not None:
        logits = logits * cfg.output_multiplier
    if cfg.final_logit_softcapping is not None:
        cap = cfg.final_logit_softcapping
        logits = mx.tanh(logits / cap) * cap
    return logits


def load_drafter(
    path: str | Path, num_target_layers: int | None = None, target_config: dict | None = None
) -> DFlashDrafter:
    """Load a (converted or published) drafter folder, validated by `checkpoint.read_drafter`
    (with `target_config`, against its target too)."""
    from ..checkpoints.read import CODEBOOKS, read_drafter

    path = Path(path)
    cfg, weights = read_drafter(path, target_config, num_target_layers)
    # The selector's codebooks are nn.Embedding tables here; the checkpoint names them bare.
    weights = {(f"{k}.weight" if k in CODEBOOKS else k): v for k, v in weights.items()}
    model = DFlashDrafter(cfg)
    quant = json.loads((path / "config.json").read_text()).get("quantization")
    if quant:
        nn.quantize(
            model,
            group_size=quant["group_size"],
            bits=quant["bits"],
            class_predicate=lambda p, m: (
                isinstance(m, nn.Linear | nn.Embedding) and f"{p}.scales" in weights
            ),
        )
    try:
        model.load_weights(list(weights.items()), strict=True)
        mx.eval(model.parameters())
    except (ValueError, RuntimeError) as e:
        raise DFlashError(f"Could not load the drafter weights in {path}: {e}") from None
    model.draft_vocab = read_draft_vocab(path, cfg.vocab_size)
    model.folder = path  # (a lookup corpus shipped beside it: DrafterRunner.corpus_file)
    return model


def checkpoint_weights(model: DFlashDrafter) -> dict[str, mx.array]:
    """The drafter's tensors under their published names (bare selector codebooks), so that a
    folder we save loads in z-lab's loader too."""
    from ..checkpoints.read import CODEBOOKS

    bare = {f"{c}.weight": c for c in CODEBOOKS}
    flat = cast(list[tuple[str, mx.array]], nn.utils.tree_flatten(model.parameters()))
    return {bare.get(k, k): v for k, v in flat}


def read_draft_vocab(folder: Path, vocab_size: int | None) -> np.ndarray | None:
    """The drafter folder's draft vocabulary (sorted unique token ids), or None."""
    f = Path(folder) / DRAFT_VOCAB_FILE
    if not f.exists():
        return None
    try:
        ids = np.array(json.loads(f.read_text())["token_ids"], dtype=np.int64)
    except (ValueError, KeyError, TypeError) as e:
        raise DFlashError(f"Could not read {f}: {e}.") from None
    if ids.ndim != 1 or not len(ids):
        raise DFlashError(f"{f} must list at least one token id.")
    if ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size):
        raise DFlashError(f"{f} lists token ids outside the vocabulary of {vocab_size}.")
    return np.unique(ids)


def write_draft_vocab(folder: Path, ids) -> None:
    (Path(folder) / DRAFT_VOCAB_FILE).write_text(
        json.dumps({"token_ids": [int(i) for i in np.unique(np.asarray(ids))]})
    )


def init_drafter(cfg: DrafterConfig, seed: int = 0) -> DFlashDrafter:
    """A randomly initialised drafter (before training; tests)."""
    mx.random.seed(seed)
    model = DFlashDrafter(cfg)
    std = 1.0 / math.sqrt(cfg.hidden_size)
    params = cast(list[tuple[str, mx.array]], nn.utils.tree_flatten(model.parameters()))
    new = [
        (k, mx.ones_like(v) if k.endswith("norm.weight") else mx.random.normal(v.shape) * std)
        for k, v in params
    ]
    model.load_weights(new)
    if cfg.kind == "dflash2":
        _identity_convs(model.layers)
    mx.eval(model.parameters())
    return model


def _identity_convs(layers) -> None:
    """DFlash 2 convolutions that pass their input through: static kernel 1 at offset 0 and no
    dynamic part, so the layer computes what a DFlash 1 layer does until training moves it."""
    for layer in layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            base = mx.zeros_like(conv.base_kernel)
            base[:, 0, :] = 1.0
            conv.base_kernel = base
            conv.kernel_projection.weight = mx.zeros_like(conv.kernel_projection.weight)


def dflash2_config(
    cfg: DrafterConfig, rank: int = 32, top_k: int = 16, kernel_size: int = 2, group_size: int = 16
) -> DrafterConfig:
    """`cfg` with DFlash 2's dynamic convolutions and candidate selector (`--arch dflash2`)."""
    if cfg.hidden_size % group_size:
        raise DFlashError(
            f"DFlash 2 needs a hidden size divisible by {group_size}, not {cfg.hidden_size}."
        )
    return dataclasses.replace(cfg, conv_kernel_size=kernel_size, conv_group_size=group_size,
                               selector_rank=rank, selector_top_k=top_k)  # fmt: skip


def to_dflash2(
    drafter: DFlashDrafter,
    rank: int = 32,
    top_k: int = 16,
    kernel_size: int = 2,
    group_size: int = 16,
    seed: int = 0,
) -> DFlashDrafter:
    """A DFlash 1 drafter grown into a DFlash 2 one that drafts exactly as it did at step 0:
    identity convolutions, and a selector whose hidden projection is zero, so every pairwise
    score is 0 and the chain is the argmax of the logits. Training then moves them (the
    codebooks start random so that their gradient is not zero once the projection moves)."""
    if drafter.cfg.kind == "dflash2":
        raise DFlashError("The drafter to start from is DFlash 2 already.")
    cfg = dflash2_config(drafter.cfg, rank, top_k, kernel_size, group_size)
    grown = init_drafter(cfg, seed=seed)
    old = cast(list[tuple[str, mx.array]], nn.utils.tree_flatten(drafter.parameters()))
    grown.load_weights(old, strict=False)
    sel = grown.candidate_selector
    sel.hidden_projection.weight = mx.zeros_like(sel.hidden_projection.weight)
    mx.eval(grown.parameters())
    grown.draft_vocab = drafter.draft_vocab
    return grown


def reshape_drafter(
    drafter: DFlashDrafter,
    layers: int,
    block_size: int,
    seed: int = 0,
    intermediate_size: int | None = None,
):
    """`drafter` deepened to `layers` layers, its MLPs widened to `intermediate_size` units, and
    retrained at `block_size`, drafting exactly as before at step 0. What is added gets random
    weights but zero output weights (the new layers' o_proj and down_proj, the new MLP units'
    down_proj columns): it adds nothing to the residual stream until training moves it, so a
    bigger drafter starts from a trained one's tau instead of from scratch (its plateau costs
    hundreds of steps on a CPU). The weights know positions only through RoPE, so the block
    size is free."""
    cfg = drafter.cfg
    n, width = cfg.num_hidden_layers, cfg.intermediate_size
    wide = intermediate_size or width
    for flag, new_size, old_size in (("--layers", layers, n), ("--intermediate-size", wide, width)):
        if new_size < old_size:
            raise DFlashError(
                f"{flag} {new_size}: the drafter to start from has {old_size}; it can only grow."
            )
    new_cfg = dataclasses.replace(
        cfg,
        num_hidden_layers=layers,
        layer_types=list(cfg.layer_types) + [cfg.layer_types[-1]] * (layers - n),
        block_size=block_size,
        intermediate_size=wide,
    )
    grown = init_drafter(new_cfg, seed=seed)
    old = dict(nn.utils.tree_flatten(drafter.parameters()))
    new = dict(nn.utils.tree_flatten(grown.parameters()))
    for name, w in old.items():  # the old MLP weights fill the first `width` units
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            w = mx.concatenate([w, new[name][width:]], axis=0)
        elif name.endswith("down_proj.weight"):
            w = mx.concatenate([w, mx.zeros((w.shape[0], wide - width), w.dtype)], axis=1)
        new[name] = w
    grown.load_weights(list(new.items()), strict=True)
    for layer in grown.layers[n:]:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    mx.eval(grown.parameters())
    grown.draft_vocab = drafter.draft_vocab
    return grown


# mypy checks DrafterRunner against the engine's Drafter protocol (engine/contract.py)
if TYPE_CHECKING:
    from ..engine.contract import Drafter

    _conforms_drafterrunner: type[Drafter] = DrafterRunner
