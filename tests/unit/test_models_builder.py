"""models registry and builder: config translation and the errors that name the bad field."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rl.models import MODEL_FAMILIES, get_family
from megatron_rl.parallel import ParallelState

QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
}
MOE = {
    **QWEN3,
    "architectures": ["Qwen3MoeForCausalLM"],
    "num_experts": 6,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
}


def _ps(tp=1, pp=1, ep=1) -> ParallelState:
    return ParallelState(
        pgs=None,
        device=torch.device("cpu"),
        rank=0,
        world_size=tp * pp * ep,
        tp_size=tp,
        tp_rank=0,
        pp_size=pp,
        pp_rank=0,
        ep_size=ep,
        ep_rank=0,
        cp_size=1,
        dp_size=1,
        dp_rank=0,
    )


def test_registry_is_keyed_by_hf_architecture():
    assert {
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Qwen2ForCausalLM",
        "LlamaForCausalLM",
    } <= set(MODEL_FAMILIES)
    assert get_family(QWEN3).name == "qwen3"


def test_unknown_architecture_lists_known_ones():
    with pytest.raises(ValueError, match=r"`architectures`.*GPT2LMHeadModel.*Qwen3ForCausalLM"):
        get_family({**QWEN3, "architectures": ["GPT2LMHeadModel"]})


@pytest.mark.parametrize(
    ("hf", "ps", "field"),
    [
        (QWEN3, _ps(tp=3), "num_attention_heads"),
        ({**QWEN3, "num_attention_heads": 8, "head_dim": 8}, _ps(tp=4), "num_key_value_heads"),
        (
            {
                **QWEN3,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "head_dim": 8,
                "intermediate_size": 130,
            },
            _ps(tp=4),
            "intermediate_size",
        ),
        ({**QWEN3, "num_hidden_layers": 3}, _ps(pp=2), "num_hidden_layers"),
        (MOE, _ps(ep=4), "num_experts"),
        (QWEN3, _ps(ep=2), "expert_model_parallel_size"),
    ],
)
def test_layout_errors_name_the_field(hf, ps, field):
    from megatron_rl.models.builder import validate

    with pytest.raises(ValueError, match=f"`[a-z_.]*{field}`"):
        validate(hf, ps)


def test_transformer_config_translation():
    from megatron_rl.models.builder import transformer_config

    cfg = transformer_config(MOE, _ps(), torch.bfloat16, recompute="selective")
    assert cfg.num_query_groups == 2 and cfg.kv_channels == 16 and cfg.qk_layernorm
    assert cfg.num_moe_experts == 6 and cfg.moe_router_topk == 2 and cfg.moe_ffn_hidden_size == 32
    assert cfg.moe_router_pre_softmax is False  # norm_topk_prob: softmax over the top-k
    assert cfg.params_dtype == torch.bfloat16 and cfg.bf16
    assert cfg.recompute_granularity == "selective"
    no_norm = transformer_config({**MOE, "norm_topk_prob": False}, _ps())
    assert no_norm.moe_router_pre_softmax is True
    dense_first = transformer_config({**MOE, "mlp_only_layers": [0]}, _ps())
    assert dense_first.moe_layer_freq == [0, 1, 1, 1]


def test_swiglu_fusion_on_cuda_dense_models_only():
    """Megatron's compiled SwiGLU (bias_activation_fusion) is on for dense models on CUDA; CPU
    runs the eager reference ops, and MoE experts keep their own activation path."""
    from megatron_rl.models.builder import transformer_config

    cuda = dataclasses.replace(_ps(), device=torch.device("cuda", 0))
    assert transformer_config(QWEN3, cuda).bias_activation_fusion
    assert not transformer_config(QWEN3, _ps()).bias_activation_fusion
    assert not transformer_config(MOE, cuda).bias_activation_fusion


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_swiglu_matches_the_eager_mlp_cuda():
    """On CUDA, a dense MLP with the fused SwiGLU against the eager one (same weights, bf16):
    outputs and input / weight gradients within bf16 rounding."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    from megatron_rl.config import ParallelConfig
    from megatron_rl.models.builder import transformer_config
    from megatron_rl.parallel import destroy_parallel, init_parallel

    ps = init_parallel(ParallelConfig())
    try:
        subs = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
        mlps = [MLP(transformer_config(QWEN3, ps, torch.bfloat16, bias_activation_fusion=f),
                    subs).cuda() for f in (True, False)]
        assert mlps[0].config.bias_activation_fusion and not mlps[1].config.bias_activation_fusion
        mlps[1].load_state_dict(mlps[0].state_dict())
        x0 = torch.randn(37, 3, 64, device="cuda", dtype=torch.bfloat16)
        outs = []
        for mlp in mlps:
            x = x0.clone().requires_grad_(True)
            y, _ = mlp(x)
            y.float().pow(2).sum().backward()
            outs.append((y.detach(), x.grad, mlp.linear_fc1.weight.grad))
        for a, b in zip(*outs):
            assert float((a.float() - b.float()).abs().max()) <= 2e-2 * float(b.float().abs().max())
    finally:
        destroy_parallel()


def test_unsupported_rope_and_activation_name_the_field():
    from megatron_rl.models.builder import transformer_config

    with pytest.raises(ValueError, match="rope_type"):
        transformer_config({**QWEN3, "rope_parameters": {"rope_type": "yarn", "factor": 4}}, _ps())
    with pytest.raises(ValueError, match="hidden_act"):
        transformer_config({**QWEN3, "hidden_act": "gelu"}, _ps())
    with pytest.raises(ValueError, match="recompute"):
        transformer_config(QWEN3, _ps(), recompute="some")


def test_family_name_map_covers_fused_tensors():
    fam = MODEL_FAMILIES["Qwen3MoeForCausalLM"]
    assert fam.hf_names(MOE, "decoder.layers.2.self_attention.linear_qkv.weight") == tuple(
        f"model.layers.2.self_attn.{x}_proj.weight" for x in "qkv"
    )
    assert fam.hf_names(MOE, "decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight") == (
        "model.layers.1.mlp.experts.5.gate_proj.weight",
        "model.layers.1.mlp.experts.5.up_proj.weight",
    )
    tied = {**QWEN3, "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": True}
    assert MODEL_FAMILIES["LlamaForCausalLM"].hf_names(tied, "output_layer.weight") == (
        "model.embed_tokens.weight",
    )
    with pytest.raises(ValueError, match="decoder.layers.0.bogus"):
        fam.hf_names(MOE, "decoder.layers.0.bogus")
    assert dataclasses.is_dataclass(fam)
