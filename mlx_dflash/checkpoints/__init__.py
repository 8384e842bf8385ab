"""Checkpoints: reading and validating configs and tensors (read.py), converting Hugging Face
checkpoints to MLX folders (convert.py), hub ids (resolve.py), published pairs (registry.py)."""
