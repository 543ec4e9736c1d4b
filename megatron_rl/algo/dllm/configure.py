"""`algorithm.*` config -> the diffusion-LM RL objective, and what is refused before a model exists.

    objective = build_objective(cfg.algorithm)        # a DiffusionObjective (d1.py, ..., vrpo.py)
    check_setup(cfg, hf_config)                       # the model family against the algorithm

The shared fields (clip ratios, kl_coef, kl_estimator) come from `algorithm.*`, the rest from
`algorithm.dllm`, where a field left at None keeps the objective's own default (docs/algorithms.md
C.6). `config.DLLM_FIELDS` lists the fields each algorithm reads; AlgorithmConfig refuses the others,
and the generic refusals (kl_coef for spg / bgpo / vrpo, loss_agg_mode, entropy_coef) live there
too, so `megatron-rl config` already shows them. Here: what needs the model's config.json.
"""

from __future__ import annotations

from megatron_rl.algo.dllm.bgpo import BGPO, BGPOConfig
from megatron_rl.algo.dllm.coupled_grpo import CoupledGRPO, CoupledGRPOConfig
from megatron_rl.algo.dllm.d1 import D1, D1Config
from megatron_rl.algo.dllm.objective import DiffusionObjective
from megatron_rl.algo.dllm.spg import SPG, SPGConfig
from megatron_rl.algo.dllm.vrpo import VRPO, VRPOConfig

_CLIP = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c")
_KL = ("kl_coef", "kl_estimator")

# name -> (objective class, its config class, algorithm.* fields it reads,
#          {algorithm.dllm field: the config-class field it sets})
_OBJECTIVES = {
    "d1": (D1, D1Config, _CLIP + _KL, {"p_mask_prompt": "p_mask_prompt"}),
    "coupled_grpo": (CoupledGRPO, CoupledGRPOConfig, _CLIP + _KL,
                     {"t_min": "t_min", "t_max": "t_max"}),
    "spg": (SPG, SPGConfig, (), {
        "mc_num": "num_t", "block_length": "block_length", "t_min": "t_min", "t_max": "t_max",
        "use_mask_prompt": "use_mask_prompt", "p_mask_prompt": "p_mask_prompt",
        "logp_estimation": "logp_estimation", "eubo_beta": "eubo_beta",
        "mix_weight": "mix_weight"}),
    "bgpo": (BGPO, BGPOConfig, _CLIP, {"mc_num": "mc_num", "stratified": "stratified",
                                       "norm_len": "norm_len"}),
    "vrpo": (VRPO, VRPOConfig, (), {"mc_num": "mc_num", "stratified": "stratified",
                                    "norm_len": "norm_len", "beta": "beta"}),
}


def build_objective(alg) -> DiffusionObjective:
    """The `DiffusionObjective` of `AlgorithmConfig` alg (alg.name one of config.DIFFUSION_ALGORITHMS).
    A bad value raises ValueError naming its `algorithm.dllm.` field."""
    if alg.name not in _OBJECTIVES:
        raise ValueError(f"config field `algorithm.name`: {alg.name!r} is not a diffusion-LM "
                         f"algorithm ({', '.join(_OBJECTIVES)})")
    cls, config_cls, shared, dllm_fields = _OBJECTIVES[alg.name]
    kwargs = {name: getattr(alg, name) for name in shared}
    for src, dst in dllm_fields.items():
        value = getattr(alg.dllm, src)
        if src == "norm_len":
            value = value or None  # 0: each response's own length
        if value is not None:
            kwargs[dst] = value
    try:
        return cls(config_cls(**kwargs))
    except ValueError as e:  # the objective's own check names `<name>.<field>`
        raise ValueError(f"config section `algorithm.dllm` ({alg.name}): {e}") from e


def check_setup(cfg, hf_config: dict) -> DiffusionObjective:
    """Refuse, before the model is built, a combination the model family cannot run; returns the
    objective. Prompt masks (d1, spg) exist for masked diffusion only (the [noisy | clean] layout
    of a block-diffusion model has a clean prompt, C.2); masked-diffusion models have no block
    mask to build densely."""
    from megatron_rl.models.dllm import diffusion_spec

    objective = build_objective(cfg.algorithm)
    spec = diffusion_spec(hf_config)
    arch = hf_config.get("architectures")
    if spec.kind == "block":
        c = objective.config
        if cfg.algorithm.name == "d1" and c.p_mask_prompt > 0:
            raise ValueError(f"config field `algorithm.dllm.p_mask_prompt`: d1's prompt masking "
                             f"({c.p_mask_prompt}) is for masked diffusion; {arch} is a "
                             "block-diffusion LM: set algorithm.dllm.p_mask_prompt=0")
        if cfg.algorithm.name == "spg" and c.use_mask_prompt and c.p_mask_prompt > 0:
            raise ValueError(f"config field `algorithm.dllm.use_mask_prompt`: spg's prompt masking "
                             f"is for masked diffusion; {arch} is a block-diffusion LM: set "
                             "algorithm.dllm.use_mask_prompt=false")
    elif cfg.algorithm.dllm.mask_impl != "kernel":
        raise ValueError(f"config field `algorithm.dllm.mask_impl`: {arch} is a masked-diffusion "
                         "LM (bidirectional, no block mask); leave it at kernel")
    return objective
