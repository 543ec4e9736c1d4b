"""Diffusion-LM (DARE, docs/algorithms.md part C) likelihoods and losses.

- `elbo`: the ELBO of a masked diffusion LM (C.0.2 continuous time, C.0.3 discrete counts),
  stratified / antithetic / complementary mask draws, and the stored per-sample `Corruption`
  reused by the old, reference and current policies (C.0.4).
- `sft_loss`: packed training batches for masked diffusion (bidirectional, weight 1/t) and
  block diffusion (the [noisy | clean] layout of C.2) and their weighted cross entropy.
- `corruption`: RL corruptions stored per sample (views, seeds per sample / MC index /
  iteration), packed one view per forward (C.4, C.7).
- `objective`: the `DiffusionObjective` interface of the RL algorithms and shared loss helpers.
- one file per RL algorithm (C.5): `d1`, `coupled_grpo`, `spg`, `bgpo`, `vrpo`.
"""
