"""`dflash-mlx generate` (placeholder)."""

import typer


def generate_command(prompt: str = typer.Option(..., "--prompt")) -> None:
    """Generate text with DFlash speculative decoding."""
