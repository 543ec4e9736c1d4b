"""Slow pure-PyTorch reference forwards of the diffusion families, written from docs/algorithms.md C.1 /
C.2 and the tensor names in models/{llada,dream,sdar}.py -- not from Megatron.

One function, `reference_logits(state_dict, hf, ids, pos, keep)`, covers the four families:
pre-norm RMSNorm decoder layers, NeoX-style RoPE at the given positions, grouped-query attention
under an explicit keep mask (True = may attend) -- bidirectional for LLaDA / Dream, block-causal
or the C.2 [noisy | clean] mask for SDAR --, SwiGLU MLP or a softmax top-k MoE (Qwen3-MoE /
SDAR-30B-A3B), final RMSNorm and LM head. Dream's one-position logit shift (C.0.5) is applied by
callers, not here (the network's logits are unshifted).
`llada2_reference_logits` (same arguments) is LLaDA2's BailingMoeV2 layout (models/llada2.py):
fused QKV, partial RoPE, sigmoid group-limited MoE with expert bias and a shared expert.
Also used by the TP=2 worker (tests/parity/_dllm_tp_worker.py).
"""

from __future__ import annotations

import torch


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    """x [s, h, d] rotated by positions pos [s] (rotate-half convention)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    f = pos.double()[:, None] * inv[None]
    emb = torch.cat([f, f], -1)
    cos, sin = emb.cos().float()[:, None], emb.sin().float()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def names(hf: dict):
    """(per-layer name function, top-level names, shape dict) of a family's HF checkpoint."""
    arch = hf["architectures"][0]
    if arch == "LLaDAModelLM":

        def layer(i):
            p = f"model.transformer.blocks.{i}."
            return dict(
                attn_norm=p + "attn_norm.weight",
                q=p + "q_proj.weight",
                k=p + "k_proj.weight",
                v=p + "v_proj.weight",
                o=p + "attn_out.weight",
                mlp_norm=p + "ff_norm.weight",
                gate=p + "ff_proj.weight",
                up=p + "up_proj.weight",
                down=p + "ff_out.weight",
            )

        top = dict(
            embed="model.transformer.wte.weight",
            norm="model.transformer.ln_f.weight",
            head="model.transformer.ff_out.weight",
        )
        heads = hf["n_heads"]
        shape = dict(
            layers=hf["n_layers"],
            heads=heads,
            kv=hf.get("n_kv_heads") or heads,
            head_dim=hf["d_model"] // heads,
            eps=hf.get("rms_norm_eps", 1e-5),
            theta=hf.get("rope_theta", 10000.0),
        )
        return layer, top, shape

    def layer(i):
        p = f"model.layers.{i}."
        out = dict(
            attn_norm=p + "input_layernorm.weight",
            q=p + "self_attn.q_proj.weight",
            k=p + "self_attn.k_proj.weight",
            v=p + "self_attn.v_proj.weight",
            o=p + "self_attn.o_proj.weight",
            mlp_norm=p + "post_attention_layernorm.weight",
            gate=p + "mlp.gate_proj.weight",
            up=p + "mlp.up_proj.weight",
            down=p + "mlp.down_proj.weight",
            router=p + "mlp.gate.weight",
            expert=p + "mlp.experts.{e}.{w}_proj.weight",
        )
        if arch == "DreamModel":
            out.update(
                q_bias=p + "self_attn.q_proj.bias",
                k_bias=p + "self_attn.k_proj.bias",
                v_bias=p + "self_attn.v_proj.bias",
            )
        else:  # SDAR = Qwen3: per-head RMSNorm of q and k before RoPE
            out.update(q_norm=p + "self_attn.q_norm.weight", k_norm=p + "self_attn.k_norm.weight")
        return out

    tied = hf.get("tie_word_embeddings", False)
    top = dict(
        embed="model.embed_tokens.weight",
        norm="model.norm.weight",
        head="model.embed_tokens.weight" if tied else "lm_head.weight",
    )
    heads = hf["num_attention_heads"]
    params = hf.get("rope_parameters") or {}
    shape = dict(
        layers=hf["num_hidden_layers"],
        heads=heads,
        kv=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        eps=hf.get("rms_norm_eps", 1e-6),
        theta=params.get("rope_theta", hf.get("rope_theta", 10000.0)),
        experts=hf.get("num_experts") or hf.get("num_local_experts") or 0,
        topk=hf.get("num_experts_per_tok", 0),
        norm_topk=hf.get("norm_topk_prob", False),
    )
    return layer, top, shape


