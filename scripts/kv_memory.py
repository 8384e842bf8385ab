"""KV cache memory at a long context, float against --kv-bits (issue 51's goal: 0.3x float16 or
less at 4 bits), with MLX's peak memory (as mlx-lm reports it) and the greedy tokens after it.

Each run prefills CONTEXT tokens of real text (the bench sets' prompts, tokenized and joined)
into a fresh session and decodes a few tokens plainly, with a float KV cache and then with a
quantized one (from the first token: --quantized-kv-start 0). Usage:

    .venv/bin/python scripts/kv_memory.py models/smollm2-135m-instruct-f32 --context 8192

On this CPU a target runs in float32, so its quantized rows carry float32 scales and biases;
on a Mac, a float16 / bfloat16 target's carry 16-bit ones, which the last column states (the
same rows at 16 bits: arithmetic on the measured shapes, not a second run).
"""

# isort: skip_file
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx_dflash  # noqa: F401  (first: OpenBLAS must load before mlx)
import mlx.core as mx

from mlx_dflash.engine import GenerationConfig, Session, generate_rounds
from mlx_dflash.models.cache import KVQuantization, QuantizedKVCache
from mlx_dflash.models.target import load_target
from mlx_dflash.benchmark.datasets import default_data_dir

NEW_TOKENS = 8


def context_ids(tokenizer, n: int) -> list[int]:
    """n tokens of real text: GSM8K questions, joined."""
    ids: list[int] = []
    bench = default_data_dir()
    if bench is None:
        raise SystemExit("no bench data (../shared/data/bench) for the context text")
    with open(bench / "gsm8k_test.jsonl") as f:
        for line in f:
            ids += tokenizer.encode(json.loads(line)["question"] + "\n")
            if len(ids) >= n:
                return ids[:n]
    raise SystemExit(f"not enough text for {n} tokens")


def cache_bytes(cache, rows: int) -> tuple[int, int]:
    """(bytes of the first `rows` rows of every attention layer's keys and values, the same
    with 16-bit floats: float16 rows, or 16-bit scales and biases)."""
    held = half = 0
    for c in cache:
        arrays = c.state_arrays
        if not arrays:
            continue
        for a in arrays:
            n = a[..., :rows, :].nbytes
            held += n
            floating = a.dtype in (mx.float32, mx.float16, mx.bfloat16)
            half += n * 2 // a.dtype.size if floating else n
    return held, half


def run(target, ids: list[int], kv: KVQuantization | None) -> dict:
    mx.clear_cache()
    mx.reset_peak_memory()
    session = Session(target, kv=kv)
    t0 = time.perf_counter()
    out: list[int] = []
    cfg = GenerationConfig(max_tokens=NEW_TOKENS, mode="ar", prefill_chunk=512)
    for r in generate_rounds(session, ids, cfg):
        out += r.tokens
    held, half = cache_bytes(session.cache, len(session.tokens))
    quantized = any(isinstance(c, QuantizedKVCache) and c.quantized for c in session.cache)
    return {
        "kv": "float" if kv is None else f"{kv.bits}-bit, group {kv.group_size}",
        "quantized": quantized,
        "kv_bytes": held,
        "kv_bytes_16bit": half,
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
        "seconds": time.perf_counter() - t0,
        "tokens": out,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--group-size", type=int, default=64)
    args = ap.parse_args()
    target = load_target(args.model)
    ids = context_ids(target.tokenizer, args.context)
    print(f"{args.model.name}, {args.context} tokens of context, {NEW_TOKENS} new (greedy)")
    print(f"{'KV cache':<20}{'KV MB':>9}{'x float':>9}{'peak GB':>9}{'16-bit: x f16':>15}"
          f"{'seconds':>9}  tokens", flush=True)  # fmt: skip
    base = None
    for kv in [None] + [KVQuantization(b, args.group_size, 0) for b in args.bits]:
        r = run(target, ids, kv)
        base = base or r
        ratio = r["kv_bytes"] / base["kv_bytes"]
        ratio16 = r["kv_bytes_16bit"] / base["kv_bytes_16bit"]
        same = "same as float" if r["tokens"] == base["tokens"] else "differ from float"
        print(f"{r['kv']:<20}{r['kv_bytes'] / 1e6:>9.1f}{ratio:>9.3f}{r['peak_memory_gb']:>9.2f}"
              f"{ratio16:>15.3f}{r['seconds']:>9.1f}  {same}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
