"""GGUF (llama.cpp) -> Hugging Face-style folder that `mlx_lm.load` reads, for llama and qwen2.

The file is read with the `gguf` package, llama.cpp's own format library (MLX's built-in reader
silently mis-dequantizes Q4_K and cannot read Q5_0). Q4_0 / Q4_1 / Q8_0 blocks are exactly MLX
affine group-32 quantization, so they are repacked into `weight`/`scales`/`biases` triples and
stay quantized (config.json gets the matching `quantization` block); a sample of rows of each is
checked against `gguf`'s dequantization, and a mismatch stops the conversion. Every other quant
type (the K-quants, Q5_0, Q5_1, ...) is dequantized by `gguf` to float16; float tensors stay.

llama.cpp stores llama q/k rows permuted for its interleaved RoPE; that is undone here (on
weight, scales and biases alike, since MLX groups run along the input dim). qwen2 uses NeoX RoPE
in llama.cpp, so its rows are left alone. The tokenizer is rebuilt from `tokenizer.ggml.*`.

Usage: python -m convert.gguf model.gguf models/my-model
"""

from __future__ import annotations

import argparse
import math
import re
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader
from gguf.quants import dequantize
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers.models import BPE

from convert import DFlashError, atomic_folder, file_sha256, interleaved_to_half, write_json
from convert.llama2c import CONTROL, USER_DEFINED, build_spm_tokenizer

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
GROUP_SIZE = 32  # every GGUF type MLX keeps quantized (Q4_0, Q4_1, Q8_0) uses 32-wide blocks

TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
PER_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
TENSOR = re.compile(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias|scales|biases)")

# Pre-tokenizers by `tokenizer.ggml.pre`, as the original tokenizer.json files define them.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def _regex_then_bytes(pattern: str):
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )


def bpe_pre_tokenizer(pre: str):
    """(normalizer, pre_tokenizer, ignore_merges) for a GGUF `tokenizer.ggml.pre` name."""
    if pre == "smollm":
        return (
            None,
            pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                ]
            ),
            False,
        )
    if pre == "qwen2":
        return normalizers.NFC(), _regex_then_bytes(QWEN2_SPLIT), False
    if pre == "llama-bpe":
        return None, _regex_then_bytes(LLAMA3_SPLIT), True
    if pre in ("default", "gpt-2"):
        return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False
    raise DFlashError(
        f"GGUF pre-tokenizer '{pre}' is not supported (supported: smollm, qwen2, llama-bpe, gpt-2)."
    )


def _scalar(meta: dict, key: str, default=None):
    """A GGUF metadata value as a Python scalar (mx.load returns 0-d arrays)."""
    value = meta.get(key, default)
    if isinstance(value, mx.array):
        value = value.item()
    return value


def _clean_float(x: float) -> float:
    """GGUF stores float32: 9.999999747e-06 is written back as the 1e-05 it came from."""
    return float(f"{x:.7g}")


