"""The drafter trainer (docs/training.md): a fresh drafter shaped for the target, AdamW with
warm-up and cosine decay, clipping, checkpoints and resume, and tau measured with the engine.

The target stays frozen: its taps are computed per batch (or cached), and its embeddings and
LM head are borrowed, never updated.
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

from ..checkpoints.resolve import resolve_model
from ..engine import GenerationConfig, Session, Stats, stream_generate
from ..errors import DFlashError
from ..models.drafter import DFlashDrafter, DrafterRunner
from ..models.drafter_config import DRAFTER_ARCHITECTURE, DrafterConfig, default_target_layer_ids
from ..models.target import load_target
from ..paths import DEFAULT_TARGET
from ..progress import progress
from ..prompt_files import read_prompt_file
from ..prompts import stop_ids
from .batches import cache_all_taps, loss_vocabulary, make_batch, tap_scale, usable
from .checkpoint import CURVE_FILE, save_checkpoint
from .data import story_prompts
from .forward import block_loss, metrics
from .tapstore import soft_targets


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
    kl_weight: float = 0.0  # distillation: weight of the target's soft targets in each slot


def new_drafter_config(
    target,
    layers: int = 2,
    taps: list[int] | None = None,
    block_size: int = 16,
    mask_token_id: int | None = None,
    heads: int | None = None,
    window: int | None = None,
    intermediate_size: int | None = None,
) -> DrafterConfig:
    """A fresh drafter shaped like the target's layers (same width, heads and MLP).

    `intermediate_size` overrides the MLP width: capacity without another sequential layer.

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
        "intermediate_size": intermediate_size or int(tc["intermediate_size"]),
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
    tok = target.tokenizer
    stops = stop_ids(tok)
    for name in ("unk_token_id", "pad_token_id"):
        tid = getattr(tok, name, None)
        if tid is not None and tid not in stops and 0 <= tid < target.vocab_size:
            return int(tid)
    return target.vocab_size - 1


def eval_tau(drafter: DFlashDrafter, target, prompts: list[list[int]], max_tokens: int) -> dict:
    """Mean tau of real DFlash greedy decoding (the engine itself) on held-out prompts."""
    target.set_taps(drafter.cfg.target_layer_ids)
    cfg = GenerationConfig(
        max_tokens=max_tokens, mode="dflash", stop_ids=stop_ids(target.tokenizer)
    )
    total, per_prompt = Stats(), []
    for ids in prompts:
        session = Session(target, DrafterRunner(drafter, target))
        stats = Stats()
        for chunk in stream_generate(session, ids, cfg):
            stats = chunk.stats
        total.merge(stats)
        if stats.taus:
            per_prompt.append(stats.mean_tau)
    return {
        "tau": total.mean_tau,
        "tau_per_response": float(np.mean(per_prompt)) if per_prompt else 0.0,
        "rounds": len(total.taus),
        "histogram": total.histogram,
    }


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


