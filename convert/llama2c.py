"""llama2.c legacy checkpoint + tokenizer -> Hugging Face llama folder that `mlx_lm.load` reads.

Formats (karpathy/llama2.c, `export.py` legacy_export and `tokenizer.py` export):

- model `.bin`: 7 little-endian int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size,
  seq_len; a negative vocab_size means an unshared classifier), then float32 token_embedding,
  rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final, freq_cis_real, freq_cis_imag, [wcls].
  Projections are (out, in); q/k rows use Meta's interleaved-pair RoPE layout.
- tokenizer `.bin`: int32 max_token_length, then per token float32 score, int32 length, bytes.
  Pieces are sentencepiece pieces with '▁' written as ' ', BOS/EOS as '\\n<s>\\n' / '\\n</s>\\n'.

Usage: python -m convert.llama2c stories260K.bin tok512.bin models/stories260K
"""

from __future__ import annotations

import argparse
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
from tokenizers.models import BPE

from convert import DFlashError, atomic_folder, file_sha256, interleaved_to_half, write_json

HEADER = struct.Struct("<7i")
VERSIONED_MAGIC = 0x616B3432  # "ak42": llama2.c's newer (version 1/2) export format

# sentencepiece piece types; GGUF's tokenizer.ggml.token_type uses the same numbers.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")
SPACE = "▁"


