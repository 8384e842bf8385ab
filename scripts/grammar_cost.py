"""Per-token mask cost of llguidance and xgrammar on this CPU (issue 31's choice of library).

    python scripts/grammar_cost.py TOKENIZER_DIR [--lib llguidance|xgrammar] [--schema FILE]

Replays one valid JSON document, token by token, through each library's matcher and times the
mask of every step (plus the grammar's compile time). xgrammar needs torch; run it from an
environment that has it. Prints one JSON line per library.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
DOC = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "tags": ["math", "engines", "poetry"],
    "address": {"city": "London", "zip": "W1"},
}


def llguidance_cost(tok, schema, text) -> dict:
    import llguidance
    import llguidance.hf
    import numpy as np
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    t0 = time.perf_counter()
    lt = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    t1 = time.perf_counter()
    m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_json_schema(schema))
    t2 = time.perf_counter()
    ids = tok.encode(text, add_special_tokens=False)
    mask = allocate_token_bitmask(1, len(tok))
    times = []
    for t in ids:
        s = time.perf_counter()
        fill_next_token_bitmask(m, mask)
        times.append(time.perf_counter() - s)
        bit = (mask[0, t // 32] >> (t % 32)) & 1
        assert bit, f"token {t} not allowed"
        assert m.consume_token(t), m.get_error()
    ff = time.perf_counter()
    m.reset()
    m.compute_ff_tokens()
    ff = time.perf_counter() - ff
    assert np.all(mask.shape)
    return _report("llguidance", t1 - t0, t2 - t1, times) | {"ff_tokens_ms": ff * 1e3}


def xgrammar_cost(tok, schema, text) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema))
    m = xgr.GrammarMatcher(compiled)
    t2 = time.perf_counter()
    ids = tok.encode(text, add_special_tokens=False)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    times = []
    for t in ids:
        s = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - s)
        assert m.accept_token(t), f"token {t} rejected"
    return _report("xgrammar", t1 - t0, t2 - t1, times)


def _report(lib, t_tok, t_compile, times) -> dict:
    ms = [t * 1e3 for t in times]
    return {
        "lib": lib,
        "tokenizer_s": round(t_tok, 3),
        "compile_ms": round(t_compile * 1e3, 2),
        "tokens": len(ms),
        "mask_ms_mean": round(statistics.mean(ms), 3),
        "mask_ms_median": round(statistics.median(ms), 3),
        "mask_ms_max": round(max(ms), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tokenizer")
    ap.add_argument("--lib", action="append", choices=["llguidance", "xgrammar"])
    ap.add_argument("--schema")
    ap.add_argument("--doc")
    a = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    schema = json.load(open(a.schema)) if a.schema else SCHEMA
    text = json.dumps(json.load(open(a.doc)) if a.doc else DOC, indent=2)
    for lib in a.lib or ["llguidance"]:
        fn = llguidance_cost if lib == "llguidance" else xgrammar_cost
        print(json.dumps(fn(tok, schema, text)))


if __name__ == "__main__":
    main()
