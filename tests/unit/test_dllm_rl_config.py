"""Diffusion-LM RL wiring: the registry, `algorithm.dllm`, the refusals, and the learner seam.

- the five diffusion algorithms are registered (kind "diffusion") and named by the Literal;
- every `algorithm.dllm` field an algorithm reads reaches its objective's config (and the
  shared clip / KL fields where the objective has them); fields it does not read are refused;
- refusals: kl_coef for spg / bgpo / vrpo, loss_agg_mode, entropy_coef, clip for spg / vrpo,
  prompt masks on a block-diffusion model, a dense mask on a masked-diffusion model, the kinds
  crossed (train._check_setup, before a model exists);
- `DiffusionLearner` (in process, tiny LLaDA): score stores per-sample corruptions seeded by
  (trainer.seed, sample index, step), mini-batches carry them, the first update is evaluated
  at pi_old (ratio exactly 1) and mini_batches x epochs optimizer steps are taken.
"""

from __future__ import annotations

import typing

import pytest
import torch

from megatron_rl.algo import ALGORITHMS, get_algorithm
from megatron_rl.algo.dllm.configure import build_objective, check_setup
from megatron_rl.config import (
    DIFFUSION_ALGORITHMS,
    DLLM_FIELDS,
    AlgorithmConfig,
    AlgorithmName,
    DiffusionRLConfig,
    RLConfig,
)

LLADA = {"architectures": ["LLaDAModelLM"], "mask_token_id": 99, "vocab_size": 100}
SDAR = {"architectures": ["SDARForCausalLM"], "mask_token_id": 99, "vocab_size": 100,
        "block_size": 4}


def test_registry_literal_and_field_table_agree():
    assert set(ALGORITHMS) == set(typing.get_args(AlgorithmName))
    assert {n for n, a in ALGORITHMS.items() if a.kind == "diffusion"} == set(DIFFUSION_ALGORITHMS)
    assert set(DLLM_FIELDS) == set(DIFFUSION_ALGORITHMS)
    for name in DIFFUSION_ALGORITHMS:
        algo = get_algorithm(name)
        assert algo.loss is None and algo.objective is build_objective and algo.uses_std
        assert build_objective(AlgorithmConfig(name=name)).name == name


# algorithm.dllm field -> (a non-default value, the objective-config attribute per algorithm)
VALUES = {"mc_num": 3, "stratified": False, "norm_len": 7, "p_mask_prompt": 0.3, "t_min": 0.3,
          "t_max": 0.7, "block_length": 8, "use_mask_prompt": False, "logp_estimation": "eubo",
          "eubo_beta": 2.0, "mix_weight": 0.25, "beta": 0.5}
RENAMED = {("spg", "mc_num"): "num_t"}


@pytest.mark.parametrize("name", DIFFUSION_ALGORITHMS)
def test_every_dllm_field_reaches_the_objective(name):
    fields = [f for f in DLLM_FIELDS[name] if f != "mask_impl"]
    obj = build_objective(AlgorithmConfig(name=name,
                                          dllm=DiffusionRLConfig(**{f: VALUES[f] for f in fields})))
    for f in fields:
        assert getattr(obj.config, RENAMED.get((name, f), f)) == VALUES[f], (name, f)
    defaults = build_objective(AlgorithmConfig(name=name)).config
    assert all(getattr(defaults, RENAMED.get((name, f), f)) != VALUES[f] for f in fields)
    if name == "bgpo":  # norm_len 0 means each response's own length
        assert defaults.norm_len is None
    if name in ("d1", "coupled_grpo", "bgpo"):
        clipped = build_objective(AlgorithmConfig(name=name, clip_ratio_high=0.28)).config
        assert clipped.clip_ratio_high == 0.28
    if name in ("d1", "coupled_grpo"):
        assert build_objective(AlgorithmConfig(name=name, kl_coef=0.05)).needs_ref
    others = sorted(set(VALUES) - set(fields))
    for f in others:
        with pytest.raises(ValueError, match=f"algorithm.dllm.{f}"):
            AlgorithmConfig(name=name, dllm=DiffusionRLConfig(**{f: VALUES[f]}))