@dataclass(frozen=True)
class Llama2cArgs:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool

    @property
    def head_size(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_size

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Tensor names and shapes in file order (run.c `memory_map_weights`)."""
        L, d, h, kv = self.n_layers, self.dim, self.hidden_dim, self.kv_dim
        half_rope = (self.seq_len, self.head_size // 2)
        shapes = [
            ("token_embedding", (self.vocab_size, d)),
            ("rms_att", (L, d)),
            ("wq", (L, d, d)),
            ("wk", (L, kv, d)),
            ("wv", (L, kv, d)),
            ("wo", (L, d, d)),
            ("rms_ffn", (L, d)),
            ("w1", (L, h, d)),
            ("w2", (L, d, h)),
            ("w3", (L, h, d)),
            ("rms_final", (d,)),
            ("freq_cis_real", half_rope),
            ("freq_cis_imag", half_rope),
        ]
        if not self.shared_classifier:
            shapes.append(("wcls", (self.vocab_size, d)))
        return shapes


def _require_file(path: str | Path, what: str) -> Path:
    path = Path(path)
    if not path.is_file():
        raise DFlashError(f"The llama2.c {what} file {path} does not exist.")
    return path


def read_checkpoint(path: str | Path) -> tuple[Llama2cArgs, dict[str, np.ndarray]]:
    """Read a legacy llama2.c checkpoint; weights keep llama2.c's own (interleaved RoPE) layout."""
    path = _require_file(path, "checkpoint")
    data = path.read_bytes()
    if len(data) < HEADER.size:
        raise DFlashError(f"{path} is too short to be a llama2.c checkpoint.")
    if struct.unpack_from("<I", data)[0] == VERSIONED_MAGIC:
        raise DFlashError(f"{path} is a versioned llama2.c export; only the legacy format is read.")
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = HEADER.unpack_from(data)
    args = Llama2cArgs(dim, hidden, layers, heads, kv_heads, abs(vocab), seq_len, vocab > 0)
    if min(dim, hidden, layers, heads, kv_heads, abs(vocab), seq_len) <= 0 or dim % heads:
        raise DFlashError(f"{path} has an invalid llama2.c header {HEADER.unpack_from(data)}.")
    flat = np.frombuffer(data, dtype="<f4", offset=HEADER.size)
    expected = sum(int(np.prod(shape)) for _, shape in args.shapes())
    if flat.size != expected:
        raise DFlashError(
            f"{path} holds {flat.size} floats after its header but its header implies {expected}."
        )
    weights, offset = {}, 0
    for name, shape in args.shapes():
        size = int(np.prod(shape))
        weights[name] = flat[offset : offset + size].reshape(shape).astype(np.float32)
        offset += size
    if args.shared_classifier:
        weights["wcls"] = weights["token_embedding"]
    return args, weights


def read_tokenizer(path: str | Path, vocab_size: int) -> tuple[list[bytes], list[float]]:
    """Read a llama2.c tokenizer `.bin`: raw piece bytes and scores, `vocab_size` of them."""
    path = _require_file(path, "tokenizer")
    data = path.read_bytes()
    pieces, scores, offset = [], [], 4
    try:
        for _ in range(vocab_size):
            score, length = struct.unpack_from("<fi", data, offset)
            offset += 8
            pieces.append(data[offset : offset + length])
            scores.append(score)
            offset += length
    except struct.error as e:
        raise DFlashError(f"{path} holds fewer than {vocab_size} tokens.") from e
    if offset != len(data) or any(len(p) == 0 for p in pieces):
        raise DFlashError(f"{path} is not a llama2.c tokenizer for a {vocab_size}-token model.")
    return pieces, scores


def sentencepiece_pieces(raw: list[bytes]) -> tuple[list[str], list[int]]:
    """Undo llama2.c's export renames: back to sentencepiece pieces ('▁', <s>, </s>) and types."""
    special = {b"\n<s>\n": "<s>", b"\n</s>\n": "</s>", b"<unk>": "<unk>"}
    pieces, types = [], []
    for i, piece in enumerate(raw):
        if piece in special:
            pieces.append(special[piece])
            types.append(UNKNOWN if piece == b"<unk>" else CONTROL)
            continue
        try:
            text = piece.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DFlashError(f"Tokenizer piece {i} is not valid UTF-8.") from e
        pieces.append(text.replace(" ", SPACE))
        types.append(BYTE if BYTE_PIECE.fullmatch(text) else NORMAL)
    return pieces, types


def spm_merges(pieces: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges that reproduce sentencepiece's best-score-first merging.

    sentencepiece (and run.c's `encode`) repeatedly merges the adjacent pair whose merged piece has
    the highest score. A BPE merge list ranked by the merged piece's score (then its id) does the
    same; only normal pieces merge, like transformers' SpmConverter.
    """
    normal = {
        p: (s, i)
        for i, (p, s, t) in enumerate(zip(pieces, scores, types, strict=True))
        if t == NORMAL
    }
    ranked = []
    for piece, (score, index) in normal.items():
        for split in range(1, len(piece)):
            left, right = piece[:split], piece[split:]
            if left in normal and right in normal:
                ranked.append((-score, index, split, left, right))
    return [(left, right) for *_, left, right in sorted(ranked)]


def build_spm_tokenizer(
    pieces: list[str],
    scores: list[float],
    types: list[int],
    bos: str | None,
    add_bos: bool = True,
    add_dummy_prefix: bool = True,
) -> Tokenizer:
    """A `tokenizers` BPE that encodes and decodes like a sentencepiece BPE model with byte fallback.

    Mirrors the legacy Llama tokenizer.json: the normalizer adds the dummy-prefix space and writes
    spaces as '▁'; characters missing from the vocabulary fall back to <0xNN> byte pieces; the
    decoder undoes both.
    """
    if not len(pieces) == len(scores) == len(types):
        raise DFlashError("The tokenizer's pieces, scores and types differ in length.")
    vocab = {piece: i for i, piece in enumerate(pieces)}
    if len(vocab) != len(pieces):
        raise DFlashError("The tokenizer vocabulary has duplicate pieces.")
    unk = next((p for p, t in zip(pieces, types, strict=True) if t == UNKNOWN), None)
    byte_fallback = all(f"<0x{b:02X}>" in vocab for b in range(256))
    model = BPE(
        vocab=vocab,
        merges=spm_merges(pieces, scores, types),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=byte_fallback,
        dropout=None,
    )
    tokenizer = Tokenizer(model)
    steps = [normalizers.Prepend(SPACE)] if add_dummy_prefix else []
    tokenizer.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", SPACE)])
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_dummy_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    special = [p for p, t in zip(pieces, types, strict=True) if t in (UNKNOWN, CONTROL)]
    tokenizer.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in special])
    user = [p for p, t in zip(pieces, types, strict=True) if t == USER_DEFINED]
    tokenizer.add_tokens([AddedToken(p, special=False, normalized=False) for p in user])
    if add_bos and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, vocab[bos])],
        )
    return tokenizer


def hf_config(args: Llama2cArgs, bos_id: int, eos_id: int) -> dict:
    """config.json for transformers' LlamaForCausalLM / mlx-lm's llama (run.c's constants)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_size,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.seq_len,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": args.shared_classifier,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }


def hf_weights(args: Llama2cArgs, w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rename to HF llama keys; permute q/k rows from interleaved to rotate_half RoPE."""
    out = {"model.embed_tokens.weight": w["token_embedding"], "model.norm.weight": w["rms_final"]}
    if not args.shared_classifier:
        out["lm_head.weight"] = w["wcls"]
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = w["rms_att"][i]
        out[p + "post_attention_layernorm.weight"] = w["rms_ffn"][i]
        out[p + "self_attn.q_proj.weight"] = interleaved_to_half(w["wq"][i], args.n_heads)
        out[p + "self_attn.k_proj.weight"] = interleaved_to_half(w["wk"][i], args.n_kv_heads)
        out[p + "self_attn.v_proj.weight"] = w["wv"][i]
        out[p + "self_attn.o_proj.weight"] = w["wo"][i]
        out[p + "mlp.gate_proj.weight"] = w["w1"][i]
        out[p + "mlp.down_proj.weight"] = w["w2"][i]
        out[p + "mlp.up_proj.weight"] = w["w3"][i]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def tokenizer_config(bos: str, eos: str, unk: str | None, max_length: int) -> dict:
    """tokenizer_config.json: plain fast tokenizer, so transformers uses tokenizer.json as is."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": max_length,
    }


def provenance(checkpoint: Path, tokenizer: Path) -> str:
    """PROVENANCE.md: where the weights came from and how they were changed."""
    return (
        "# Provenance\n\n"
        "Converted by `convert/llama2c.py` (mlx-dflash) from a llama2.c legacy checkpoint.\n\n"
        "| file | sha256 |\n|---|---|\n"
        f"| `{checkpoint.name}` | `{file_sha256(checkpoint)}` |\n"
        f"| `{tokenizer.name}` | `{file_sha256(tokenizer)}` |\n\n"
        "Source: karpathy/llama2.c (model from karpathy/tinyllamas), MIT licence.\n\n"
        "Changes: tensors renamed to Hugging Face llama keys; q/k projection rows permuted from\n"
        "interleaved-pair RoPE to rotate_half (HF convert_llama_weights_to_hf `permute`); the\n"
        "unused freq_cis tables dropped; the tokenizer rebuilt as a byte-fallback BPE\n"
        "tokenizer.json with merges ranked by piece score.\n"
    )


def convert(
    checkpoint: str | Path, tokenizer: str | Path, out: str | Path, force: bool = False
) -> Path:
    """Convert a llama2.c model + tokenizer into the HF folder `out` (written atomically)."""
    checkpoint, tokenizer = Path(checkpoint), Path(tokenizer)
    args, weights = read_checkpoint(checkpoint)
    raw, scores = read_tokenizer(tokenizer, args.vocab_size)
    pieces, types = sentencepiece_pieces(raw)
    if "<s>" not in pieces or "</s>" not in pieces:
        raise DFlashError(f"{tokenizer} has no llama2.c BOS/EOS pieces.")
    unk = "<unk>" if "<unk>" in pieces else None
    tok = build_spm_tokenizer(pieces, scores, types, bos="<s>")
    with atomic_folder(out, force=force) as tmp:
        config = hf_config(args, pieces.index("<s>"), pieces.index("</s>"))
        write_json(tmp / "config.json", config)
        tensors = {k: mx.array(v) for k, v in hf_weights(args, weights).items()}
        mx.save_safetensors(str(tmp / "model.safetensors"), tensors, metadata={"format": "pt"})
        tok.save(str(tmp / "tokenizer.json"))
        write_json(
            tmp / "tokenizer_config.json", tokenizer_config("<s>", "</s>", unk, args.seq_len)
        )
        specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": unk}
        write_json(tmp / "special_tokens_map.json", {k: v for k, v in specials.items() if v})
        (tmp / "PROVENANCE.md").write_text(provenance(checkpoint, tokenizer), encoding="utf-8")
    return Path(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="llama2.c legacy model .bin")
    parser.add_argument("tokenizer", help="llama2.c tokenizer .bin (e.g. tok512.bin)")
    parser.add_argument("out", help="output folder")
    parser.add_argument("--force", action="store_true", help="replace an existing folder")
    a = parser.parse_args(argv)
    print(convert(a.checkpoint, a.tokenizer, a.out, force=a.force))


if __name__ == "__main__":
    main()