def _mlp(sd, n, x, shape):
    if shape.get("experts") and n.get("router") in sd:
        probs = (x @ sd[n["router"]].T).softmax(-1)
        w, idx = probs.topk(shape["topk"], dim=-1)
        if shape["norm_topk"]:
            w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(shape["experts"]):
            g, u, d = (sd[n["expert"].format(e=e, w=k)] for k in ("gate", "up", "down"))
            y = (torch.nn.functional.silu(x @ g.T) * (x @ u.T)) @ d.T
            out += (w * (idx == e)).sum(-1, keepdim=True) * y
        return out
    return (torch.nn.functional.silu(x @ sd[n["gate"]].T) * (x @ sd[n["up"]].T)) @ sd[n["down"]].T


@torch.no_grad()
def reference_logits(
    sd: dict, hf: dict, ids: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    """Logits [s, V] of one sequence ids [s] at positions pos [s] under keep [s, s] (fp32)."""
    layer, top, shape = names(hf)
    h, kv, d = shape["heads"], shape["kv"], shape["head_dim"]
    x = sd[top["embed"]][ids].float()
    s = ids.shape[0]
    bias = torch.where(keep, 0.0, float("-inf"))
    for i in range(shape["layers"]):
        n = layer(i)
        y = _rms(x, sd[n["attn_norm"]], shape["eps"])
        q, k, v = (y @ sd[n[c]].T + (sd[n[c + "_bias"]] if c + "_bias" in n else 0) for c in "qkv")
        q, k, v = q.view(s, h, d), k.view(s, kv, d), v.view(s, kv, d)
        if "q_norm" in n:
            q, k = _rms(q, sd[n["q_norm"]], shape["eps"]), _rms(k, sd[n["k_norm"]], shape["eps"])
        q, k = _rope(q, pos, shape["theta"]), _rope(k, pos, shape["theta"])
        k, v = k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1)
        att = (torch.einsum("qhd,khd->hqk", q, k) / d**0.5 + bias).softmax(-1)
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(s, h * d) @ sd[n["o"]].T
        x = x + _mlp(sd, n, _rms(x, sd[n["mlp_norm"]], shape["eps"]), shape)
    return _rms(x, sd[top["norm"]], shape["eps"]) @ sd[top["head"]].T


def block_causal_keep(n: int, block_size: int) -> torch.Tensor:
    """[n, n] inference mask of a block-diffusion LM (C.2 step 9): tril over blocks."""
    b = torch.arange(n) // block_size
    return b[None, :] <= b[:, None]


def two_copy_keep(n: int, block_size: int) -> torch.Tensor:
    """[2n, 2n] C.2 step-4 mask of one sample, [noisy | clean], written out from the rule."""
    i = torch.arange(2 * n)
    c, b = i >= n, (i % n) // block_size
    cq, ck, bq, bk = c[:, None], c[None, :], b[:, None], b[None, :]
    return ((bq == bk) & (cq == ck)) | ((bq > bk) & ck & ~cq) | ((bq >= bk) & ck & cq)


def _rope_partial(x, pos, theta, rot):
    """Partial RoPE: rotate-half RoPE on the first `rot` channels of each head, rest passed."""
    return torch.cat([_rope(x[..., :rot], pos, theta), x[..., rot:]], -1)


