"""Logit parity of the diffusion families: Megatron GPTModel vs slow pure-PyTorch references.

Chain proven (fp32, CPU):
1. The released modeling files cannot be downloaded here, so each family's forward is written
   from docs/algorithms.md in `dllm_reference.py` and run on the same HF-named safetensors that
   `models.weights.load_hf_weights` loads into Megatron (LLaDA's own names, Dream = Qwen2 names,
   SDAR = Qwen3 dense / MoE names). Megatron's logits agree within 1e-4 for
   - LLaDA / Dream: bidirectional attention over right-padded rows (pad keys masked);
   - SDAR / SDAR-MoE / LLaDA2 (MoE, fused QKV, partial RoPE, sigmoid group-limited router with
     expert bias, shared expert): the block-causal inference mask, and the packed [noisy | clean] training
     layout (THD, RoPE restarting per half, the kernel BlockMask of C.2) against the reference
     run at positions [0..N-1, 0..N-1] with the C.2 mask written out from the rule.
2. The reference itself is pinned to transformers: for the Qwen2 / Qwen3 backbones the
   reference equals transformers' model with its causal mask replaced by the family's mask.
3. The same at TP=2 (two gloo ranks under torchrun, tests/parity/_dllm_tp_worker.py).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from dllm_reference import (
    block_causal_keep,
    llada2_reference_logits,
    reference_logits,
    two_copy_keep,
)
from helpers import REPO, make_tiny_hf, run_ranks
from safetensors.torch import load_file, save_file

FAMILIES = ["llada", "dream", "sdar", "sdar_moe", "llada2"]
LENGTHS = [12, 8]
BLOCK = 4


LLADA2 = dict(
    architectures=["LLaDA2MoeModelLM"],
    model_type="llada2_moe",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    partial_rotary_factor=0.5,
    rope_theta=600000.0,
    rms_norm_eps=1e-6,
    num_experts=16,
    num_experts_per_tok=4,
    num_shared_experts=1,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    norm_topk_prob=True,
    use_qk_norm=True,
    use_qkv_bias=False,
    use_bias=False,
    hidden_act="silu",
    tie_word_embeddings=False,
    max_position_embeddings=256,
    mask_token_id=127,
    block_size=BLOCK,
)
"""A tiny LLaDA2.0-mini-shaped config (no transformers class: written by hand)."""


def llada2_state(hf: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random LLaDA2 tensors with the released names (norms ~1, rest N(0, 0.05), expert bias
    N(0, 0.1) so that it changes which experts are chosen)."""
    h, kv, d, e = (hf[k] for k in ("hidden_size", "num_key_value_heads", "head_dim", "num_experts"))
    qkv_rows = (hf["num_attention_heads"] + 2 * kv) * d
    ffn, moe = hf["intermediate_size"], hf["moe_intermediate_size"]
    shapes = {
        "model.word_embeddings.weight": (hf["vocab_size"], h),
        "model.norm.weight": (h,),
        "lm_head.weight": (hf["vocab_size"], h),
    }
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "attention.query_key_value.weight": (qkv_rows, h),
            p + "attention.query_layernorm.weight": (d,),
            p + "attention.key_layernorm.weight": (d,),
            p + "attention.dense.weight": (h, hf["num_attention_heads"] * d),
            p + "post_attention_layernorm.weight": (h,),
        })
        mlps = {"mlp.": ffn} if i < hf["first_k_dense_replace"] else {
            **{f"mlp.experts.{x}.": moe for x in range(e)},
            "mlp.shared_experts.": moe * hf["num_shared_experts"],
        }
        for m, width in mlps.items():
            shapes.update({p + m + "gate_proj.weight": (width, h),
                           p + m + "up_proj.weight": (width, h),
                           p + m + "down_proj.weight": (h, width)})
        if i >= hf["first_k_dense_replace"]:
            shapes[p + "mlp.gate.weight"] = (e, h)
            shapes[p + "mlp.gate.expert_bias"] = (e,)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, s in shapes.items():
        if k.endswith("expert_bias"):
            out[k] = 0.1 * torch.randn(s, generator=g)
        elif len(s) == 1:
            out[k] = 1 + 0.1 * torch.randn(s, generator=g)
        else:
            out[k] = 0.05 * torch.randn(s, generator=g)
    return out


