"""Diffusion-LM metadata of the model families: which loss, sampler, mask token and block size.

The Megatron mapping of a diffusion family (config translation, weight names) is an ordinary
`ModelFamily` (models/llada.py, dream.py, sdar.py, llada2.py); what makes it a diffusion LM is data kept
here, keyed like `MODEL_FAMILIES` by config.json `architectures[0]`:

    spec = diffusion_spec(hf_config)          # None for autoregressive families
    spec.kind                                 # "masked" (MDLM) | "block" (BDLM)
    mask_token_id(hf_config), block_size(hf_config)

docs/algorithms.md C.1 (models), C.0.5 (Dream reads logits shifted by one), C.2 (block size).
All diffusion families run their attention bidirectionally (`AttnMaskType.no_mask`): full
bidirectional for MDLMs, the explicit C.2 / block-causal mask for BDLMs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class DiffusionSpec:
    """How a diffusion family is trained and sampled."""

    kind: str
    """masked: bidirectional masked diffusion (LLaDA, Dream); block: block diffusion (SDAR,
    LLaDA2), trained on the [noisy | clean] layout of C.2."""
    shift_logits: bool
    """The prediction for position i is read from the output at i - 1 (Dream, C.0.5)."""
    sampler: str
    """Default sampler of rollout.diffusion: llada | dream | sdar | llada2."""
    default_mask_token_id: int
    """Mask token of the released checkpoints, used when config.json has no `mask_token_id`."""
    default_block_size: int = 0
    """Block size S when config.json has no `block_size` (block kind only)."""


DIFFUSION_SPECS: dict[str, DiffusionSpec] = {
    "LLaDAModelLM": DiffusionSpec(kind="masked", shift_logits=False, sampler="llada",
                                  default_mask_token_id=126336),
    "DreamModel": DiffusionSpec(kind="masked", shift_logits=True, sampler="dream",
                                default_mask_token_id=151666),
    "SDARForCausalLM": DiffusionSpec(kind="block", shift_logits=False, sampler="sdar",
                                     default_mask_token_id=151669, default_block_size=4),
    "SDARMoeForCausalLM": DiffusionSpec(kind="block", shift_logits=False, sampler="sdar",
                                        default_mask_token_id=151669, default_block_size=4),
    "LLaDA2MoeModelLM": DiffusionSpec(kind="block", shift_logits=False, sampler="llada2",
                                      default_mask_token_id=156895, default_block_size=32),
}
"""HF `architectures[0]` -> diffusion metadata (absent: an autoregressive family)."""


def diffusion_spec(hf: dict) -> DiffusionSpec | None:
    """The diffusion metadata of an HF config, or None for an autoregressive model."""
    archs = hf.get("architectures") or []
    return DIFFUSION_SPECS.get(archs[0]) if archs else None


def model_kind(hf: dict) -> str:
    """"diffusion" for a diffusion family, else "autoregressive" (decides the objective)."""
    return "autoregressive" if diffusion_spec(hf) is None else "diffusion"


def _spec(hf: dict) -> DiffusionSpec:
    spec = diffusion_spec(hf)
    if spec is None:
        raise ValueError(
            f"config.json field `architectures`: {hf.get('architectures')!r} is not a diffusion "
            f"LM; known: {sorted(DIFFUSION_SPECS)}"
        )
    return spec


def mask_token_id(hf: dict) -> int:
    """config.json `mask_token_id`, else the family's released value; must be < vocab_size."""
    mid = int(hf.get("mask_token_id", _spec(hf).default_mask_token_id))
    if not 0 <= mid < int(hf.get("vocab_size", mid + 1)):
        raise ValueError(
            f"config.json field `mask_token_id`: {mid} is outside the vocabulary "
            f"({hf.get('vocab_size')}); reserve an id for [MASK] (e.g. vocab_size = tokenizer + 1)"
        )
    return mid


def block_size(hf: dict) -> int:
    """config.json `block_size` (or `block_length`), else the family default (block kind)."""
    spec = _spec(hf)
    s = int(hf.get("block_size") or hf.get("block_length") or spec.default_block_size)
    if spec.kind == "block" and s < 1:
        raise ValueError(f"config.json field `block_size`: must be >= 1, got {s}")
    return s
