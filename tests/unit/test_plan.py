"""`megatron-rl plan`: the memory model against measured peaks, the layout rules, the CLI.

Measured peaks (one H200, docs/benchmarks.md and tools/bench/plan_memory.py, 2026-12-03):
- the actor bench's 1.7B shape at 4 x 4096, no recompute: 70.1 GiB;
- GRPO at the peer configuration (0.6B shape, 8 prompts x 8 samples x 512 new tokens, 96-token
  prompts, trainer.micro_batch_tokens 8192): 42.6 GiB (the RL loop); its train step through
  actor/policy.py measured alone 42.1 GiB, full recompute 29.8 GiB, and the 1.7B shape at
  4 x 4096 through the same path 115.7 GiB.
The plan must land within 15% of each (the issue's bar); it lands within 5%.
"""

from __future__ import annotations

import os

import pytest

from megatron_rl import plan as P

H200 = P.Cluster("h200", P.GPUS["h200"], 1, 1)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def shape(name: str) -> P.Shape:
    return P.Shape.from_hf(P.load_shape(name)[0])


def single_gpu(recompute: str, mbt: int) -> P.Layout:
    return P.Layout(1, 1, 1, 1, 1, recompute, mbt, False)


PEER = P.Workload(prompt_len=96, response_len=512, prompts=8, n=8, engine="local")


@pytest.mark.parametrize(
    "name,workload,layout,measured",
    [
        ("qwen3-1.7b", P.Workload(prompt_len=0, response_len=4096, prompts=4, engine="none",
                                  logits="chunked", fused_swiglu=True),
         single_gpu("none", 16384), 70.1),
        ("qwen3-0.6b", PEER, single_gpu("none", 8192), 42.6),
        ("qwen3-0.6b", PEER, single_gpu("none", 8192), 42.14),
        ("qwen3-0.6b", PEER, single_gpu("full", 8192), 29.83),
        ("qwen3-1.7b", P.Workload(prompt_len=1, response_len=4095, prompts=4, engine="none"),
         single_gpu("none", 16384), 115.69),
    ],
)
def test_estimate_within_15_percent_of_measured_peak(name, workload, layout, measured):
    est = P.estimate(shape(name), H200, workload, layout)
    assert est.fits
    assert abs(est.gib["peak"] / measured - 1) < 0.15, (est.gib, measured)


def test_parameter_counts_match_the_published_sizes():
    for name, billions in [("qwen3-0.6b", 0.596), ("qwen3-1.7b", 1.721), ("qwen3-4b", 4.022),
                           ("qwen3-30b-a3b", 30.53), ("sdar-30b-a3b", 30.53),
                           ("llama-3.1-8b", 8.030)]:
        assert shape(name).total_params() / 1e9 == pytest.approx(billions, rel=2e-3), name