def _block(hf: dict) -> bool:
    return hf["architectures"][0].startswith("SDAR") or hf["architectures"][0].startswith("LLaDA2")


def _reference(hf: dict):
    return llada2_reference_logits if hf["architectures"][0].startswith("LLaDA2") else reference_logits


def make_family(family: str, out_dir) -> str:
    """A tiny random HF checkpoint of a diffusion family (config.json + model.safetensors)."""
    out_dir = str(out_dir)
    if family == "llada2":
        os.makedirs(out_dir, exist_ok=True)
        hf = dict(LLADA2)
        save_file(llada2_state(hf), os.path.join(out_dir, "model.safetensors"))
    elif family == "llada":
        os.makedirs(out_dir, exist_ok=True)
        hf = dict(
            architectures=["LLaDAModelLM"],
            d_model=64,
            n_heads=4,
            n_kv_heads=4,
            n_layers=3,
            mlp_hidden_size=96,
            vocab_size=128,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            weight_tying=False,
            mask_token_id=127,
            max_sequence_length=256,
        )
        g = torch.Generator().manual_seed(0)
        sd = {
            "model.transformer.wte.weight": (128, 64),
            "model.transformer.ln_f.weight": (64,),
            "model.transformer.ff_out.weight": (128, 64),
        }
        for i in range(3):
            p = f"model.transformer.blocks.{i}."
            sd.update(
                {
                    p + "attn_norm.weight": (64,),
                    p + "ff_norm.weight": (64,),
                    p + "q_proj.weight": (64, 64),
                    p + "k_proj.weight": (64, 64),
                    p + "v_proj.weight": (64, 64),
                    p + "attn_out.weight": (64, 64),
                    p + "ff_proj.weight": (96, 64),
                    p + "up_proj.weight": (96, 64),
                    p + "ff_out.weight": (64, 96),
                }
            )
        sd = {
            k: (1 + 0.1 * torch.randn(s, generator=g))
            if len(s) == 1
            else 0.05 * torch.randn(s, generator=g)
            for k, s in sd.items()
        }
        save_file(sd, os.path.join(out_dir, "model.safetensors"))
    else:
        base = {"dream": "qwen2", "sdar": "qwen3", "sdar_moe": "qwen3_moe"}[family]
        make_tiny_hf(base, out_dir, seed=1)
        with open(os.path.join(out_dir, "config.json")) as f:
            hf = json.load(f)
        hf["architectures"] = [
            {"dream": "DreamModel", "sdar": "SDARForCausalLM", "sdar_moe": "SDARMoeForCausalLM"}[
                family
            ]
        ]
        hf["mask_token_id"] = 127
        if family != "dream":
            hf["block_size"] = BLOCK
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf, f)
    return out_dir


def inputs(hf: dict):
    """Right-padded ids [2, 12] and keep masks [2, 12, 12] (the family's inference mask)."""
    g = torch.Generator().manual_seed(3)
    s = max(LENGTHS)
    ids = torch.zeros(len(LENGTHS), s, dtype=torch.long)
    keep = torch.zeros(len(LENGTHS), s, s, dtype=torch.bool)
    block = _block(hf)
    for r, n in enumerate(LENGTHS):
        ids[r, :n] = torch.randint(1, 127, (n,), generator=g)
        keep[r, :n, :n] = block_causal_keep(n, BLOCK) if block else True
    keep |= ~keep.any(-1, keepdim=True)  # pad rows: attend everywhere (ignored)
    return ids, keep


def expected(path: str, hf: dict):
    """Reference logits: per row [n, V] (inference mask) and, for SDAR, the [2n, V] two-copy layout."""
    sd = load_file(os.path.join(path, "model.safetensors"))
    ids, _ = inputs(hf)
    rows = []
    for r, n in enumerate(LENGTHS):
        block = _block(hf)
        keep = block_causal_keep(n, BLOCK) if block else torch.ones(n, n, dtype=torch.bool)
        rows.append(_reference(hf)(sd, hf, ids[r, :n], torch.arange(n), keep))
    two = []
    if _block(hf):
        for r, n in enumerate(LENGTHS):
            x = torch.cat([ids[r, :n], ids[r, :n]])
            x[:n][torch.arange(n) % 3 == 1] = 127  # some noisy tokens masked
            two.append(
                _reference(hf)(sd, hf, x, torch.arange(n).repeat(2), two_copy_keep(n, BLOCK))
            )
    return rows, two


