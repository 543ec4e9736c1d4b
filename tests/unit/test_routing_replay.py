"""MoE routing replay (R3, actor/routing_replay.py) on a tiny Qwen3-MoE, fp32, CPU.

- An "external engine" whose router picks other experts than the actor's would (transformers'
  Qwen3-MoE with its top-k taken on perturbed router logits -- the mixing weights stay the
  softmax of the true logits at the chosen experts, as in any engine) returns the experts it
  routed each fed token to and its log-probs: the actor's recomputed log-probs with replay equal
  the engine's within 1e-5, and without replay they differ (both asserted).
- The built-in engine records its own routing: the recorded experts are the ones transformers'
  router picks for the same tokens, and replaying them gives the engine's log-probs.
- SGLang's routed experts (`meta_info.routed_experts`, base64 int32 over every layer) decoded by
  the sglang engine and replayed give the engine's log-probs; the request and launch flags.
- The router's token order (pack_routes) and the refusals (dense model, full recompute, an
  engine that reports no routes, built-in engine at PP > 1 or MoE at TP/EP > 1 -- the RL loop
  refuses those before it builds anything).
"""

import base64
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


def _sglang_response(ids: list[int], routes_all_layers: torch.Tensor, lps=None) -> dict:
    """A `/generate` answer as SGLang writes it (routed experts: base64 of int32, every layer)."""
    meta = {"id": "x", "finish_reason": {"type": "length"}, "weight_version": "3",
            "routed_experts": base64.b64encode(
                routes_all_layers.to(torch.int32).numpy().astype("<i4").tobytes()).decode()}
    if lps is not None:
        meta["output_token_logprobs"] = [[float(v), t, None] for v, t in zip(lps, ids)]
    return {"output_ids": ids, "meta_info": meta}


def test_sglang_routed_experts_replayed_give_the_engine_logprobs(moe):
    from megatron_rl.rollout.sglang import RouteLayout, to_sample

    _, policy, ref, seqs = moe
    layout = RouteLayout.of(policy.module)
    samples = []
    for seq, start in zip(seqs, STARTS):
        lp, routes = hf_engine(ref, seq, start, noise=0.5)
        out = _sglang_response(seq[start:].tolist(), routes, lp)
        samples.append(to_sample(seq[:start].tolist(), out, "s", 0, True, layout))
        assert samples[-1].routed_experts.shape == routes.shape
        assert torch.equal(samples[-1].routed_experts.long(), routes)
        assert samples[-1].policy_version == 3
    replayed, _ = policy.logprobs(seqs, STARTS, routing=[s.routed_experts for s in samples])
    gap = max(float((a - s.response_logprobs).abs().max()) for a, s in zip(replayed, samples))
    assert gap <= 1e-5, gap


def test_sglang_route_layout_keeps_the_moe_layers_and_checks_sizes():
    from megatron_rl.rollout.http import EngineServerError
    from megatron_rl.rollout.sglang import RouteLayout, to_sample

    layout = RouteLayout(num_layers=3, moe_layers=[0, 2], topk=2)  # layer 1 is dense
    grid = torch.arange(4 * 3 * 2).reshape(4, 3, 2)  # prompt 2 + response 3 - 1 fed tokens
    s = to_sample([5, 6], _sglang_response([7, 8, 9], grid), "s", 0, False, layout)
    assert torch.equal(s.routed_experts.long(), grid[:, [0, 2]])
    with pytest.raises(EngineServerError, match="18 ids, expected 4 fed tokens x 3 layers"):
        to_sample([5, 6], _sglang_response([7, 8, 9], grid[:3]), "s", 0, False, layout)
    out = _sglang_response([7, 8, 9], grid)
    del out["meta_info"]["routed_experts"]
    with pytest.raises(EngineServerError, match="--enable-return-routed-experts"):
        to_sample([5, 6], out, "s", 0, False, layout)
    assert to_sample([5, 6], out, "s", 0, False, None).routed_experts is None


def test_sglang_asks_for_routes_only_with_replay():
    from megatron_rl.config import RLConfig
    from megatron_rl.rollout.sglang import SGLangClient, launch_commands

    bodies = []
    client = SGLangClient("http://x", timeout_s=1, max_retries=0, retry_backoff_s=0)
    client.http = SimpleNamespace(post=lambda path, body: bodies.append(body) or {})
    client.generate("r", [1, 2], {}, True)
    client.generate("r", [1, 2], {}, True, return_routed_experts=True)
    assert "return_routed_experts" not in bodies[0] and bodies[1]["return_routed_experts"] is True
    sc = RLConfig().rollout.sglang
    plain = launch_commands(sc, "/m", num_gpus=1, dtype="bfloat16", seed=0)[0]
    replay = launch_commands(sc, "/m", num_gpus=1, dtype="bfloat16", seed=0,
                             routed_experts=True)[0]
    assert "--enable-return-routed-experts" not in plain
    assert "--enable-return-routed-experts" in replay


def test_routing_replay_refuses_an_engine_without_routes():
    from megatron_rl.algo.losses import check_rollout_correction

    cfg = RLConfig()
    cfg.algorithm.rollout_correction.routing_replay = True
    cfg.rollout.engine = "vllm"
    moe_hf = {"architectures": ["Qwen3MoeForCausalLM"],
              **{k: v for k, v in cfg.model.tiny.items() if k != "architectures"},
              "vocab_size": 128, "num_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 32}
    with pytest.raises(ValueError, match="routing_replay.*rollout.engine=vllm does not return"):
        check_rollout_correction(cfg, moe_hf, "autoregressive")


@pytest.mark.parametrize("field", ["pipeline", "tensor", "expert"])
def test_rl_loop_refuses_builtin_engine_layouts_before_building(tmp_path, field):
    """The loop's setup check: nothing is built and no output folder is written."""
    from megatron_rl.config import DataConfig, ParallelConfig
    from megatron_rl.train import run

    hf_dir = make_tiny_hf("qwen3_moe", tmp_path / "hf")
    from megatron_rl.tokenizer import CharTokenizer

    CharTokenizer().save_pretrained(hf_dir)
    cfg = RLConfig()
    cfg.model = ModelConfig(path=str(hf_dir), dtype="fp32")
    cfg.data = DataConfig(max_prompt_length=32)
    cfg.parallel = ParallelConfig(**{f"{field}_model_parallel_size": 2})
    cfg.trainer.output_dir = str(tmp_path / "run")
    want = ("pipeline_model_parallel_size=2" if field == "pipeline" else
            "MoE models at tensor or expert parallel > 1")
    with pytest.raises(ValueError, match=f"config field `rollout.engine`.*{want}"):
        run(cfg)
    assert not (tmp_path / "run").exists()