@pytest.mark.parametrize("kwargs,field", [
    (dict(name="bgpo", kl_coef=0.01), "algorithm.kl_coef"),
    (dict(name="spg", kl_coef=0.01), "algorithm.kl_coef"),
    (dict(name="vrpo", kl_coef=0.01), "algorithm.kl_coef"),
    (dict(name="d1", loss_agg_mode="seq-mean-token-sum"), "algorithm.loss_agg_mode"),
    (dict(name="coupled_grpo", entropy_coef=0.01), "algorithm.entropy_coef"),
    (dict(name="spg", clip_ratio_high=0.28), "algorithm.clip_ratio_high"),
    (dict(name="vrpo", clip_ratio_c=10.0), "algorithm.clip_ratio_c"),
    (dict(name="grpo", dllm=DiffusionRLConfig(mc_num=2)), "algorithm.dllm.mc_num"),
    (dict(name="d1", dllm=DiffusionRLConfig(mc_num=2)), "algorithm.dllm.mc_num"),
])
def test_unimplemented_combinations_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        AlgorithmConfig(**kwargs)


def test_bad_objective_values_name_the_section():
    with pytest.raises(ValueError, match=r"algorithm\.dllm\.mc_num"):
        DiffusionRLConfig(mc_num=0)
    with pytest.raises(ValueError, match=r"algorithm\.dllm.*d1\.p_mask_prompt"):
        build_objective(AlgorithmConfig(name="d1", dllm=DiffusionRLConfig(p_mask_prompt=1.5)))
    with pytest.raises(ValueError, match=r"vrpo\.beta"):
        build_objective(AlgorithmConfig(name="vrpo", dllm=DiffusionRLConfig(beta=0.0)))


def test_model_family_checks():
    def cfg(name, **dllm):
        return RLConfig(algorithm=AlgorithmConfig(name=name, dllm=DiffusionRLConfig(**dllm)))

    with pytest.raises(ValueError, match="algorithm.dllm.p_mask_prompt=0"):
        check_setup(cfg("d1"), SDAR)
    assert check_setup(cfg("d1", p_mask_prompt=0.0), SDAR).config.p_mask_prompt == 0.0
    with pytest.raises(ValueError, match="use_mask_prompt=false"):
        check_setup(cfg("spg"), SDAR)
    check_setup(cfg("spg", use_mask_prompt=False), SDAR)
    with pytest.raises(ValueError, match="algorithm.dllm.mask_impl"):
        check_setup(cfg("bgpo", mask_impl="dense"), LLADA)
    check_setup(cfg("bgpo", mask_impl="dense"), SDAR)
    check_setup(cfg("d1"), LLADA)


def test_train_refuses_crossed_kinds_before_a_model_exists():
    from megatron_rl.actor.loading import ModelSource
    from megatron_rl.train import _check_setup

    with pytest.raises(ValueError, match="bgpo trains diffusion models"):
        _check_setup(RLConfig(algorithm=AlgorithmConfig(name="bgpo")),
                     ModelSource({"architectures": ["Qwen3ForCausalLM"]}, None, None),
                     get_algorithm("bgpo"))
    with pytest.raises(ValueError, match="algorithms for diffusion models: bgpo, coupled_grpo"):
        _check_setup(RLConfig(), ModelSource(LLADA, None, None), get_algorithm("grpo"))


def test_recipe_layers_the_algorithm_defaults():
    from megatron_rl.algo import algorithm_defaults
    from megatron_rl.recipe import load_config

    cfg = load_config(RLConfig, None, ["algorithm.name=bgpo", "algorithm.dllm.mc_num=4"],
                      defaults=algorithm_defaults)
    assert cfg.optimizer.lr == 5e-7 and cfg.optimizer.weight_decay == 0.01  # C.6
    assert cfg.algorithm.norm_adv_by_std is True and cfg.algorithm.dllm.mc_num == 4
    with pytest.raises(Exception, match="logp_estimation"):
        load_config(RLConfig, None, ["algorithm.name=spg", "algorithm.dllm.logp_estimation=x"],
                    defaults=algorithm_defaults)


