"""Diffusion samplers (megatron_rl.rollout.diffusion, docs/algorithms.md C.3) on tiny random Megatron
models: no mask token in any output, stop handling, tau = 1 block decoding = one top-1 commit per
step, and the KV-cached block decoder = the uncached (window re-forward) one.

LLaDA2 with and without LLaDA2.1 token editing (C.3.5) is compared with the rule written out on
a sharpened random model (confident enough that edits happen); scripted denoisers (logits from a
fixed rule on the current tokens) check that an out-voted committed token is overwritten, that
prompt tokens never are, and that editing stops after `max_post_steps` forwards."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.rollout.diffusion import (
    DiffusionEngine,
    DiffusionSampling,
    MegatronDenoiser,
    transfer_quota,
)
from megatron_rl.rollout.engine import SamplingParams

V, MASK = 40, 39
SHARP = "SDARForCausalLM-sharp"  # output layer x 20: peaked distributions, so edits happen
PROMPTS = [[1, 5, 6, 7, 8], [1, 9], [1, 4, 4, 4, 4, 4, 4], [3]]


def _model(ps, arch: str):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.models.builder import build_model

    if arch == "LLaDAModelLM":
        hf = dict(architectures=[arch], d_model=64, n_heads=4, n_layers=2, mlp_hidden_size=128,
                  vocab_size=V, rope_theta=10000.0, mask_token_id=MASK)
    else:
        hf = dict(architectures=[arch], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=V,
                  max_position_embeddings=256, mask_token_id=MASK)
    torch.manual_seed(0)
    return build_model(hf, ps, attention_backend="flex_sdpa", attn_mask_type=AttnMaskType.no_mask)


@pytest.fixture(scope="module")
def models(single_rank):
    out = {a: _model(single_rank, a) for a in ("SDARForCausalLM", "LLaDAModelLM", "DreamModel")}
    out[SHARP] = _model(single_rank, "SDARForCausalLM")
    with torch.no_grad():
        out[SHARP].output_layer.weight.mul_(20.0)
    return out


CASES = [
    ("SDARForCausalLM", dict(algorithm="sdar")),
    ("SDARForCausalLM", dict(algorithm="sdar", remasking="low_confidence_static")),
    ("SDARForCausalLM", dict(algorithm="sdar", remasking="sequential", use_cache=False)),
    ("SDARForCausalLM", dict(algorithm="llada2", steps_per_block=4, threshold=0.5)),
    (SHARP, dict(algorithm="llada2", steps_per_block=4, threshold=0.7, token_editing=True,
                 editing_threshold=0.5, max_post_steps=4)),
    ("LLaDAModelLM", dict(algorithm="llada", block_size=4, steps_per_block=2)),
    ("LLaDAModelLM", dict(algorithm="llada", block_size=8, steps_per_block=8, remasking="random")),
    ("DreamModel", dict(algorithm="dream", steps_per_block=5)),
    ("DreamModel", dict(algorithm="dream", steps_per_block=6, remasking="topk_margin")),
    ("DreamModel", dict(algorithm="dream", steps_per_block=6, remasking="entropy", alg_temp=0.5)),
    ("DreamModel", dict(algorithm="dream", steps_per_block=6, remasking="origin")),
]


@pytest.mark.parametrize("arch,knobs", CASES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_no_mask_token_in_outputs_and_stop_handling(models, single_rank, arch, knobs, temperature):
    eng = DiffusionEngine(models[arch], single_rank, mask_id=MASK, sampling=DiffusionSampling(**knobs),
                          shift_logits=arch == "DreamModel", seed=1)
    sp = SamplingParams(temperature=temperature, top_k=8, max_new_tokens=10, stop_token_ids=[5, 28, 30])
    out = eng.generate(PROMPTS, 2, sp)
    assert len(out) == 2 * len(PROMPTS) and len({s.sample_id for s in out}) == len(out)
    for s in out:
        assert MASK not in s.response_ids
        assert 1 <= len(s.response_ids) <= 10
        assert len(s.response_logprobs) == len(s.response_ids)
        if s.finish_reason == "stop":
            assert s.response_ids[-1] in (5, 28, 30)
            assert not set(s.response_ids[:-1]) & {5, 28, 30}
        else:
            assert s.finish_reason == "length" and len(s.response_ids) == 10
            assert not set(s.response_ids) & {5, 28, 30}


@pytest.mark.parametrize("algorithm,arch,edit", [("sdar", "SDARForCausalLM", {}),
                                                 ("llada2", "SDARForCausalLM", {}),
                                                 ("llada2", SHARP, dict(token_editing=True,
                                                                        editing_threshold=0.5))])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_kv_cached_block_decoder_equals_uncached(models, single_rank, algorithm, arch, edit,
                                                 temperature):
    outs = []
    for cache in (True, False):
        cfg = DiffusionSampling(algorithm=algorithm, block_size=4, steps_per_block=4, use_cache=cache,
                                **edit)
        eng = DiffusionEngine(models[arch], single_rank, mask_id=MASK, sampling=cfg, seed=3)
        sp = SamplingParams(temperature=temperature, max_new_tokens=13, stop_token_ids=[2], seed=11)
        outs.append([s.response_ids for s in eng.generate(PROMPTS, 2, sp)])
    assert outs[0] == outs[1]


def test_tau_one_commits_one_top1_token_per_step(models, single_rank):
    """With tau = 1 (nothing is ever above it) and steps = S, SDAR's dynamic rule commits exactly
    the single most confident masked position per step: compare with that rule written out."""
    S, new = 4, 8
    model = models["SDARForCausalLM"]
    cfg = DiffusionSampling(algorithm="sdar", block_size=S, steps_per_block=S, threshold=1.0)
    eng = DiffusionEngine(model, single_rank, mask_id=MASK, sampling=cfg)
    got = eng.generate([[1, 5, 6, 7, 8, 9]], 1, SamplingParams(temperature=0.0, max_new_tokens=new))
    den = MegatronDenoiser(model, single_rank)
    x = torch.tensor([[1, 5, 6, 7, 8, 9] + [MASK] * (3 * S - 2)])  # prompt 6 = block 0 + half of 1
    blk = torch.arange(x.shape[1]) // S
    masked_out = ~(blk[None, :] <= blk[:, None])[None, None]
    commits = 0
    with torch.no_grad():
        for a in (4, 8, 12):
            while bool((x[0, a : a + S] == MASK).any()):
                logits = den.forward(x[:, : a + S], masked_out[..., : a + S, : a + S])[0, a : a + S]
                logits[:, MASK] = float("-inf")
                p, tok = logits.softmax(-1).max(-1)
                p[x[0, a : a + S] != MASK] = -1
                i = int(p.argmax())
                x[0, a + i] = tok[i]
                commits += 1
    assert commits == 10  # 2 masks in the prompt-tail block + 4 + 4
    assert got[0].response_ids == x[0, 6 : 6 + new].tolist()


def _llada2_written_out(model, ps, prompt, new, S, steps, tau, edit_tau=None, max_post=16):
    """C.3.5 for one prompt, greedy, re-forwarding the window: LLaDA2.0 threshold decoding, and
    with edit_tau LLaDA2.1's editing loop. Returns (response tokens, number of forwards)."""
    den = MegatronDenoiser(model, ps)
    P, C = len(prompt), len(prompt) // S * S
    nb = -(-(P - C + new) // S)
    x = torch.tensor([prompt + [MASK] * (C + nb * S - P)])
    blk = torch.arange(x.shape[1]) // S
    masked_out = ~(blk[None, :] <= blk[:, None])[None, None]
    forwards = 0
    with torch.no_grad():
        for a in range(C, C + nb * S, S):
            m0, post, step = int((x[0, a : a + S] == MASK).sum()), 0, 0
            while True:
                old = x[0, a : a + S].clone()
                is_mask = old == MASK
                if not bool(is_mask.any()):
                    if edit_tau is None:
                        break
                    post += 1
                    if post > max_post:
                        break
                logits = den.forward(x[:, : a + S], masked_out[..., : a + S, : a + S])[0, a : a + S]
                forwards += 1
                logits[:, MASK] = float("-inf")
                p, tok = logits.softmax(-1).max(-1)
                n_s = min(m0 // steps + int(step < m0 % steps), int(is_mask.sum()))
                commit = is_mask & (p > tau)
                if int(commit.sum()) < n_s:  # fall back to the n_s most confident masks
                    order = p.masked_fill(~is_mask, -1.0).argsort(descending=True, stable=True)
                    commit = torch.zeros_like(commit)
                    commit[order[:n_s]] = True
                if edit_tau is not None:  # decoded, generated (not prompt), differs, confident
                    slot = torch.arange(a, a + S)
                    commit |= ~is_mask & (slot >= P) & (tok != old) & (p > edit_tau)
                x[0, a : a + S] = torch.where(commit, tok, old)
                step += 1
                if edit_tau is not None and not bool(is_mask.any()) and not bool(commit.any()):
                    break
    return x[0, P : P + new].tolist(), forwards


@pytest.mark.parametrize("edit_tau", [None, 0.7, 0.5])
def test_llada2_equals_the_written_out_rule_with_and_without_editing(models, single_rank, edit_tau):
    """LLaDA2.0 (edit_tau None) and LLaDA2.1 editing = C.3.5 written out, tokens and forwards.
    Editing off ignores the editing knobs; prompts of one block grid give the same tokens
    alone or batched (every sample's editing loop is its own)."""
    model = models[SHARP]
    prompts = [[1, 5, 6, 7, 8], [1, 9, 3, 3, 3, 3, 3], [2, 4, 6, 8, 10, 12, 14, 16, 18]]
    knobs = dict(token_editing=True, editing_threshold=edit_tau, max_post_steps=16) if edit_tau \
        else dict(editing_threshold=0.0, max_post_steps=0)  # ignored while token_editing is off
    cfg = DiffusionSampling(algorithm="llada2", block_size=4, steps_per_block=2, threshold=0.7,
                            use_cache=False, **knobs)
    sp = SamplingParams(temperature=0.0, max_new_tokens=10)
    edited = 0
    for prompt in prompts:
        eng = DiffusionEngine(model, single_rank, mask_id=MASK, sampling=cfg)
        calls = {"n": 0}
        fwd = eng.den.forward

        def counted(*a, _f=fwd, _c=calls, **k):
            _c["n"] += 1
            return _f(*a, **k)

        eng.den.forward = counted
        got = eng.generate([prompt], 1, sp)[0].response_ids
        want, forwards = _llada2_written_out(model, single_rank, prompt, 10, 4, 2, 0.7, edit_tau)
        assert got == want and calls["n"] == forwards
        plain, _ = _llada2_written_out(model, single_rank, prompt, 10, 4, 2, 0.7)
        edited += got != plain
    if edit_tau is not None:
        assert edited > 0  # the sharpened model does edit: the comparison is not vacuous
    eng = DiffusionEngine(model, single_rank, mask_id=MASK, sampling=cfg)
    batched = [s.response_ids for s in eng.generate(prompts[:2], 1, sp)]
    assert batched == [_llada2_written_out(model, single_rank, p, 10, 4, 2, 0.7, edit_tau)[0]
                       for p in prompts[:2]]


class _ScriptedDenoiser:
    """Stands in for MegatronDenoiser (use_cache=False): `rule(tokens)` -> (token, prob) per slot;
    the logits put exactly `prob` on `token` (after the sampler removes [MASK]). Records inputs."""

    def __init__(self, rule):
        self.rule = rule
        self.inputs: list[torch.Tensor] = []

    def forward(self, tokens, masked_out):
        self.inputs.append(tokens.clone())
        tok, prob = self.rule(tokens)
        logits = ((1 - prob) / (V - 2)).log()[..., None].expand(*tok.shape, V).clone()
        logits.scatter_(-1, tok[..., None], prob.log()[..., None])
        return logits


def _scripted_engine(ps, rule, **knobs):
    cfg = DiffusionSampling(algorithm="llada2", block_size=4, steps_per_block=4, threshold=0.9,
                            use_cache=False, **knobs)
    eng = DiffusionEngine(torch.nn.Linear(1, 1), ps, mask_id=MASK, sampling=cfg)
    eng.den = _ScriptedDenoiser(rule)
    return eng


def _block_has_mask(tokens):
    S = 4
    return (tokens == MASK).view(tokens.shape[0], -1, S).any(-1).repeat_interleave(S, 1)


PROMPT = [1, 2, 3, 4, 5, 6]  # blocks of 4: slots 4, 5 are the prompt tail of the first decoded block


def _outvote_rule(tokens):
    """Masks -> 10 + slot (p 0.95, committed at once). Once the block has no mask the model
    prefers 20 + slot (p 0.95). On prompt slots it always wants 30 (p 0.99)."""
    slot = torch.arange(tokens.shape[1]).expand_as(tokens)
    tok = torch.where(_block_has_mask(tokens), 10 + slot, 20 + slot)
    prob = torch.full(tokens.shape, 0.95)
    prompt = slot < len(PROMPT)
    return torch.where(prompt, 30, tok), torch.where(prompt, 0.99, prob)


def test_editing_overwrites_an_outvoted_token_and_never_a_prompt_token(single_rank):
    sp = SamplingParams(temperature=0.0, max_new_tokens=6, logprobs=True)
    off = _scripted_engine(single_rank, _outvote_rule)
    assert off.generate([PROMPT], 1, sp)[0].response_ids == [16, 17, 18, 19, 20, 21]
    assert len(off.den.inputs) == 2  # LLaDA2.0: one forward per block, nothing revisited
    eng = _scripted_engine(single_rank, _outvote_rule, token_editing=True)
    out = eng.generate([PROMPT], 1, sp)[0]
    assert out.response_ids == [26, 27, 28, 29, 30, 31]  # every committed token out-voted
    assert torch.allclose(out.response_logprobs, torch.full((6,), 0.95).log())
    # per block: commit all masks, one edit pass, one pass that changes nothing (settled)
    assert len(eng.den.inputs) == 6
    for x in eng.den.inputs:  # the model wanted 30 there with p 0.99 every time
        assert x[0, : len(PROMPT)].tolist() == PROMPT
    # the threshold is strict: p 0.95 does not edit at editing_threshold 0.95
    strict = _scripted_engine(single_rank, _outvote_rule, token_editing=True, editing_threshold=0.95)
    assert strict.generate([PROMPT], 1, sp)[0].response_ids == [16, 17, 18, 19, 20, 21]


def _restless_rule(tokens):
    """Masks -> 10 (p 0.95). A decoded generated token t is always out-voted by 10 + (t - 9) % 10
    (p 0.99) in rows whose prompt starts with 1; rows starting with 2 are content (p 0.5)."""
    slot = torch.arange(tokens.shape[1]).expand_as(tokens)
    has_mask = _block_has_mask(tokens)
    tok = torch.where(tokens == MASK, 10, 10 + (tokens - 9) % 10)
    restless = (tokens[:, :1] == 1) & ~has_mask
    prob = torch.where(restless, 0.99, 0.5)
    prob = torch.where(tokens == MASK, 0.95, prob)
    prompt = slot < len(PROMPT)
    return torch.where(prompt, tokens, tok), torch.where(prompt, 0.5, prob)


@pytest.mark.parametrize("max_post_steps", [0, 3, 16])
def test_editing_stops_after_max_post_steps(single_rank, max_post_steps):
    sp = SamplingParams(temperature=0.0, max_new_tokens=6)
    eng = _scripted_engine(single_rank, _restless_rule, token_editing=True,
                           max_post_steps=max_post_steps)
    calm = [2] + PROMPT[1:]
    restless, settled = eng.generate([PROMPT, calm], 1, sp)
    # two blocks, each: one forward commits every mask, then max_post_steps editing forwards
    assert len(eng.den.inputs) == 2 * (1 + max_post_steps)
    assert restless.response_ids == [10 + max_post_steps % 10] * 6  # edited on every extra forward
    assert settled.response_ids == [10] * 6  # its loop ended (no edit) while the other's ran on
    for s in (restless, settled):
        assert MASK not in s.response_ids


def test_transfer_quota_front_loads_the_remainder():
    m = torch.tensor([4, 5, 7, 0])
    quotas = torch.stack([transfer_quota(m, 3, s) for s in range(3)], 1)
    assert quotas.tolist() == [[2, 1, 1], [2, 2, 1], [3, 2, 2], [0, 0, 0]]
    assert torch.equal(quotas.sum(1), m)


def test_sampling_defaults_per_family():
    hf = dict(architectures=["SDARForCausalLM"], vocab_size=10, block_size=8)
    cfg = DiffusionSampling.for_model(hf, threshold=0.95)
    assert (cfg.algorithm, cfg.block_size, cfg.steps_per_block, cfg.threshold) == ("sdar", 8, 8, 0.95)
    assert DiffusionSampling.for_model(dict(architectures=["LLaDAModelLM"])).remasking == "low_confidence"
    with pytest.raises(ValueError, match="remasking"):
        DiffusionSampling(algorithm="sdar", remasking="random")
    assert DiffusionSampling(algorithm="llada2").token_editing is False  # LLaDA2.0 by default
    with pytest.raises(ValueError, match="token_editing"):
        DiffusionSampling(algorithm="sdar", token_editing=True)