def megatron_logits(path: str, hf: dict, ps):
    """The Megatron model's logits for the same inputs (runs on every rank; TP-gathered)."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.algo.dllm.sft_loss import attention_inputs, block_diffusion_batch
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.forward import forward_logits
    from megatron_rl.models.weights import load_hf_weights

    model = build_model(hf, ps, attention_backend="flex_sdpa", attn_mask_type=AttnMaskType.no_mask)
    load_hf_weights(model, path, ps, hf)
    ids, keep = inputs(hf)
    out = forward_logits(model, ps, ids, attention_mask=~keep[:, None])
    rows = [out[r, :n] for r, n in enumerate(LENGTHS)]
    two = []
    if _block(hf):
        resp = [ids[r, :n].tolist() for r, n in enumerate(LENGTHS)]
        masked = [torch.arange(n) % 3 == 1 for n in LENGTHS]
        b = block_diffusion_batch(
            [[] for _ in LENGTHS],
            resp,
            masked,
            [m.float() for m in masked],
            mask_id=127,
            block_size=BLOCK,
        )
        mask, psp = attention_inputs(b, ps.device, "kernel")
        packed = forward_logits(
            model, ps, b.tokens[None], attention_mask=mask, packed_seq_params=psp
        )[0]
        two = list(packed.split([2 * n for n in LENGTHS]))
    return rows, two


def _max_diff(a: list, b: list) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b)) if a else 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_dllm_logit_parity_fp32(family, tmp_path, single_rank):
    path = make_family(family, tmp_path / family)
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    want_rows, want_two = expected(path, hf)
    got_rows, got_two = megatron_logits(path, hf, single_rank)
    assert _max_diff(got_rows, want_rows) <= 1e-4
    assert _max_diff(got_two, want_two) <= 1e-4
    assert len(got_two) == (2 if family.startswith(("sdar", "llada2")) else 0)


@pytest.mark.parametrize("family", ["dream", "sdar", "sdar_moe"])
def test_reference_matches_transformers_backbone(family, tmp_path):
    """The reference forward is pinned to transformers' Qwen2 / Qwen3 (MoE) with the causal mask
    replaced by the family's mask (bidirectional, block-causal) as a 4D additive mask."""
    import transformers

    path = make_family(family, tmp_path / family)
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    base = {
        "dream": "Qwen2ForCausalLM",
        "sdar": "Qwen3ForCausalLM",
        "sdar_moe": "Qwen3MoeForCausalLM",
    }[family]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path,
        config=transformers.AutoConfig.from_pretrained(path, architectures=[base]),
        dtype=torch.float32,
        attn_implementation="eager",
    ).eval()
    sd = load_file(os.path.join(path, "model.safetensors"))
    n = LENGTHS[0]
    ids = torch.randint(1, 127, (n,), generator=torch.Generator().manual_seed(5))
    keep = block_causal_keep(n, BLOCK) if family != "dream" else torch.ones(n, n, dtype=torch.bool)
    with torch.no_grad():
        hf_out = model(
            ids[None], attention_mask=torch.where(keep, 0.0, float("-inf"))[None, None]
        ).logits[0]
    ref = reference_logits(sd, hf, ids, torch.arange(n), keep)
    assert (hf_out - ref).abs().max().item() <= 1e-4


def test_dllm_logit_parity_tp2(tmp_path):
    """All five families at TP=2 (two gloo ranks) against the references."""
    paths = [make_family(f, tmp_path / f) for f in FAMILIES]
    out = tmp_path / "tp2.pt"
    run_ranks(
        [os.path.join(REPO, "tests/parity/_dllm_tp_worker.py"), str(out), *paths], timeout=400
    )
    got = torch.load(out)
    for path in paths:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
        want_rows, want_two = expected(path, hf)
        assert _max_diff(got[path]["rows"], want_rows) <= 1e-4, path
        assert _max_diff(got[path]["two"], want_two) <= 1e-4, path


