"""`dflash-mlx convert` (placeholder until the converter lands)."""

import typer

from .errors import DFlashError


def convert_command(source: str = typer.Argument(..., help="Hub id or local folder")) -> None:
    """Convert a Hugging Face checkpoint (target or DFlash drafter) to an MLX folder."""
    raise DFlashError("convert is not implemented yet.")
