"""LoRA adapters (megatron_rl.lora) on tiny Megatron models: zero-initialized B leaves the model
unchanged, merging reproduces the adapted forward, training touches only the adapters (AR and
diffusion SFT), and at TP=2 the adapted and merged forwards agree with the TP=1 ones."""

from __future__ import annotations

import os

import torch
from helpers import REPO, run_ranks

HF = dict(architectures=["Qwen3ForCausalLM"], hidden_size=64, intermediate_size=128,
          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
          vocab_size=40, max_position_embeddings=128)
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def _model(ps, arch="Qwen3ForCausalLM"):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.models.builder import build_model

    torch.manual_seed(0)
    mask = AttnMaskType.causal if arch.startswith("Qwen3") else AttnMaskType.no_mask
    return build_model({**HF, "architectures": [arch], "mask_token_id": 39}, ps,
                       attention_backend="flex_sdpa", attn_mask_type=mask)


def _randomize_b(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "lora_b"):
                m.lora_b.copy_(0.05 * torch.randn(m.lora_b.shape, generator=g))


def test_zero_init_then_merge_matches_adapted_forward(single_rank):
    from megatron_rl.lora import apply_lora, merge_lora
    from megatron_rl.models.forward import forward_logits

    model = _model(single_rank)
    ids = torch.randint(0, 39, (2, 9), generator=torch.Generator().manual_seed(0))
    base = forward_logits(model, single_rank, ids)
    names = apply_lora(model, single_rank, rank=4, alpha=8, targets=TARGETS)
    assert len(names) == 8
    assert torch.equal(forward_logits(model, single_rank, ids), base)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    _randomize_b(model)
    adapted = forward_logits(model, single_rank, ids)
    assert (adapted - base).abs().max() > 1e-3
    assert merge_lora(model) == 8
    assert not any("lora_" in n for n, _ in model.named_parameters())
    assert (forward_logits(model, single_rank, ids) - adapted).abs().max() <= 1e-5


def test_ar_and_diffusion_training_update_only_adapters(single_rank):
    from megatron_rl.actor.diffusion_policy import diffusion_train_step
    from megatron_rl.actor.policy import build_policy
    from megatron_rl.algo.dllm.sft_loss import masked_diffusion_batch
    from megatron_rl.config import OptimizerConfig
    from megatron_rl.lora import apply_lora

    seqs = [torch.tensor([1, 5, 6, 7, 8, 9, 10]), torch.tensor([1, 11, 12, 13])]
    for arch in ("Qwen3ForCausalLM", "LLaDAModelLM"):
        model = _model(single_rank, arch if arch.startswith("Qwen3") else "DreamModel")
        frozen = {n: p.detach().clone() for n, p in model.named_parameters()}
        apply_lora(model, single_rank, rank=4, alpha=8, targets=TARGETS)
        policy = build_policy(model, model.config, single_rank, OptimizerConfig(lr=1e-2), 10)
        losses = []
        for _ in range(6):
            if arch.startswith("Qwen3"):
                m = policy.train_mini_batch(seqs, [3, 2], lambda i, lp, e: (
                    -torch.cat(lp).sum() / 7, {"loss": -torch.cat(lp).sum().detach() / 7}))
            else:
                masked = [torch.ones(4, dtype=torch.bool), torch.ones(2, dtype=torch.bool)]
                b = masked_diffusion_batch([[1, 5, 6], [1, 11]], [[7, 8, 9, 10], [12, 13]],
                                           masked, [mk.float() for mk in masked], mask_id=39)
                m = diffusion_train_step(policy, [b], 6.0)
            losses.append(m["loss"])
        assert losses[-1] < losses[0], (arch, losses)
        for n, p in policy.module.named_parameters():
            if "lora_" not in n:
                assert torch.equal(p.detach(), frozen[n]), n


def set_adapters(model, ps):
    """Layout-independent adapters: full A / B per layer from a fixed seed, sliced like the base
    weight on this TP rank (fc1 is [gate_r; up_r] per rank, qkv rows are contiguous per rank)."""
    g = torch.Generator().manual_seed(5)
    tp, r = ps.tp_size, ps.tp_rank
    with torch.no_grad():
        for name, m in sorted(model.named_modules()):
            if not hasattr(m, "lora_a"):
                continue
            if m.lora_kind == "column":
                rows = m.lora_b.shape[0]
                full_b = 0.05 * torch.randn(rows * tp, 4, generator=g)
                m.lora_a.copy_(0.05 * torch.randn(4, m.lora_a.shape[1], generator=g))
                if name.endswith("linear_fc1"):
                    f, h = rows * tp // 2, rows // 2
                    m.lora_b.copy_(torch.cat([full_b[r * h : (r + 1) * h], full_b[f + r * h : f + (r + 1) * h]]))
                else:
                    m.lora_b.copy_(full_b[r * rows : (r + 1) * rows])
            else:
                cols = m.lora_a.shape[1]
                full_a = 0.05 * torch.randn(4, cols * tp, generator=g)
                m.lora_b.copy_(0.05 * torch.randn(m.lora_b.shape[0], 4, generator=g))
                m.lora_a.copy_(full_a[:, r * cols : (r + 1) * cols])


def adapted_outputs(model, ps) -> dict:
    """Adapted logits, gradient of layer 0's (replicated) qkv A under a fixed loss, merged logits."""
    from megatron_rl.lora import apply_lora, merge_lora
    from megatron_rl.models.forward import forward_logits

    ids = torch.randint(0, 39, (2, 9), generator=torch.Generator().manual_seed(0))
    apply_lora(model, ps, rank=4, alpha=8, targets=TARGETS)
    set_adapters(model, ps)
    adapted = forward_logits(model, ps, ids)
    model.zero_grad()
    logits = model(ids, torch.arange(9).expand(2, 9), None, runtime_gather_output=True)
    logits.float().pow(2).mean().backward()
    grad_a = model.decoder.layers[0].self_attention.linear_qkv.lora_a.grad.clone()
    merge_lora(model)
    return {"adapted": adapted, "merged": forward_logits(model, ps, ids), "grad_a": grad_a}


def test_lora_tp2_matches_tp1(tmp_path, single_rank):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.models.builder import build_model
    from megatron_rl.models.weights import load_hf_weights

    run_ranks([os.path.join(REPO, "tests/unit/_lora_tp_worker.py"), str(tmp_path)], timeout=300)
    tp2 = torch.load(tmp_path / "tp2.pt")
    model = build_model(HF, single_rank, attention_backend="sdpa", attn_mask_type=AttnMaskType.causal)
    load_hf_weights(model, str(tmp_path / "hf"), single_rank, HF)
    tp1 = adapted_outputs(model, single_rank)
    for key in ("adapted", "merged", "grad_a"):
        assert (tp2[key] - tp1[key]).abs().max() <= 1e-5, key