@dataclass
class Trainer:
    """Owns the drafter, the optimizer and the step; `run` trains up to cfg.steps."""

    target: object
    drafter: DFlashDrafter
    records: list[dict]
    cfg: TrainConfig
    out: Path | None = None
    eval_prompts: list[list[int]] = field(default_factory=list)
    # Named prompt sets measured beside the held-out prompts at every evaluation (the
    # benchmark sets: does the drafter generalise beyond its data?), logged to OUT/curve.jsonl.
    eval_sets: dict[str, list[list[int]]] = field(default_factory=dict)
    step: int = 0
    seen_tokens: int = 0  # response tokens of the sequences trained on so far (with repeats)
    opt_state: dict | None = None
    history: list[dict] = field(default_factory=list)
    fresh: bool = False  # a new random drafter: its fc init is drawn in the preconditioned space

    def __post_init__(self):
        cfg = self.cfg
        self.target.set_taps(self.drafter.cfg.target_layer_ids)
        self.records = usable(self.records, cfg.max_len)
        if not self.records:
            raise DFlashError("No training record has a response of at least two tokens.")
        if cfg.loss_vocab not in ("full", "corpus"):
            raise DFlashError(f"--loss-vocab is 'full' or 'corpus', not '{cfg.loss_vocab}'.")
        self.taps = None
        if cfg.cache_taps:
            self.taps = cache_all_taps(
                self.target, self.records, cfg.max_len, out=self.out, with_soft=cfg.kl_weight > 0
            )
        self.soft = None
        if cfg.kl_weight > 0:
            if self.out is None:
                raise DFlashError("Distillation (--kl-weight) reads soft targets from --out.")
            self.soft = soft_targets(self.records, self.out, self.target.tap_ids)
            if not any(x is not None for x in self.soft):
                raise DFlashError(
                    "--kl-weight needs soft targets: kept while answering, or computed with "
                    "the taps (--cache-taps); these answers have none."
                )
        self.vocab = None
        if cfg.loss_vocab == "corpus":
            self.vocab = loss_vocabulary(self.records, cfg.max_len)
            self.others = np.setdiff1d(np.arange(self.target.vocab_size), self.vocab)
        # Trained to rank only these tokens, it drafts only these (cheaper LM head at inference).
        self.drafter.draft_vocab = self.vocab
        self.scale = None
        if cfg.precondition:
            taps = self.taps
            if taps is None:  # uncached: the first batch's rows without their padding
                b = self.batch(0)
                taps = [b["taps"][i, :n] for i, n in enumerate(b["lengths"].tolist())]
            self.scale = tap_scale(taps)
            if self.fresh:
                self.drafter.fc.weight = self.drafter.fc.weight * self.scale
        self.opt = make_optimizer(cfg)
        if self.opt_state is not None:
            self.opt.state = self.opt_state
        self._grad = nn.value_and_grad(self.drafter, self._loss)

    def _loss(self, model, batch):
        return block_loss(model, self.target, batch, self.cfg.gamma, self.cfg.kl_weight)

    def batch(self, step: int) -> dict:
        """Deterministic in (seed, step), so a resumed run sees the batches it would have."""
        rng = np.random.default_rng([self.cfg.seed, step])
        n = len(self.records)
        idx = rng.choice(n, size=self.cfg.batch, replace=n < self.cfg.batch)
        taps = None if self.taps is None else [self.taps[i] for i in idx]
        soft = None if self.soft is None else [self.soft[i] for i in idx]
        batch = make_batch([self.records[i] for i in idx], rng, self.cfg, self.target, taps, soft)
        if self.vocab is not None:
            k = min(self.cfg.negatives, len(self.others))
            vocab = np.concatenate([self.vocab, rng.choice(self.others, size=k, replace=False)])
            lookup = np.full(self.target.vocab_size, -1, dtype=np.int32)
            lookup[vocab] = np.arange(len(vocab))
            batch["vocab"], batch["lookup"] = mx.array(vocab), mx.array(lookup)
        return batch

    def train_step(self) -> dict:
        """One update; with preconditioning, in the scaled space (see `tap_scale`), and back."""
        batch = self.batch(self.step)
        response_tokens = batch.pop("response_tokens")
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
        self.seen_tokens += response_tokens
        return metrics(loss, hits, valid, norm)

    def evaluate(self) -> dict | None:
        if not self.eval_prompts:
            return None
        return eval_tau(self.drafter, self.target, self.eval_prompts, self.cfg.eval_tokens)

    def save(self) -> None:
        if self.out is not None:
            meta = {
                "config": asdict(self.cfg),
                "history": self.history[-50:],
                "seen_tokens": self.seen_tokens,
            }
            save_checkpoint(self.out, self.drafter, self.opt, self.step, meta)

    def run(self, show: bool = True) -> list[dict]:
        """Train to cfg.steps with a progress bar; evaluate and save on schedule and at the end."""
        with progress(eta=True, info=True, show=show, transient=False) as bar:
            task = bar.add_task("train", total=self.cfg.steps, completed=self.step, info="")
            t0 = time.perf_counter()
            if self.cfg.eval_every and self.step == 0 and self.eval_sets:
                self._eval_line(bar)  # where the curve starts
            while self.step < self.cfg.steps:
                m = self.train_step()
                m["step"] = self.step
                bar.update(task, completed=self.step, info=_info(m))
                if show and not bar.console.is_terminal and self.step % 25 == 0:
                    bar.console.print(f"step {self.step}: {_info(m)}")
                if self.cfg.eval_every and self.step % self.cfg.eval_every == 0:
                    m.update(self._eval_line(bar))
                if self.cfg.save_every and self.step % self.cfg.save_every == 0:
                    self.save()
                self.history.append(m)
            if self.history:
                self.history[-1]["elapsed_s"] = time.perf_counter() - t0
        self.save()
        return self.history

    def _eval_line(self, bar) -> dict:
        """Tau on the held-out prompts and on each named set (see `eval_sets`), printed and
        added to OUT/curve.jsonl."""
        ev = self.evaluate()
        line, curve = {}, {}
        if ev is not None:
            hist = " ".join(f"{k}:{v}" for k, v in ev["histogram"].items())
            bar.console.print(
                f"step {self.step}: eval tau {ev['tau']:.2f} "
                f"(per response {ev['tau_per_response']:.2f}, {ev['rounds']} rounds) [{hist}]"
            )
            line = {"eval_tau": ev["tau"], "eval_tau_per_response": ev["tau_per_response"]}
            curve["held-out"] = ev["tau"]
        if self.eval_sets:
            taus = {
                name: round(eval_tau(self.drafter, self.target, ps, self.cfg.eval_tokens)["tau"], 4)
                for name, ps in self.eval_sets.items()
            }
            bar.console.print(
                f"step {self.step}: tau by set "
                + ", ".join(f"{name} {tau:.2f}" for name, tau in taus.items())
            )
            line["eval_sets"] = taus
            curve.update(taus)
        if curve and self.out is not None:
            point = {"step": self.step, "seen_tokens": self.seen_tokens, **curve}
            self.out.mkdir(parents=True, exist_ok=True)
            with (self.out / CURVE_FILE).open("a") as f:
                f.write(json.dumps(point) + "\n")
        return line