def _special_tokens(meta: dict) -> dict[str, int]:
    """bos/eos/unk/pad token ids present in the metadata."""
    ids = {}
    for name in ("bos", "eos", "unknown", "padding", "eot"):
        value = _scalar(meta, f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            ids[name] = int(value)
    return ids


def eos_ids(meta: dict, tokens: list[str]) -> list[int]:
    """End-of-sequence ids, the chat end-of-turn token first.

    Chat models' GGUFs sometimes name <|endoftext|> as EOS while the chat template closes each
    turn with <|im_end|> (or <|eot_id|>, ...): generation must stop on both.
    """
    special = _special_tokens(meta)
    template = meta.get("tokenizer.chat_template") or ""
    ids = [tokens.index(t) for t in CHAT_END_TOKENS if t in template and t in tokens]
    ids += [special[k] for k in ("eos", "eot") if k in special]
    return list(dict.fromkeys(ids))


def build_bpe_tokenizer(meta: dict) -> Tokenizer:
    """tokenizer.json for a byte-level BPE ('gpt2') GGUF vocabulary."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = np.array(meta["tokenizer.ggml.token_type"]).tolist()
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    if len(types) != len(tokens):
        raise DFlashError("GGUF tokenizer has a token_type list of the wrong length.")
    if any(len(m) != 2 for m in merges):
        raise DFlashError("GGUF tokenizer merges are not 'left right' pairs.")
    normalizer, pre_tokenizer, ignore_merges = bpe_pre_tokenizer(
        meta.get("tokenizer.ggml.pre", "default")
    )
    vocab = {t: i for i, t in enumerate(tokens)}
    tokenizer = Tokenizer(
        BPE(vocab=vocab, merges=merges, dropout=None, fuse_unk=False, ignore_merges=ignore_merges)
    )
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    specials = [t for t, k in zip(tokens, types, strict=True) if k == CONTROL]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    user = [t for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED]
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    bos = _special_tokens(meta).get("bos")
    if _scalar(meta, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]}:0 $A:0",
            pair=f"{tokens[bos]}:0 $A:0 {tokens[bos]}:1 $B:1",
            special_tokens=[(tokens[bos], bos)],
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def build_tokenizer(meta: dict) -> Tokenizer:
    """tokenizer.json from `tokenizer.ggml.*` (byte-level BPE or sentencepiece BPE)."""
    model = meta.get("tokenizer.ggml.model")
    if model == "gpt2":
        return build_bpe_tokenizer(meta)
    if model == "llama":
        tokens = list(meta["tokenizer.ggml.tokens"])
        bos = _special_tokens(meta).get("bos")
        return build_spm_tokenizer(
            tokens,
            np.array(meta["tokenizer.ggml.scores"]).tolist(),
            np.array(meta["tokenizer.ggml.token_type"]).tolist(),
            bos=tokens[bos] if bos is not None else None,
            add_bos=bool(_scalar(meta, "tokenizer.ggml.add_bos_token", True)),
            add_dummy_prefix=bool(_scalar(meta, "tokenizer.ggml.add_space_prefix", True)),
        )
    raise DFlashError(f"GGUF tokenizer model '{model}' is not supported (gpt2 or llama only).")


def tokenizer_files(meta: dict) -> tuple[dict, dict | None]:
    """tokenizer_config.json and generation_config.json contents."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    special = _special_tokens(meta)
    eos = eos_ids(meta, tokens)
    spm = meta.get("tokenizer.ggml.model") == "llama"

    def name(kind):
        return tokens[special[kind]] if kind in special else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("bos"),
        "eos_token": tokens[eos[0]] if eos else None,
        "unk_token": name("unknown"),
        "pad_token": name("padding"),
        "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token", spm)),
        "add_eos_token": bool(_scalar(meta, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": _scalar(meta, f"{meta['general.architecture']}.context_length"),
    }
    if template := meta.get("tokenizer.chat_template"):
        config["chat_template"] = template
    generation = None
    if eos:
        generation = {"bos_token_id": special.get("bos"), "eos_token_id": eos}
        generation["pad_token_id"] = special.get("padding")
        generation = {k: v for k, v in generation.items() if v is not None}
    return config, generation


def rope_scaling(meta: dict, arch: str, tensors: dict, head_dim: int, theta: float) -> dict | None:
    """HF rope_scaling from GGUF metadata, or from llama.cpp's baked `rope_freqs` (Llama 3.x)."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none") and "rope_freqs.weight" not in tensors:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _scalar(meta, f"{arch}.rope.scaling.factor")}
    if kind not in (None, "none"):
        raise DFlashError(f"GGUF rope scaling '{kind}' is not supported.")
    return llama3_scaling(np.array(tensors["rope_freqs.weight"], dtype=np.float64), head_dim, theta)


def llama3_rope_factors(head_dim, theta, factor, low=1.0, high=4.0, original=8192) -> np.ndarray:
    """The per-frequency divisors llama.cpp's convert_hf_to_gguf bakes into `rope_freqs`."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, mid))


def llama3_scaling(rope_freqs: np.ndarray, head_dim: int, theta: float) -> dict:
    """Recover Llama 3.x rope_scaling from `rope_freqs`, accepting it only if it matches exactly."""
    factor = float(rope_freqs.max())
    expected = llama3_rope_factors(head_dim, theta, factor)
    if expected.shape != rope_freqs.shape or not np.allclose(expected, rope_freqs, rtol=1e-4):
        raise DFlashError("GGUF rope_freqs do not match Llama 3 rope scaling; cannot convert it.")
    return {
        "rope_type": "llama3",
        "factor": _clean_float(factor),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def model_config(meta: dict, tensors: dict) -> dict:
    """config.json fields for mlx-lm's llama / qwen2 from `{arch}.*` metadata."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise DFlashError(f"GGUF architecture '{arch}' is not supported (llama or qwen2 only).")

    def get(key, default=None):
        value = _scalar(meta, f"{arch}.{key}", default)
        if value is None:
            raise DFlashError(f"GGUF metadata lacks '{arch}.{key}'.")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise DFlashError("GGUF models with partial rotary embeddings are not supported.")
    if arch == "qwen2" and head_dim != hidden // heads:
        raise DFlashError("qwen2 GGUF with head_dim != hidden_size / heads is not supported.")
    theta = _clean_float(get("rope.freq_base", 10000.0))
    vocab = get("vocab_size", len(meta["tokenizer.ggml.tokens"]))
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "vocab_size": int(vocab),
        "max_position_embeddings": int(get("context_length")),
        "hidden_act": "silu",
        "rms_norm_eps": _clean_float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_scaling": rope_scaling(meta, arch, tensors, head_dim, theta),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if arch == "llama":
        config["head_dim"] = head_dim
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = False
    else:
        config["use_sliding_window"] = False
    tokens = list(meta.get("tokenizer.ggml.tokens", []))
    special = _special_tokens(meta)
    if "bos" in special:
        config["bos_token_id"] = special["bos"]
    if eos := eos_ids(meta, tokens):
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return config


def mlx_name(name: str) -> str | None:
    """mlx-lm key for a GGUF tensor name; None for tensors folded into config (rope_freqs)."""
    match = TENSOR.fullmatch(name)
    if name == "rope_freqs.weight":
        return None
    if match is None:
        raise DFlashError(f"GGUF tensor '{name}' has no mlx-lm equivalent.")
    layer, base, suffix = match.groups()
    table = TOP_LEVEL if layer is None else PER_LAYER
    if base not in table:
        raise DFlashError(f"GGUF tensor '{name}' has no mlx-lm equivalent.")
    module = table[base] if layer is None else f"model.layers.{layer}.{table[base]}"
    return f"{module}.{suffix}"


def mlx_weights(tensors: dict, config: dict) -> dict[str, mx.array]:
    """Rename GGUF tensors to mlx-lm keys; undo llama.cpp's llama q/k row permutation."""
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    out = {}
    for name, value in tensors.items():
        key = mlx_name(name)
        if key is None:
            continue
        base = name.split(".")[-2]
        if config["model_type"] == "llama" and base in heads:
            value = interleaved_to_half(value, heads[base])
        out[key] = value
    return out


def in_features(module: str, config: dict) -> int:
    """Input width of a projection/embedding, to read bits off MLX's packed shapes."""
    if module.endswith("o_proj"):
        return config["num_attention_heads"] * config.get(
            "head_dim", config["hidden_size"] // config["num_attention_heads"]
        )
    if module.endswith("down_proj"):
        return config["intermediate_size"]
    return config["hidden_size"]


def quantization(weights: dict[str, mx.array], config: dict) -> dict | None:
    """mlx-lm's `quantization` block: the common (group_size, bits), per-module overrides.

    Q8_0 embeddings next to Q4_1 layers are common, and older mlx-lm versions apply the default
    bits to every module that has scales, so modules that differ are named explicitly.
    """
    specs = {}
    for key in weights:
        if not key.endswith(".scales"):
            continue
        module = key[: -len(".scales")]
        width = in_features(module, config)
        group = width // weights[key].shape[-1]
        bits = weights[f"{module}.weight"].shape[-1] * 32 // width
        if group != GROUP_SIZE or bits not in (2, 3, 4, 5, 6, 8):
            raise DFlashError(f"Cannot read the quantization of GGUF tensor {module}.")
        specs[module] = {"group_size": group, "bits": bits}
    if not specs:
        return None
    default_bits = Counter(s["bits"] for s in specs.values()).most_common(1)[0][0]
    block = {"group_size": GROUP_SIZE, "bits": default_bits}
    block.update({m: s for m, s in specs.items() if s["bits"] != default_bits})
    return block


def provenance(path: Path, meta: dict, source: str = "") -> str:
    """PROVENANCE.md: the source GGUF, its hash and licence, and what was changed."""
    name = meta.get("general.name", path.stem)
    license_ = meta.get("general.license", "see the original model card")
    return (
        "# Provenance\n\n"
        f"Converted by `convert/gguf.py` (mlx-dflash) from `{path.name}` ({name})"
        f"{'; the file is ' + source if source else ''}.\n\n"
        f"sha256: `{file_sha256(path)}`\n\nLicence (GGUF `general.license`): {license_}\n\n"
        "Changes: tensors renamed to mlx-lm keys and kept in their GGUF precision (Q4_0/Q4_1/Q8_0\n"
        "repacked into MLX affine group-32 quantization, checked against the gguf package; other\n"
        "quant types dequantized to float16 by the gguf package); llama\n"
        "q/k rows un-permuted from llama.cpp's interleaved RoPE layout; tokenizer.json rebuilt\n"
        "from the GGUF tokenizer metadata.\n"
    )


# GGUF types that are MLX affine quantization as they stand: (bits, block bytes).
AFFINE = {QT.Q4_0: (4, 18), QT.Q4_1: (4, 20), QT.Q8_0: (8, 34)}
CHECKED_ROWS = 8  # rows of each repacked tensor compared with gguf's own dequantization


def read_gguf(path: str | Path) -> tuple[dict[str, mx.array], dict]:
    """Tensors (mlx arrays; Q4_0/Q4_1/Q8_0 as `X.weight/.scales/.biases` triples) and
    metadata of a GGUF file, with a clear error for missing or foreign files."""
    path = Path(path)
    if not path.is_file():
        raise DFlashError(f"The GGUF file {path} does not exist.")
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, KeyError) as e:
        raise DFlashError(f"{path} is not a readable GGUF file ({e}).") from e
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors: dict[str, mx.array] = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists the innermost dim first
        qtype = QT(t.tensor_type)
        data = np.asarray(t.data)
        if qtype in (QT.F32, QT.F16):
            tensors[t.name] = mx.array(data.reshape(shape))
        elif qtype == QT.BF16:  # exact in bfloat16, which numpy lacks
            x = dequantize(data, qtype).reshape(shape)
            tensors[t.name] = mx.array(x).astype(mx.bfloat16)
        elif qtype in AFFINE:
            base = t.name.removesuffix(".weight")
            triple = affine_triple(data.reshape(-1, AFFINE[qtype][1]), qtype, shape)
            _check_rows(t.name, qtype, data, triple, shape)
            names = [f"{base}.weight", f"{base}.scales", f"{base}.biases"]
            tensors.update(zip(names, triple, strict=True))
        else:
            try:
                x = dequantize(data, qtype)
            except NotImplementedError:
                raise DFlashError(f"GGUF tensor {t.name} has type {qtype.name}, which the gguf "
                                  "package cannot dequantize.") from None  # fmt: skip
            tensors[t.name] = mx.array(x.reshape(shape).astype(np.float16))
    return tensors, meta


def affine_triple(blocks: np.ndarray, qtype: QT, shape: tuple[int, ...]):
    """MLX (packed uint32 weight, float16 scales, float16 biases) of ggml blocks of 32 values:
    Q4_0 is d * (q - 8), Q4_1 d * q + m, Q8_0 d * q with q signed; all exact as scale * q' + bias."""
    bits = AFFINE[qtype][0]
    d = blocks[:, 0:2].copy().view(np.float16)[:, 0]
    if qtype == QT.Q8_0:
        q = (blocks[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint32)
        bias = d * np.float16(-128)
    else:
        at = 4 if qtype == QT.Q4_1 else 2
        packed = blocks[:, at : at + 16]
        q = np.concatenate([packed & 15, packed >> 4], axis=1).astype(np.uint32)  # ggml order
        bias = (
            blocks[:, 2:4].copy().view(np.float16)[:, 0] if qtype == QT.Q4_1 else d * np.float16(-8)
        )
    per_word = 32 // bits
    q = q.reshape(-1, per_word) << (np.arange(per_word, dtype=np.uint32) * bits)
    words = np.bitwise_or.reduce(q, axis=1).astype(np.uint32)
    cols = shape[-1]
    out_shape = (*shape[:-1], cols * bits // 32)
    groups = (*shape[:-1], cols // 32)
    return (mx.array(words.reshape(out_shape)), mx.array(d.reshape(groups)),
            mx.array(bias.astype(np.float16).reshape(groups)))  # fmt: skip


def _check_rows(name: str, qtype: QT, raw: np.ndarray, triple, shape) -> None:
    """Rows of a repacked tensor, dequantized by MLX, against the gguf package's reference."""
    rows = int(np.prod(shape[:-1]))
    pick = np.unique(np.linspace(0, rows - 1, min(CHECKED_ROWS, rows)).astype(np.int64))
    flat = [a.reshape(rows, -1) for a in triple]
    ours = mx.dequantize(*(a[mx.array(pick)] for a in flat), group_size=32,
                         bits=AFFINE[qtype][0]).astype(mx.float32)  # fmt: skip
    ref = dequantize(raw.reshape(rows, -1)[pick], qtype)
    err = float(np.max(np.abs(np.array(ours) - ref)))
    tol = 2e-3 * max(float(np.max(np.abs(ref))), 1e-6)  # float16 rounding: scale * q, + bias
    if not err <= tol:
        raise DFlashError(f"GGUF tensor {name} ({qtype.name}) does not repack exactly into MLX's "
                          f"quantization (max error {err:.3g}); refusing to write wrong weights.")  # fmt: skip


def convert(gguf: str | Path, out: str | Path, force: bool = False, source: str = "") -> Path:
    """Convert a llama or qwen2 GGUF file into the folder `out` (written atomically)."""
    gguf = Path(gguf)
    tensors, meta = read_gguf(gguf)
    if "tokenizer.ggml.tokens" not in meta:
        raise DFlashError(f"{gguf} has no tokenizer metadata.")
    config = model_config(meta, tensors)
    weights = mlx_weights(tensors, config)
    if quant := quantization(weights, config):
        config["quantization"] = quant
        config["quantization_config"] = quant
    try:
        tokenizer = build_tokenizer(meta)
    except KeyError as e:
        raise DFlashError(f"{gguf} lacks the tokenizer metadata {e}.") from e
    tok_config, generation = tokenizer_files(meta)
    with atomic_folder(out, force=force) as tmp:
        write_json(tmp / "config.json", config)
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        tokenizer.save(str(tmp / "tokenizer.json"))
        write_json(tmp / "tokenizer_config.json", tok_config)
        if generation:
            write_json(tmp / "generation_config.json", generation)
        (tmp / "PROVENANCE.md").write_text(provenance(gguf, meta, source), encoding="utf-8")
    return Path(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", help="llama or qwen2 .gguf file")
    parser.add_argument("out", help="output folder")
    parser.add_argument("--force", action="store_true", help="replace an existing folder")
    a = parser.parse_args(argv)
    print(convert(a.gguf, a.out, force=a.force))


if __name__ == "__main__":
    main()
