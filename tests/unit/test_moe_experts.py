"""Grouped MoE experts (models/moe_experts.py) against SequentialMLP and the per-expert loop.

CPU, fp32: torch 2.13's CPU `_grouped_mm` is a per-group mm loop inside torch, so these tests
prove the wiring (offsets, layouts, activation, gradients, weight maps, checkpoint layout);
`test_cuda_grouped_kernel_*` (gpu) checks torch's fused CUTLASS kernel on Hopper in bf16.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from _moe_experts_ep_worker import loss_and_expert_grads, named_grads
from helpers import REPO, make_tiny_hf, run_ranks
from safetensors.torch import load_file

TOL = 1e-5

TINY_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 6,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
}


def _config(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _experts_pair(ps, dtype=torch.float32, **overrides):
    """(SequentialMLP, GroupedExperts) of one MoE layer of TINY_MOE with equal weights."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from megatron_rl.models.builder import transformer_config
    from megatron_rl.models.moe_experts import GroupedExperts

    cfg = transformer_config(TINY_MOE, ps, dtype, **overrides)
    spec = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts).submodules.mlp
    seq = build_module(spec.submodules.experts, cfg.num_moe_experts, cfg, pg_collection=ps.pgs)
    grp = GroupedExperts(cfg.num_moe_experts, cfg, pg_collection=ps.pgs)
    with torch.no_grad():
        for e, mlp in enumerate(seq.local_experts):
            grp.weight1[e].copy_(mlp.linear_fc1.weight)
            grp.weight2[e].copy_(mlp.linear_fc2.weight)
    return cfg, seq.to(ps.device), grp.to(ps.device)


