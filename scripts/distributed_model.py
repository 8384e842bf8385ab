"""A model on paper: Kimi-K2.5 over 2-4 Macs, plain distributed decoding against DFlash.

    python scripts/distributed_model.py            # the table in docs/distributed.md

Pure arithmetic, no MLX: every number comes from the constants below, each stated with its
source or as an assumption to replace with a measurement. Decoding a trillion-parameter MoE
is memory-bound: a step reads the active weights once. A verify of T tokens reads the union of
the experts its tokens route to, which for 384 experts and top-8 grows fast with T; that,
not compute, is what limits speculative decoding on this model.
"""

from __future__ import annotations

# ---- Kimi-K2.5 (config.json: text_config) --------------------------------------------------
LAYERS, DENSE_LAYERS, HIDDEN, VOCAB = 61, 1, 7168, 163840
HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V_DIM = 64, 1536, 512, 128, 64, 128
EXPERTS, TOP_K, MOE_INTER, DENSE_INTER, SHARED = 384, 8, 2048, 18432, 1
BF16, INT4 = 2.0, 0.5 + 2.0 / 32  # bytes/param: int4 routed experts carry a bf16 scale per 32

# ---- Machines (assumptions: replace with measurements) ----------------------------------------
MEM_BW = 600e9  # bytes/s a Mac Studio M3 Ultra sustains in decode (819 GB/s peak)
FLOPS = 25e12  # bf16 matmul FLOP/s the same GPU sustains
TRANSPORTS = {  # per-hop latency of one all-reduce step, and link bandwidth (bytes/s)
    "ring over Thunderbolt 5 (TCP)": (40e-6, 8e9),
    "JACCL (RDMA over Thunderbolt 5)": (8e-6, 10e9),
}
DRAFTER_PARAMS = 3.5e9  # z-lab/Kimi-K2.5-DFlash: six 7168-wide layers, ~6.5 GiB in bf16
BLOCK = 8  # z-lab/Kimi-K2.5-DFlash drafts blocks of 8


def attention_params() -> tuple[float, float]:
    """(sharded, replicated) attention parameters per layer, as mlx-lm shards MLA: q_b, the
    latent up-projections and o_proj are split; q_a and kv_a stay whole on every rank."""
    sharded = (
        Q_LORA * HEADS * (NOPE + ROPE) + KV_LORA * HEADS * (NOPE + V_DIM) + HEADS * V_DIM * HIDDEN
    )
    replicated = HIDDEN * Q_LORA + HIDDEN * (KV_LORA + ROPE)
    return sharded, replicated


def experts_touched(tokens: int, overlap: float) -> float:
    """Expected distinct routed experts per layer for `tokens` tokens; `overlap` in [0, 1] is
    how much a block's tokens share routes (0: independent draws)."""
    t_eff = 1 + (tokens - 1) * (1 - overlap)
    return EXPERTS * (1 - (1 - TOP_K / EXPERTS) ** t_eff)


def forward_time(tokens: int, n: int, transport, overlap: float) -> float:
    """Seconds for one target forward of `tokens` tokens on n Macs (tensor parallel)."""
    att_s, att_r = attention_params()
    expert = 3 * HIDDEN * MOE_INTER
    moe_layers = LAYERS - DENSE_LAYERS
    per_rank = (
        LAYERS * (att_s * BF16 / n + att_r * BF16)
        + DENSE_LAYERS * 3 * HIDDEN * DENSE_INTER * BF16 / n
        + moe_layers * (SHARED * expert * BF16 / n + EXPERTS * HIDDEN * BF16)
        + moe_layers * experts_touched(tokens, overlap) * expert * INT4 / n
        + VOCAB * HIDDEN * BF16  # the LM head: mlx-lm leaves it whole on every rank
    )
    active = LAYERS * (att_s + att_r) + moe_layers * (TOP_K + SHARED) * expert + VOCAB * HIDDEN
    compute = 2 * active * tokens / n / FLOPS
    latency, link = transport
    msg = tokens * HIDDEN * BF16
    allreduce = 2 * (n - 1) * (latency + msg / n / link)
    return max(per_rank / MEM_BW, compute) + 2 * LAYERS * allreduce


def draft_time() -> float:
    """The drafter, replicated on every Mac: its weights plus the target's LM head once."""
    return (DRAFTER_PARAMS * BF16 + VOCAB * HIDDEN * BF16) / MEM_BW


def main() -> None:
    print(
        f"| Macs | transport | plain tok/s | {BLOCK}-token verify / step | DFlash tok/s at tau 3 / 4 / 6 |"
    )
    print("|---|---|---|---|---|")
    for n in (2, 3, 4):
        for name, transport in TRANSPORTS.items():
            step = forward_time(1, n, transport, 0.0)
            cells = []
            for overlap in (0.0, 0.5):
                verify = forward_time(BLOCK, n, transport, overlap)
                round_s = verify + draft_time() + 2 * (n - 1) * transport[0]
                rates = " / ".join(f"{tau / round_s:.0f}" for tau in (3, 4, 6))
                cells.append((verify / step, rates))
            print(
                f"| {n} | {name} | {1 / step:.0f} | {cells[0][0]:.1f} (overlap 0) / "
                f"{cells[1][0]:.1f} (0.5) | {cells[0][1]} (overlap 0); {cells[1][1]} (0.5) |"
            )


if __name__ == "__main__":
    main()