def test_parameter_count_equals_the_built_megatron_model(single_rank):
    """The plan's count (fast) against the parameters of the GPTModel models/builder.py builds
    (reference), dense and MoE, tied and untied."""
    import torch

    from megatron_rl.models.builder import build_model

    base = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    moe = {**base, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": True}
    for hf in ({**base, "architectures": ["Qwen3ForCausalLM"], "tie_word_embeddings": True}, moe):
        model = build_model(hf, single_rank, dtype=torch.float32)
        built = sum(p.numel() for p in model.parameters())
        assert P.Shape.from_hf(hf).total_params() == built, hf["architectures"]


def test_sharding_divides_what_megatron_divides():
    s = shape("qwen3-30b-a3b")
    cluster = P.Cluster("h20", P.GPUS["h20"], 8, 1)
    wl = P.Workload(prompt_len=1024, response_len=8192, prompts=32, n=8, engine="sglang",
                    engine_mem_fraction=0.2)
    a = P.estimate(s, cluster, wl, P.Layout(2, 1, 4, 1, 4, "full", 16384, False))
    b = P.estimate(s, cluster, wl, P.Layout(2, 1, 4, 1, 4, "full", 16384, True))
    # experts: 48 layers x 128 x 3 x 2048 x 768 over TP x EP = 8, never over the expert-DP of 1
    experts = 48 * 128 * 3 * 2048 * 768 / 8
    assert a.gib["optimizer"] - b.gib["optimizer"] == pytest.approx(
        (a.gib["optimizer"] - 12 * experts / P.GIB) * 3 / 4, rel=1e-6)
    assert a.gib["weights"] == b.gib["weights"] and a.gib["grads"] == b.gib["grads"]
    for lay in P.layouts(s, cluster, wl, ["full"], [16384], [False, True]):
        assert 32 % lay.tp == 0 and 4 % lay.tp == 0 and 48 % lay.pp == 0
        assert (lay.dp * lay.cp) % lay.ep == 0 and 128 % lay.ep == 0 and lay.cp == 1
        assert lay.tp * lay.pp * lay.cp * lay.dp == 8 and lay.tp <= 8


def test_local_engine_refuses_what_the_built_in_engine_refuses():
    cluster = P.Cluster("h20", P.GPUS["h20"], 8, 1)
    wl = P.Workload(prompt_len=64, response_len=64, prompts=8, n=8, engine="local")
    moe = list(P.layouts(shape("qwen3-30b-a3b"), cluster, wl, ["full"], [128], [False]))
    assert moe and all(lay.tp == lay.ep == lay.pp == 1 for lay in moe)
    dense = list(P.layouts(shape("qwen3-4b"), cluster, wl, ["full"], [128], [False]))
    assert {lay.tp for lay in dense} == {1, 2, 4, 8} and all(lay.pp == 1 for lay in dense)


def test_recompute_and_micro_batch_order_memory():
    s = shape("qwen3-4b")
    cluster = P.Cluster("h20", P.GPUS["h20"], 8, 1)
    wl = P.Workload(prompt_len=1024, response_len=4096, prompts=64, n=8, engine="none")
    peak = {rc: P.estimate(s, cluster, wl, P.Layout(2, 1, 1, 1, 4, rc, 16384, True)).gib
            for rc in ("none", "selective", "full")}
    assert peak["none"]["activations"] > peak["selective"]["activations"] > peak["full"]["activations"]
    small = P.estimate(s, cluster, wl, P.Layout(2, 1, 1, 1, 4, "none", 5120, True)).gib
    assert small["activations"] < peak["none"]["activations"] and small["logits"] < peak["none"]["logits"]


def test_qwen3_30b_a3b_pick_on_an_h20_node_fits_and_is_the_recipes():
    """The recipe's layout is the plan's pick for its workload on 8 x 96 GB H20, and it fits."""
    from megatron_rl.cli import load_config
    from megatron_rl.config import RLConfig

    ests = P.plan(shape("qwen3-30b-a3b"), P.Cluster("h20", P.GPUS["h20"], 8, 1),
                  P.Workload(prompt_len=1024, response_len=8192, prompts=32, n=8,
                             engine="sglang", engine_mem_fraction=0.2))
    pick = ests[0]
    assert pick.fits and pick.gib["peak"] <= P.GPUS["h20"] - 4.0
    cfg = load_config(RLConfig, os.path.join(REPO, "examples/qwen3_30b_a3b_darts/grpo_darts.yaml"), [])
    par = cfg.parallel
    assert (par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
            par.expert_model_parallel_size, par.context_parallel_size) == (
        pick.layout.tp, pick.layout.pp, pick.layout.ep, pick.layout.cp)
    assert cfg.model.recompute == pick.layout.recompute
    assert cfg.trainer.micro_batch_tokens == pick.layout.micro_batch_tokens
    assert cfg.optimizer.use_distributed_optimizer == pick.layout.distributed_optimizer


def test_cli_prints_the_table_and_writes_loadable_overrides(tmp_path, capsys):
    from megatron_rl.cli import load_config
    from megatron_rl.config import RLConfig

    out = tmp_path / "layout.yaml"
    rc = P.main(["--model", "qwen3-4b", "--gpu", "h20", "--prompt-len", "1024",
                 "--response-len", "4096", "--prompts", "64", "--n", "8",
                 "--max-batch-size", "64", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "pick: parallel.tensor_model_parallel_size=" in text
    assert "weights" in text and "logits" in text and "engine" in text
    cfg = load_config(RLConfig, str(out), [])
    pick = text.split("pick: ", 1)[1].split("  (")[0].split()
    assert f"parallel.tensor_model_parallel_size={cfg.parallel.tensor_model_parallel_size}" in pick
    assert f"trainer.micro_batch_tokens={cfg.trainer.micro_batch_tokens}" in pick


def test_cli_errors_name_the_argument(tmp_path, capsys):
    with pytest.raises(ValueError, match="--model.*qwen3-30b-a3b"):
        P.main(["--model", "qwen9", "--prompt-len", "8", "--response-len", "8", "--prompts", "1"])
    with pytest.raises(ValueError, match="--gpu"):
        P.main(["--model", "qwen3-0.6b", "--gpu", "tpu", "--prompt-len", "8",
                "--response-len", "8", "--prompts", "1"])
    with pytest.raises(ValueError, match="--engine-mem-fraction"):
        P.main(["--model", "qwen3-0.6b", "--engine", "sglang", "--prompt-len", "8",
                "--response-len", "8", "--prompts", "1"])
    # does not fit anywhere: exit 1 with the smallest peak named
    rc = P.main(["--model", "qwen3-30b-a3b", "--gpu", "a100-40g", "--gpus-per-node", "1",
                 "--prompt-len", "1024", "--response-len", "8192", "--prompts", "8",
                 "--engine", "sglang", "--engine-mem-fraction", "0.3"])
    assert rc == 1 and "no layout fits" in capsys.readouterr().out


def test_unsupported_model_is_planned_with_a_warning(capsys):
    rc = P.main(["--model", "llama-3.1-8b", "--gpu", "h20", "--prompt-len", "512",
                 "--response-len", "1024", "--prompts", "64", "--n", "8", "--max-batch-size", "64"])
    out = capsys.readouterr().out
    assert rc == 0 and "warning: megatron-rl cannot build this model yet" in out and "llama3" in out
