"""Reward functions for the end-to-end tests: a tiny random model almost never solves the
arithmetic task, so its exact-match reward is 0 everywhere and an update has no learning signal
(the loop skips it). These give a dense, varied reward, so the tests exercise real updates."""


def digit_fraction(response: str, ground_truth, *, prompt: str = "", sample=None) -> float:
    """Fraction of the response's characters that are digits."""
    return sum(c.isdigit() for c in response) / max(1, len(response))