def _info(m: dict) -> str:
    acc = " ".join(f"{100 * a:.0f}" for a in m["acc"][:6])
    return f"loss {m['loss']:.3f} | acc% {acc} … | block tau {m['block_tau']:.2f}"


def prepare_prompts(
    target, data: list[Path], out: Path, n: int, seed: int, story_words: int = 6
) -> list[str]:
    """The prompt list, fixed once in out/prompts.jsonl so a resumed run sees the same split."""
    saved = out / "prompts.jsonl"
    if saved.exists():
        return [json.loads(line)["prompt"] for line in saved.read_text().splitlines() if line]
    if data:
        # (prompt_files.py: the first known text field of each record, or a chat's first turn)
        prompts = [p for path in data for p in read_prompt_file(path)]
        if n:
            prompts = prompts[:n]
    elif getattr(target.tokenizer, "chat_template", None):
        raise DFlashError("This target has a chat template: pass prompts with --data FILE.jsonl.")
    else:
        prompts = story_prompts(target, n or 1024, seed=seed, max_words=story_words)
    out.mkdir(parents=True, exist_ok=True)
    saved.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return prompts


def load_training_target(model: str | None, dequantize: bool):
    """The target (default: the embedded stories260K), optionally dequantized to float32."""
    target = load_target(resolve_model(model or str(DEFAULT_TARGET), "target"))
    if dequantize and target.config.get("quantization"):
        from mlx_lm.utils import dequantize_model

        target.model = dequantize_model(target.model)
        target.model.set_dtype(mx.float32)
        target.inner = target.model.model
        target.layers = target.inner.layers
    target.model.freeze()
    return target