def _learner(ps, name, **trainer):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.actor.loading import ModelSource
    from megatron_rl.actor.policy import build_policy
    from megatron_rl.config import OptimizerConfig, TrainerConfig
    from megatron_rl.models.builder import build_model
    from megatron_rl.tokenizer import CharTokenizer

    hf = dict(LLADA, d_model=32, n_heads=2, n_kv_heads=2, n_layers=1, mlp_hidden_size=64,
              rope_theta=10000.0)
    torch.manual_seed(0)
    model = build_model(hf, ps, attention_backend="flex_sdpa", attn_mask_type=AttnMaskType.no_mask)
    cfg = RLConfig(algorithm=AlgorithmConfig(name=name, dllm=DiffusionRLConfig(mc_num=2)),
                   optimizer=OptimizerConfig(lr=1e-3), trainer=TrainerConfig(seed=5, **trainer))
    policy = build_policy(model, model.config, ps, cfg.optimizer, 8)
    return get_algorithm(name).build_learner(cfg, policy, ModelSource(hf, CharTokenizer(), None),
                                             ps)


def _batch():
    from megatron_rl.types import Sample, TrainBatch, group_index

    g = torch.Generator().manual_seed(0)
    samples = [Sample(prompt_ids=torch.randint(3, 99, (3 + i % 3,), generator=g).tolist(),
                      response_ids=torch.randint(3, 99, (2 + i % 4,), generator=g).tolist(),
                      reward=float(i % 3 == 0), group_id=f"g{i // 4}") for i in range(8)]
    rewards = torch.tensor([s.reward for s in samples])
    adv = get_algorithm("bgpo").advantages(AlgorithmConfig(name="bgpo"), rewards,
                                           group_index(samples))
    return TrainBatch.from_samples(samples, adv)


def test_diffusion_learner_stores_corruptions_and_updates_at_pi_old(single_rank):
    learner = _learner(single_rank, "bgpo")
    batch = _batch()
    with pytest.raises(ValueError, match="score"):
        learner.update(batch)
    learner.score(batch, 3)
    prompts = [p.tolist() for p in batch.prompt_ids]
    responses = [r.tolist() for r in batch.response_ids]
    want = learner.objective.corruptions(prompts, responses, seed=5, sample_indices=list(range(8)),
                                         iteration=3)
    assert all(torch.equal(a.masked, b.masked) for a, b in zip(batch.corruptions, want))
    assert [o.shape for o in batch.old_logprobs] == [c.masked.shape for c in want]
    half = batch.mini_batches(2)[1]
    assert half.corruptions == batch.corruptions[4:] and len(half.old_logprobs) == 4
    assert learner.ref is None  # bgpo reads no reference
    m = learner.update(batch)
    assert m["actor/ratio_max"] == m["actor/ratio_min"] == 1.0  # evaluated at pi_old
    assert m["actor/replay_max_abs_diff"] <= 1e-5 and m["grad_norm"] > 0


def test_diffusion_learner_takes_mini_batches_times_epochs_steps(single_rank):
    learner = _learner(single_rank, "bgpo", mini_batches_per_step=2, epochs_per_step=2)
    batch = _batch()
    learner.score(batch, 1)
    before = learner.policy.scheduler.num_steps
    m = learner.update(batch)
    assert learner.policy.scheduler.num_steps == before + 4
    assert m["actor/ratio_max"] > 1.0 or m["actor/ratio_min"] < 1.0  # later steps moved off pi_old


def test_vrpo_learner_builds_the_reference(single_rank):
    learner = _learner(single_rank, "vrpo")
    batch = _batch()
    learner.score(batch, 1)
    assert learner.ref is not None
    assert all(torch.equal(a, b) for a, b in zip(batch.ref_logprobs, batch.old_logprobs))
    m = learner.update(batch)
    assert m["actor/num_pairs"] >= 1 and m["actor/margin_mean"] == 0.0  # pi_theta == pi_ref
