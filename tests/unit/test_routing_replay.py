"""MoE routing replay (R3, actor/routing_replay.py) on a tiny Qwen3-MoE, fp32, CPU.

- An "external engine" whose router picks other experts than the actor's would (transformers'
  Qwen3-MoE with its top-k taken on perturbed router logits -- the mixing weights stay the
  softmax of the true logits at the chosen experts, as in any engine) returns the experts it
  routed each fed token to and its log-probs: the actor's recomputed log-probs with replay equal
  the engine's within 1e-5, and without replay they differ (both asserted).
- The built-in engine records its own routing: the recorded experts are the ones transformers'
  router picks for the same tokens, and replaying them gives the engine's log-probs.
- The router's token order (pack_routes) and the refusals (dense model, full recompute,
  built-in engine at PP > 1 or MoE at TP/EP > 1).
"""

import json
from types import SimpleNamespace

import pytest
import torch
from helpers import make_tiny_hf

from megatron_rl.actor.loading import ModelSource, build_module
from megatron_rl.actor.policy import build_policy
from megatron_rl.actor.routing_replay import moe_layer_ids, pack_routes, record
from megatron_rl.config import ModelConfig, RLConfig
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.local import LocalEngine

LENGTHS, STARTS = [12, 9, 14, 7], [5, 3, 6, 2]


@pytest.fixture(scope="module")
def moe(single_rank, tmp_path_factory):
    hf_dir = make_tiny_hf("qwen3_moe", tmp_path_factory.mktemp("r3") / "hf", seed=5)
    hf = json.load(open(f"{hf_dir}/config.json"))
    module, tcfg = build_module(ModelSource(hf, None, hf_dir), single_rank,
                                ModelConfig(dtype="fp32"))
    policy = build_policy(module, tcfg, single_rank, None, micro_batch_tokens=32)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, hf["vocab_size"], (n,), generator=g) for n in LENGTHS]
    return hf, policy, ref, seqs


def hf_engine(ref, seq: torch.Tensor, start: int, noise: float):
    """transformers' forward with every router's top-k taken on logits + noise * N(0, 1) (a
    fixed draw): (response log-probs, routed experts of the fed tokens [n - 1, layers, k])."""
    routes = []
    g = torch.Generator().manual_seed(int(seq.sum()))

    def routed(gate, hidden):
        hidden = hidden.reshape(-1, gate.hidden_dim)
        logits = torch.nn.functional.linear(hidden, gate.weight)
        pick = torch.topk(logits + noise * torch.randn(logits.shape, generator=g), gate.top_k,
                          dim=-1).indices
        w = torch.softmax(logits, -1, dtype=torch.float).gather(-1, pick)
        w = (w / w.sum(-1, keepdim=True)).to(logits.dtype)  # norm_topk_prob
        routes.append(pick)
        return logits, w, pick

    gates = [layer.mlp.gate for layer in ref.model.layers]
    saved = [gate.forward for gate in gates]
    try:
        for gate in gates:
            gate.forward = lambda h, gate=gate: routed(gate, h)
        with torch.no_grad():
            logits = ref(seq[None]).logits[0].float()
    finally:
        for gate, fwd in zip(gates, saved):
            gate.forward = fwd
    lp = torch.log_softmax(logits, -1)[start - 1 : -1].gather(-1, seq[start:, None])[:, 0]
    return lp, torch.stack(routes, 1)[:-1]  # [n - 1, layers, k]: the last token is not fed


def test_replay_reproduces_an_engine_that_routes_differently(moe):
    _, policy, ref, seqs = moe
    eng = [hf_engine(ref, s, p, noise=0.5) for s, p in zip(seqs, STARTS)]
    own = [hf_engine(ref, s, p, noise=0.0) for s, p in zip(seqs, STARTS)]
    changed = sum(int((torch.sort(a[1], -1).values != torch.sort(b[1], -1).values).any(-1).sum())
                  for a, b in zip(eng, own))
    assert changed > 10  # the perturbed engine really routes some tokens elsewhere
    replayed, _ = policy.logprobs(seqs, STARTS, routing=[r for _, r in eng])
    fresh, _ = policy.logprobs(seqs, STARTS)
    gap_replay = max(float((a - lp).abs().max()) for a, (lp, _) in zip(replayed, eng))
    gap_fresh = max(float((a - lp).abs().max()) for a, (lp, _) in zip(fresh, eng))
    assert gap_replay <= 1e-5, gap_replay
    assert gap_fresh > 1e-3, gap_fresh  # without replay the actor is another function
    # and the actor's own routing is transformers' unperturbed one
    assert max(float((a - lp).abs().max()) for a, (lp, _) in zip(fresh, own)) <= 1e-5