def _routed_inputs(cfg, counts, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(counts)
    x = torch.randn(n, cfg.hidden_size, generator=g).to(device, dtype).requires_grad_()
    probs = torch.rand(n, generator=g).to(device, torch.float32).requires_grad_()
    return x, torch.tensor(counts), probs


def _fwd_bwd(module, x, counts, probs, seed=1):
    out, bias = module(x, counts, probs)
    assert bias is None
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(out.shape, generator=g).to(out.device, out.dtype)
    x.grad = probs.grad = None
    (out.float() * proj.float()).sum().backward()
    return out.detach().float(), x.grad.float(), probs.grad.float()


def _grads(seq, grp):
    w1 = torch.stack([m.linear_fc1.weight.grad for m in seq.local_experts])
    w2 = torch.stack([m.linear_fc2.weight.grad for m in seq.local_experts])
    return (w1, w2), (grp.weight1.grad, grp.weight2.grad)


def test_grouped_equals_sequential_mlp_and_the_loop_including_empty_experts(single_rank):
    from megatron_rl.models.moe_experts import reference_experts

    cfg, seq, grp = _experts_pair(single_rank)
    counts = [5, 0, 9, 1, 0, 7]  # two experts receive no token
    x, c, probs = _routed_inputs(cfg, counts, "cpu", torch.float32)
    want = _fwd_bwd(seq, x, c, probs)
    got = _fwd_bwd(grp, x, c, probs)
    for a, b in zip(want, got, strict=True):
        assert (a - b).abs().max() <= TOL
    for a, b in zip(*_grads(seq, grp), strict=True):
        assert (a - b).abs().max() <= TOL
    assert grp.weight1.grad[1].abs().max() == 0 and grp.weight2.grad[4].abs().max() == 0
    loop = reference_experts(cfg, x.detach(), c, probs.detach(), grp.weight1, grp.weight2)
    assert (loop - got[0]).abs().max() <= TOL


def test_grouped_handles_no_tokens_at_all(single_rank):
    cfg, _, grp = _experts_pair(single_rank)
    x, c, probs = _routed_inputs(cfg, [0] * 6, "cpu", torch.float32)
    out, _ = grp(x, c, probs)
    out.sum().backward()
    assert out.shape == (0, cfg.hidden_size)
    assert grp.weight1.grad.abs().max() == 0  # in the graph, zero gradient


def _tiny_models(ps, hf):
    from megatron_rl.models.builder import build_model

    torch.manual_seed(0)
    return build_model(hf, ps, moe_experts="sequential"), build_model(hf, ps, moe_experts="grouped")


def test_tiny_qwen3_moe_logits_and_grads_match_sequential(tmp_path, single_rank):
    from megatron_rl.models.moe_experts import GroupedExperts
    from megatron_rl.models.weights import load_hf_weights

    src = make_tiny_hf("qwen3_moe", tmp_path / "hf", seed=5, num_experts=6)
    hf = _config(src)
    seq, grp = _tiny_models(single_rank, hf)
    assert isinstance(grp.decoder.layers[0].mlp.experts, GroupedExperts)
    for m in (seq, grp):
        load_hf_weights(m, src, single_rank, hf)
    ids = torch.randint(1, hf["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(24).expand(2, -1)
    outs = []
    for m in (seq, grp):
        logits = m(ids, pos, None)
        (logits.float().log_softmax(-1)[..., 7].mean()).backward()
        outs.append(logits.detach())
    assert (outs[0] - outs[1]).abs().max() <= TOL
    # Every tensor's gradient, by its HF-mapped Megatron name (expert rows of the stacks).
    want, got = (named_grads(m, hf) for m in (seq, grp))
    assert sorted(want) == sorted(got)
    for name, g in want.items():
        assert (g - got[name]).abs().max() <= TOL, name


def test_hf_weights_round_trip_through_grouped_experts(tmp_path, single_rank):
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.weights import load_hf_weights, save_hf_weights

    src = make_tiny_hf("qwen3_moe", tmp_path / "hf", seed=3)
    hf = _config(src)
    model = build_model(hf, single_rank, moe_experts="grouped")
    load_hf_weights(model, src, single_rank, hf)
    save_hf_weights(model, single_rank, hf, str(tmp_path / "out"))
    want = load_file(os.path.join(src, "model.safetensors"))
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def _layout(sharded):
    """(key, global shape, offset, local shape, replica) of every built sharded entry."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, apply_factories

    apply_factories(sharded)
    rows = set()
    for v in nested_values(sharded):
        if isinstance(v, ShardedObject):
            rows.add((v.key, v.global_shape, v.global_offset, None, v.replica_id))
        else:
            rows.add((v.key, v.global_shape, v.global_offset, v.local_shape, v.replica_id))
    return rows


@pytest.mark.parametrize("singleton", [False, True])
def test_sharded_state_dict_layout_is_sequential_mlps(singleton, single_rank):
    seq, grp = _tiny_models(single_rank, TINY_MOE)
    meta = {"singleton_local_shards": singleton}
    want = _layout(seq.sharded_state_dict(prefix="model.", metadata=dict(meta)))
    got = _layout(grp.sharded_state_dict(prefix="model.", metadata=dict(meta)))
    assert got == want


def test_megatron_checkpoints_cross_load_between_grouped_and_sequential(tmp_path, single_rank):
    from megatron_rl.actor.checkpoint import load_checkpoint, save_checkpoint
    from megatron_rl.models.weights import _params

    seq, grp = _tiny_models(single_rank, TINY_MOE)
    with torch.no_grad():
        for p in seq.parameters():
            p.add_(torch.randn_like(p))
    save_checkpoint(seq, str(tmp_path / "a"), hf_config=TINY_MOE)
    load_checkpoint(grp, str(tmp_path / "a"))
    want = {p.name: p.param for p in _params(seq, TINY_MOE)}
    assert all(torch.equal(p.param, want[p.name]) for p in _params(grp, TINY_MOE))
    seq2, _ = _tiny_models(single_rank, TINY_MOE)
    save_checkpoint(grp, str(tmp_path / "b"), hf_config=TINY_MOE)
    load_checkpoint(seq2, str(tmp_path / "b"))
    assert all(torch.equal(p.param, want[p.name]) for p in _params(seq2, TINY_MOE))


def test_moe_experts_choice_is_resolved_or_refused(monkeypatch):
    from megatron_rl.config import ModelConfig
    from megatron_rl.models import moe_experts as me

    cpu = torch.device("cpu")
    assert me.resolve_moe_experts("auto", cpu, torch.float32) == "sequential"
    assert me.resolve_moe_experts("grouped", cpu, torch.float32) == "grouped"
    assert me.resolve_moe_experts("sequential", cpu, torch.bfloat16) == "sequential"
    with pytest.raises(ValueError, match="model.moe_experts"):
        me.resolve_moe_experts("fused", cpu, torch.float32)
    with pytest.raises(ValueError, match="model.moe_experts"):
        ModelConfig(moe_experts="fused")
    monkeypatch.delattr(torch, "_grouped_mm")
    with pytest.raises(ValueError, match=r"moe_experts.*_grouped_mm"):
        me.resolve_moe_experts("grouped", cpu, torch.float32)
    assert me.resolve_moe_experts("auto", cpu, torch.float32) == "sequential"


def test_misaligned_width_and_unsupported_features_are_refused(single_rank):
    from megatron_rl.models.builder import build_model

    with pytest.raises(ValueError, match=r"moe_intermediate_size.*multiple of 4"):
        build_model({**TINY_MOE, "moe_intermediate_size": 30}, single_rank, moe_experts="grouped")
    with pytest.raises(ValueError, match="does not support add_bias_linear"):
        build_model(TINY_MOE, single_rank, moe_experts="grouped", add_bias_linear=True)


def test_dense_model_is_built_as_before(single_rank):
    from megatron_rl.models.builder import build_model

    hf = {**TINY_MOE, "architectures": ["Qwen3ForCausalLM"]}
    torch.manual_seed(0)
    a = build_model(hf, single_rank, moe_experts="grouped")
    torch.manual_seed(0)
    b = build_model(hf, single_rank)
    assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()]
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_expert_parallel_2_matches_one_rank(tmp_path, single_rank):
    """gloo EP = 2 (3 experts per rank, alltoall dispatcher): grouped logits and expert
    gradients equal the single-rank SequentialMLP model's."""
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.weights import load_hf_weights

    src = make_tiny_hf("qwen3_moe", tmp_path / "hf", seed=2, num_experts=6)
    run_ranks([os.path.join(REPO, "tests/unit/_moe_experts_ep_worker.py"), src, str(tmp_path)])
    got = torch.load(tmp_path / "ep2.pt")
    hf = _config(src)
    model = build_model(hf, single_rank, moe_experts="sequential")
    load_hf_weights(model, src, single_rank, hf)
    want = loss_and_expert_grads(model, hf)
    assert (want["logits"] - got["logits"]).abs().max() <= TOL
    assert sorted(want["grads"]) == sorted(got["grads"])
    for name, g in want["grads"].items():
        assert (g - got["grads"][name]).abs().max() <= TOL, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fused_activation", [False, True])
def test_cuda_grouped_kernel_matches_the_loop_in_bf16(fused_activation, single_rank):
    """torch's CUTLASS grouped GEMM (sm90/sm100, bf16) against the per-expert loop on the same
    bf16 weights; the loop runs cuBLAS GEMMs, so the two differ only by accumulation order.
    `fused_activation`: Megatron's fused weighted SwiGLU (what the actor bench runs)."""
    from megatron_rl.models.builder import transformer_config
    from megatron_rl.models.moe_experts import (
        GroupedExperts,
        grouped_kernel_runs,
        reference_experts,
    )

    ps = single_rank
    assert grouped_kernel_runs(ps.device, torch.bfloat16), torch.cuda.get_device_name()
    hf = {**TINY_MOE, "hidden_size": 256, "moe_intermediate_size": 128, "num_experts": 16}
    cfg = transformer_config(hf, ps, torch.bfloat16, bias_activation_fusion=fused_activation)
    grp = GroupedExperts(16, cfg, pg_collection=ps.pgs).to(ps.device)
    counts = [300, 0, 17, 1, 0, 64, 129, 5, 2, 0, 800, 33, 7, 90, 0, 11]
    x, c, probs = _routed_inputs(cfg, counts, ps.device, torch.bfloat16)
    out, dx, dp = _fwd_bwd(grp, x, c, probs)
    w1, w2 = grp.weight1.grad.float(), grp.weight2.grad.float()
    ref = [t.detach().clone().requires_grad_() for t in (grp.weight1, grp.weight2)]
    x.grad = probs.grad = None
    loop = reference_experts(cfg, x, c, probs, *ref)
    proj = torch.randn(loop.shape, generator=torch.Generator().manual_seed(1))
    (loop.float() * proj.to(ps.device)).sum().backward()
    for got, want in ((out, loop.detach()), (dx, x.grad), (dp, probs.grad),
                      (w1, ref[0].grad), (w2, ref[1].grad)):
        want = want.float()
        assert (got - want).abs().max() <= 2e-2 * want.abs().max() + 1e-3
    for e in (1, 4, 9, 14):  # experts without tokens get exactly zero gradient
        assert w1[e].abs().max() == 0 and w2[e].abs().max() == 0


def test_identity_chunk_sort_is_skipped_and_other_orders_still_sort(single_rank):
    """patches.py 12: at EP x TP = 1 the dispatcher's chunk sort is the identity (no copy);
    any other order (EP = 2: (rank, expert) -> (expert, rank)) runs Megatron's sort."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    sort = token_dispatcher.sort_chunks_by_idxs
    x, probs = torch.randn(10, 4), torch.rand(10)
    sizes = torch.tensor([3, 0, 4, 3])
    out, p = sort(x, sizes, torch.arange(4), probs=probs)
    assert out is x and p is probs
    order = torch.tensor([0, 2, 1, 3])
    want = moe_utils.sort_chunks_by_idxs(x, sizes, order, probs=probs)
    got = sort(x, sizes, order, probs=probs)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_counts_that_miss_rows_are_refused(single_rank):
    cfg, _, grp = _experts_pair(single_rank)
    x, _, probs = _routed_inputs(cfg, [2, 2, 2, 2, 2, 2], "cpu", torch.float32)
    with pytest.raises(ValueError, match="token counts sum to 10, but 12 rows"):
        grp(x, torch.tensor([2, 2, 2, 2, 2, 0]), probs)
