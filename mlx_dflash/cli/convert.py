"""`dflash-mlx convert`: Hugging Face checkpoints (targets and DFlash drafters) to MLX folders
(the work is mlx_dflash.checkpoints.convert)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer

from ..checkpoints.convert import convert


class Kind(str, Enum):
    auto = "auto"
    target = "target"
    drafter = "drafter"


class DType(str, Enum):
    float16 = "float16"
    bfloat16 = "bfloat16"
    float32 = "float32"


def convert_command(
    source: str = typer.Argument(..., help="Local folder or Hugging Face hub id."),
    out: Path = typer.Option(..., "--out", "-o", help="Output folder (must not exist)."),
    kind: Kind = typer.Option(Kind.auto, "--kind", help="What SOURCE is; auto reads config.json."),
    dtype: DType | None = typer.Option(
        None, "--dtype", help="Float type of the weights (default: the checkpoint's)."
    ),
    quantize: bool = typer.Option(False, "--quantize", "-q", help="Quantize the linear layers."),
    q_bits: int = typer.Option(4, "--q-bits", help="Bits per quantized weight."),
    q_group_size: int = typer.Option(64, "--q-group-size", help="Quantization group size."),
    target: Path | None = typer.Option(
        None, "--target", help="The drafter's target folder: derive tap ids and check the pair."
    ),
    force: bool = typer.Option(False, "--force", help="Replace an existing output folder."),
    dequantize: bool = typer.Option(
        False, "--dequantize", help="Dequantize a quantized target (float32 on the CPU)."
    ),
) -> None:
    """Convert a Hugging Face checkpoint (target or DFlash drafter) to an MLX folder."""
    done = convert(
        source,
        out,
        kind=kind.value,
        dtype=None if dtype is None else dtype.value,
        quantize=quantize,
        q_bits=q_bits,
        q_group_size=q_group_size,
        target=target,
        force=force,
        dequantize=dequantize,
    )
    typer.echo(f"Wrote {done}")
