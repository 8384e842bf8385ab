"""Models: the target's layer loop over mlx-lm's modules (target.py) with one module per
attention family (attention.py: standard and gated; gated_deltanet.py: linear attention), the
DFlash drafter and its config, the caches, and loading a pair (pair.py)."""
