"""Custom Metal kernels with their MLX-ops references: tree attention, Gated DeltaNet tree
verify and tape replay; backend dispatch (dispatch.py) and the on-device self-check
(self_check.py). The sources live in metal/ (docs/kernels.md)."""