def test_llada_convert_round_trip_is_bit_identical(tmp_path):
    """`megatron-rl convert` HF -> Megatron (torch_dist) -> HF keeps LLaDA's own tensor names."""
    import subprocess

    src = make_family("llada", tmp_path / "hf")
    # A fresh single process: drop the rendezvous variables of this pytest process's group.
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    for args in ([src, str(tmp_path / "mg"), "--to", "megatron"],
                 [str(tmp_path / "mg"), str(tmp_path / "hf2"), "--to", "hf"]):
        proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "convert", *args],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    want = load_file(os.path.join(src, "model.safetensors"))
    got = {}
    for name in os.listdir(tmp_path / "hf2"):
        if name.endswith(".safetensors"):
            got.update(load_file(str(tmp_path / "hf2" / name)))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_llada2_hf_megatron_hf_round_trip_is_bit_identical(tmp_path, single_rank):
    """HF safetensors -> Megatron -> HF keeps LLaDA2's names and bits: the fused
    `query_key_value` is split into Megatron's per-group layout and re-fused, the router's
    `expert_bias` (a Megatron buffer) travels with the weights."""
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.weights import load_hf_weights, save_hf_weights

    src = make_family("llada2", tmp_path / "hf")
    hf = dict(LLADA2)
    model = build_model(hf, single_rank)
    load_hf_weights(model, src, single_rank, hf)
    bias = model.decoder.layers[1].mlp.router.expert_bias
    want = load_file(os.path.join(src, "model.safetensors"))
    assert torch.equal(bias, want["model.layers.1.mlp.gate.expert_bias"])
    save_hf_weights(model, single_rank, hf, str(tmp_path / "out"))
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_llada2_config_translation_and_names():
    from megatron_rl.models import get_family
    from megatron_rl.models.dllm import block_size, diffusion_spec, mask_token_id

    fam = get_family(LLADA2)
    cfg = fam.transformer_config(LLADA2)
    assert cfg["moe_router_score_function"] == "sigmoid" and cfg["moe_router_enable_expert_bias"]
    assert (cfg["moe_router_num_groups"], cfg["moe_router_group_topk"]) == (4, 2)
    assert cfg["moe_router_topk_scaling_factor"] == 2.5 and cfg["qk_layernorm"]
    assert cfg["moe_shared_expert_intermediate_size"] == 16 and cfg["moe_layer_freq"] == [0, 1, 1]
    assert fam.hf_names(LLADA2, "decoder.layers.0.self_attention.linear_qkv.weight") == (
        "model.layers.0.attention.query_key_value.weight",
    )
    spec = diffusion_spec(LLADA2)
    assert (spec.kind, spec.sampler) == ("block", "llada2")
    assert mask_token_id(LLADA2) == 127 and block_size(LLADA2) == BLOCK
    bare = {k: v for k, v in LLADA2.items() if k not in ("mask_token_id", "block_size")}
    assert block_size(bare) == 32


@pytest.mark.parametrize(
    ("change", "ep", "field"),
    [
        ({}, 3, "num_experts"),  # EP = 3 does not divide 16 experts
        ({"n_group": 3}, 1, "n_group"),
        ({"norm_topk_prob": False}, 1, "norm_topk_prob"),
        ({"use_qkv_bias": True}, 1, "use_qkv_bias"),
    ],
)
def test_llada2_bad_inputs_name_the_field(change, ep, field):
    from megatron_rl.models.builder import validate
    from megatron_rl.parallel import ParallelState

    ps = ParallelState(pgs=None, device=torch.device("cpu"), rank=0, world_size=ep, tp_size=1,
                       tp_rank=0, pp_size=1, pp_rank=0, ep_size=ep, ep_rank=0, cp_size=1,
                       dp_size=1, dp_rank=0)
    with pytest.raises(ValueError, match=f"`{field}`"):
        validate({**LLADA2, **change}, ps)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