def _swiglu(x, g, u, d):
    return (torch.nn.functional.silu(x @ g.T) * (x @ u.T)) @ d.T


def _llada2_moe(sd, p, x, hf):
    """LLaDA2 MoE block: sigmoid router, bias-corrected group-limited top-k selection, weights =
    renormalized sigmoid scores x routed_scaling_factor, plus the shared experts."""
    e_n, k = hf["num_experts"], hf["num_experts_per_tok"]
    groups, kg = hf.get("n_group") or 1, hf.get("topk_group") or 1
    scores = (x @ sd[p + "mlp.gate.weight"].T).sigmoid()
    choice = scores + sd[p + "mlp.gate.expert_bias"]
    group_score = choice.view(-1, groups, e_n // groups).topk(k // kg, -1)[0].sum(-1)
    keep_g = torch.zeros_like(group_score).scatter(1, group_score.topk(kg, -1)[1], 1.0)
    keep_e = keep_g.repeat_interleave(e_n // groups, -1).bool()
    idx = choice.masked_fill(~keep_e, float("-inf")).topk(k, -1)[1]
    w = scores.gather(1, idx)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * hf.get("routed_scaling_factor", 1.0)
    out = torch.zeros_like(x)
    for e in range(e_n):
        q = p + f"mlp.experts.{e}."
        y = _swiglu(x, *(sd[q + f"{n}_proj.weight"] for n in ("gate", "up", "down")))
        out += (w * (idx == e)).sum(-1, keepdim=True) * y
    if hf.get("num_shared_experts"):
        q = p + "mlp.shared_experts."
        out += _swiglu(x, *(sd[q + f"{n}_proj.weight"] for n in ("gate", "up", "down")))
    return out


@torch.no_grad()
def llada2_reference_logits(
    sd: dict, hf: dict, ids: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    """LLaDA2 (BailingMoeV2 layout, models/llada2.py) logits [s, V] of ids [s] at positions pos
    under keep [s, s]: fused [q; k; v] projection, per-head q/k RMSNorm, partial RoPE on the first
    head_dim * partial_rotary_factor channels, dense SwiGLU for the first first_k_dense_replace
    layers, then the sigmoid group-limited MoE with shared experts."""
    h, kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    d = hf.get("head_dim") or hf["hidden_size"] // h
    rot = int(d * hf.get("partial_rotary_factor", 1.0))
    eps, theta = hf.get("rms_norm_eps", 1e-6), hf.get("rope_theta", 10000.0)
    x = sd["model.word_embeddings.weight"][ids].float()
    s = ids.shape[0]
    bias = torch.where(keep, 0.0, float("-inf"))
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        y = _rms(x, sd[p + "input_layernorm.weight"], eps)
        qkv = y @ sd[p + "attention.query_key_value.weight"].T
        q, k, v = qkv.split([h * d, kv * d, kv * d], -1)
        q, k, v = q.view(s, h, d), k.view(s, kv, d), v.view(s, kv, d)
        q = _rms(q, sd[p + "attention.query_layernorm.weight"], eps)
        k = _rms(k, sd[p + "attention.key_layernorm.weight"], eps)
        q, k = _rope_partial(q, pos, theta, rot), _rope_partial(k, pos, theta, rot)
        k, v = k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1)
        att = (torch.einsum("qhd,khd->hqk", q, k) / d**0.5 + bias).softmax(-1)
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(s, h * d) @ sd[
            p + "attention.dense.weight"
        ].T
        y = _rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        if i < (hf.get("first_k_dense_replace") or 0):
            x = x + _swiglu(y, *(sd[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down")))
        else:
            x = x + _llada2_moe(sd, p, y, hf)
    head = "model.word_embeddings.weight" if hf.get("tie_word_embeddings") else "lm_head.weight"
    return _rms(x, sd["model.norm.weight"], eps) @ sd[head].T
