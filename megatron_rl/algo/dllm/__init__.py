"""Diffusion-LM (DARE, docs/algorithms.md part C) likelihoods and losses.

- `elbo`: the ELBO of a masked diffusion LM (C.0.2 continuous time, C.0.3 discrete counts),
  stratified / antithetic / complementary mask draws, and the stored per-sample `Corruption`
  reused by the old, reference and current policies (C.0.4).
- `sft_loss`: packed training batches for masked diffusion (bidirectional, weight 1/t) and
  block diffusion (the [noisy | clean] layout of C.2) and their weighted cross entropy.
"""