def test_builtin_engine_records_its_routing(moe, single_rank):
    hf, policy, ref, _ = moe
    engine = LocalEngine(policy.module, single_rank, pad_id=0, max_batch_size=3,
                         record_routing=True)
    prompts = [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15, 16]]
    samples = engine.generate(prompts, 2, SamplingParams(max_new_tokens=6, seed=3))
    n_moe = len(moe_layer_ids(policy.module.config))
    seqs = [torch.tensor(s.prompt_ids + s.response_ids) for s in samples]
    starts = [len(s.prompt_ids) for s in samples]
    for s, seq in zip(samples, seqs):
        assert s.routed_experts.shape == (len(seq) - 1, n_moe, hf["num_experts_per_tok"])
        _, hf_routes = hf_engine(ref, seq, len(s.prompt_ids), noise=0.0)
        assert torch.equal(torch.sort(s.routed_experts, -1).values,
                           torch.sort(hf_routes, -1).values)
    lps, _ = policy.logprobs(seqs, starts, routing=[s.routed_experts for s in samples])
    for s, lp in zip(samples, lps):
        assert float((s.response_logprobs - lp).abs().max()) <= 1e-5
    # recording leaves the routers as they were: no action set, nothing kept
    states = [layer.mlp.router.router_replay for layer in policy.module.decoder.layers]
    assert all(s.router_replay_action is None and s.recorded_topk_idx is None for s in states)
    with record(policy.module) as last:
        assert all(v is None for v in last().values())


def test_pack_routes_follows_the_router_token_order():
    tcfg = SimpleNamespace(num_moe_experts=8, moe_layer_freq=[1, 0, 1], num_layers=3,
                           moe_router_topk=2, sequence_parallel=False)
    ps = SimpleNamespace(device=torch.device("cpu"), tp_size=1, tp_rank=0)
    # sample i, fed token t, MoE layer j, slot c -> 1000 i + 10 t + j (c = 0) or + 5 (c = 1)
    routes = [torch.tensor([[[1000 * i + 10 * t + j, 1000 * i + 10 * t + j + 5]
                             for j in range(2)] for t in range(n - 1)]) for i, n in
              enumerate([4, 3])]
    out = pack_routes(routes, [4, 3], width=4, tcfg=tcfg, ps=ps)
    assert out.shape == (2, 8, 2)  # [moe layers, s * b, k]
    # token (s=1, b=0) sits at row 1 * 2 + 0; (s=1, b=1) at row 3; last tokens and padding
    # (sample 1's s = 2 and 3, sample 0's s = 3) get experts 0, 1
    assert out[1, 2].tolist() == [11, 16] and out[0, 3].tolist() == [1010, 1015]
    assert out[0, 4].tolist() == [20, 25] and out[0, 5].tolist() == [0, 1]
    assert out[0, 6].tolist() == [0, 1] and out[0, 7].tolist() == [0, 1]
    packed = pack_routes(routes, [4, 3], width=8, tcfg=tcfg, ps=ps, offsets=[0, 4])
    assert packed[0, 4].tolist() == [1000, 1005] and packed[0, 7].tolist() == [0, 1]
    tcfg.sequence_parallel = True
    ps.tp_size, ps.tp_rank = 2, 1
    sp = pack_routes(routes, [4, 3], width=4, tcfg=tcfg, ps=ps)  # rank 1 keeps s = 2, 3
    assert sp.shape == (2, 4, 2) and sp[0, 0].tolist() == [20, 25]
    with pytest.raises(ValueError, match="routed_experts has shape"):
        pack_routes([torch.zeros(1, 2, 2)], [4], width=4, tcfg=tcfg, ps=ps)


def test_refusals_name_the_field():
    from megatron_rl.algo.losses import check_rollout_correction

    cfg = RLConfig()
    cfg.algorithm.rollout_correction.routing_replay = True
    dense = {"architectures": ["Qwen3ForCausalLM"], **{k: v for k, v in cfg.model.tiny.items()
                                                        if k != "architectures"},
             "vocab_size": 128}
    with pytest.raises(ValueError, match="routing_replay.*no MoE layers"):
        check_rollout_correction(cfg, dense, "autoregressive")
    with pytest.raises(ValueError, match="rollout_correction.routing_replay.*diffusion"):
        check_rollout_correction(cfg, dense, "diffusion")
    moe_hf = dict(dense, architectures=["Qwen3MoeForCausalLM"], num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=32)
    cfg.model.recompute = "full"
    with pytest.raises(ValueError, match="recompute=full"):
        check_rollout_correction(cfg, moe_hf, "autoregressive")
    cfg.model.recompute = "none"
    check_rollout_correction(cfg, moe_hf, "autoregressive")


def test_builtin_engine_refuses_pp_and_moe_at_tp_ep():
    from megatron_rl.rollout.decoder import LeanDecoder

    ps = SimpleNamespace(pp_size=2, tp_size=1, ep_size=1, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="pipeline_model_parallel_size=2.*sglang or vllm"):
        LocalEngine(None, ps, pad_id=0)
    module = SimpleNamespace(config=SimpleNamespace(num_moe_experts=4))
    for tp, ep in ((2, 1), (1, 2)):
        ps = SimpleNamespace(pp_size=1, tp_size=tp, ep_size=ep, pgs=SimpleNamespace(tp=None),
                             device=torch.device("cpu"))
        with pytest.raises(ValueError, match=f"MoE models at tensor or expert parallel > 1 .*"
                                             f"size={tp}, expert_model_parallel_size={ep}"):
            LeanDecoder(module, ps)
