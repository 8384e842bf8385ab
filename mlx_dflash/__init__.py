"""dflash-mlx: lossless DFlash / DDTree speculative decoding on MLX."""

from ._blas import load_openblas

# Must happen before anything imports mlx (see _blas.py).
load_openblas()

__version__ = "0.1.0"
