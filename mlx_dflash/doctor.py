"""`dflash-mlx doctor` (placeholder)."""


def doctor_command() -> None:
    """Print platform, MLX versions, device, BLAS speed and active kernels."""
