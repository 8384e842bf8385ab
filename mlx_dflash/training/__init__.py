"""Drafter training: data (answers by the target), batches, the training forward and loss,
checkpoints, and the trainer."""
