"""A lean generation forward over a Megatron GPTModel's own weights, with an engine-owned KV cache.

Megatron's module forward is built for training: per-layer autograd functions, [s, b, h, d]
activations, an inference context that keeps its cache in [s, b, h, d] (so every decode step
copies it into the layout the attention kernel wants) and ~1,000 kernel launches of Python
overhead per token. For generation the engine instead runs this forward, which

* reads every weight from the Megatron modules at call time (`module.weight`, no copy, so the
  optimizer's in-place updates are always seen; LoRA adapters are applied as the hooks would);
* keeps K/V per layer in one cache `[layers, slots, kv_heads, max_len, head_dim]` owned by the
  engine: a slot is one sequence, written at its own positions (continuous batching refills a
  slot without touching the others);
* decodes one token for every slot with GQA folded into the query axis (no K/V expansion) and
  the keys sliced to a length bucket, so a step reads only the cache it needs; on CUDA (with
  triton) a layer's cache write and attention are one fused kernel that reads each slot's own
  keys only (`rollout/decode_attention.py`; `decode_attention="torch"` keeps the torch path);
  with RoPE over the whole head the kernel also applies the q/k norm and RoPE to the raw QKV
  rows (its prologue), so a layer runs norm, QKV GEMM, attention, proj GEMM, norm, fc1 GEMM,
  SwiGLU and fc2 GEMM (+ residual) and nothing else;
* on CUDA captures the decode step once per (slots, length bucket) in a CUDA graph: one
  replay per token instead of hundreds of launches. Graphs are dropped when a weight tensor is
  re-allocated (pointer check) or on `release()`.

Tensor parallelism: the heads, the MLP and the vocabulary are split as in the training model;
the row-parallel outputs and the embedding are all-reduced and the logits all-gathered over
`ps.pgs.tp` (NCCL calls are captured in the graph too). MoE layers run Megatron's own MoE module
eagerly (token routing has data-dependent shapes), which disables CUDA graphs; MoE with TP > 1
or EP > 1 is rejected (use the SGLang engine).

The slow reference is the Megatron-forward path of `LocalEngine` (`decoder="megatron"`);
tests compare the two token by token.

Why one file over 450 lines: the prefill, the decode step, its CUDA graphs, the shared-prompt
pointers and the fused per-layer blocks all work on the one cache layout and read the weights
the same way; split apart, each part would re-state both.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_rl.models.norm import rms_norm_reference
from megatron_rl.parallel import ParallelState
from megatron_rl.rollout.decode_attention import (
    Prologue,
    attend_block,
    decode_attention,
    length_bias,
    resolve_decode_attention,
)


def length_bucket(n: int, max_len: int, quantum: int = 64) -> int:
    """Smallest multiple of `quantum` that is >= n, capped at max_len."""
    return min(max_len, -(-n // quantum) * quantum)


class LeanDecoder:
    """Prefill and one-token decode for a dense or MoE GPTModel (no PP).

    Example:
        dec = LeanDecoder(model, ps)
        dec.allocate(slots=256, max_len=640)
        logits = dec.prefill(ids, lengths, slots)          # [n, V] at each row's last token
        dec.tokens[:] = next_ids; dec.positions[:] = lengths
        logits = dec.decode(kv_len=256)                      # [slots, V]
    """

    def __init__(self, module, ps: ParallelState, use_cuda_graphs: bool | None = None,
                 fused_blocks: bool = True, decode_attention: str = "auto"):
        """fused_blocks: decode dense layers through `qkv_block` / `attend_block` /
        `mlp_in_block` (compiled on CUDA) instead of the generic module-by-module path.
        decode_attention (`rollout.decode_attention`): auto | triton | torch -- each decode
        step's cache write + attention as the fused Triton kernel (auto: on CUDA with triton
        installed and head_dim in decode_attention.HEAD_DIMS) or as index writes + `attend_block`;
        an explicit triton that cannot run is refused (ValueError)."""
        cfg = module.config
        if ps.pp_size > 1:
            raise ValueError("parallel.pipeline_model_parallel_size > 1: the lean decoder needs "
                             "the whole model on one rank (use rollout.engine=sglang)")
        self.module = module
        self.ps = ps
        self.tp = ps.pgs.tp if ps.tp_size > 1 else None
        self.moe = cfg.num_moe_experts is not None
        if self.moe and (ps.tp_size > 1 or ps.ep_size > 1):
            raise ValueError(
                "config field `rollout.engine`: the built-in engine does not support MoE models at "
                f"tensor or expert parallel > 1 (parallel.tensor_model_parallel_size={ps.tp_size}, "
                f"expert_model_parallel_size={ps.ep_size}); it decodes MoE only at TP = EP = 1. "
                "Use an external engine (rollout.engine=sglang or vllm)")
        if getattr(cfg, "multi_latent_attention", False):
            raise ValueError("multi-latent attention is not supported by the built-in engine")
        if not (cfg.gated_linear_unit and cfg.activation_func is F.silu):
            raise ValueError("the built-in engine's decoder supports SwiGLU MLPs only "
                             "(gated_linear_unit with silu)")
        tp = ps.tp_size
        self.layers = list(module.decoder.layers)
        self.heads = cfg.num_attention_heads // tp
        self.groups = cfg.num_query_groups // tp
        self.head_dim = cfg.kv_channels
        self.attention = resolve_decode_attention(decode_attention, ps.device.type == "cuda",
                                                  self.head_dim)
        core = self.layers[0].self_attention.core_attention
        self.scale = float(getattr(core, "softmax_scale", None) or self.head_dim ** -0.5)
        rope = module.rotary_pos_emb
        if getattr(rope, "rotary_interleaved", False) or getattr(rope, "seq_len_interpolation_factor", None):
            raise ValueError("the built-in engine supports plain (non-interleaved, unscaled) RoPE")
        self.inv_freq = rope.inv_freq
        self.eps = cfg.layernorm_epsilon
        self.device = ps.device
        self.dtype = cfg.params_dtype
        cuda = self.device.type == "cuda"
        self.use_graphs = (cuda and not self.moe) if use_cuda_graphs is None else use_cuda_graphs
        if self.use_graphs and (not cuda or self.moe):
            raise ValueError("CUDA graphs need a CUDA device and a dense (non-MoE) model")
        self.k = self.v = None
        self.slots = self.max_len = 0
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._weight_ptrs: tuple[int, ...] = ()
        self.attention_splits: int | None = None
        """Key-axis splits of the Triton decode attention (None: decode_attention.launch_config's
        choice); set by benchmarks to compare."""
        self.fused_blocks = fused_blocks
        self._blocks = fused_blocks and self._blocks_ok()
        self._fns = None

    # -- memory ----------------------------------------------------------------------------
    def allocate(self, slots: int, max_len: int) -> None:
        """(Re)allocate the KV cache and the static decode inputs for `slots` x `max_len`."""
        if self.k is not None and self.slots == slots and self.max_len >= max_len:
            return
        self.release()
        shape = (len(self.layers), slots, self.groups, max_len, self.head_dim)
        # zeros, not empty: masked keys get probability 0, and 0 * NaN garbage would be NaN
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.slots, self.max_len = slots, max_len
        self.tokens = torch.zeros(slots, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(slots, dtype=torch.long, device=self.device)
        self._slot_index = torch.arange(slots, device=self.device)
        self.prefix_src = torch.arange(slots, device=self.device)
        self.prefix_len = torch.zeros(slots, dtype=torch.long, device=self.device)
        freqs = torch.outer(torch.arange(max_len, device=self.device, dtype=torch.float32),
                            self.inv_freq.to(self.device, torch.float32))
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = emb.cos().to(self.dtype)  # Megatron casts cos/sin to the activation dtype
        self._sin = emb.sin().to(self.dtype)

    @property
    def has_graphs(self) -> bool:
        """Decode CUDA graphs are captured (and hold pointers into the KV cache)."""
        return bool(self._graphs)

    def copy_prefix(self, dst: list[int], src: list[int], length: int) -> None:
        """Copy the cache rows 0..length - 1 of slots `src` into slots `dst` (one each): a
        prompt prefilled once for several slots."""
        d = torch.tensor(dst, device=self.device)
        s = torch.tensor(src, device=self.device)
        self.k[:, d, :, :length] = self.k[:, s, :, :length]
        self.v[:, d, :, :length] = self.v[:, s, :, :length]

    def point_prefix(self, dst: list[int], src: list[int], lengths: list[int]) -> None:
        """Slot dst[i] reads its keys 0..lengths[i] - 1 from slot src[i]'s rows, which equal its
        own (`copy_prefix`; src[i] = dst[i], length 0: its own rows again). The Triton decode
        attention then streams one copy of a shared prompt, which the L2 cache serves to the
        other slots; the torch path reads every slot's own rows (the same numbers)."""
        d = torch.tensor(dst, device=self.device)
        self.prefix_src[d] = torch.tensor(src, device=self.device)
        self.prefix_len[d] = torch.tensor(lengths, device=self.device)

    def release(self) -> None:
        """Free the KV cache and the captured graphs (engine.sleep)."""
        self._graphs.clear()
        self._pool = None
        self.k = self.v = None
        self.slots = self.max_len = 0

    # -- pieces ----------------------------------------------------------------------------
    def _all_reduce(self, x):
        if self.tp is not None:
            dist.all_reduce(x, group=self.tp)
        return x

    def _linear(self, mod, x, kind: str):
        """y = x W^T (+ b) of a column/row-parallel linear, LoRA adapter included; row-parallel
        outputs are all-reduced over TP."""
        y = F.linear(x, mod.weight)
        a = getattr(mod, "lora_a", None)
        if kind == "row":
            if a is not None:  # A is split like W's columns: sum the partial A x over TP
                h = self._all_reduce(F.linear(x, a))
                y = self._all_reduce(y) + F.linear(h, mod.lora_b) * mod.lora_scale
            else:
                y = self._all_reduce(y)
            bias = getattr(mod, "bias", None)
            return y if bias is None else y + bias
        bias = getattr(mod, "bias", None)
        if bias is not None:
            y = y + bias
        if a is not None:
            y = y + F.linear(F.linear(x, a), mod.lora_b) * mod.lora_scale
        return y

    def _norm(self, norm_mod, x, fused_owner=None):
        """An RMSNorm/LayerNorm module, or the norm TE fuses into the next linear."""
        w = getattr(fused_owner, "layer_norm_weight", None) if fused_owner is not None else None
        if w is not None:
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        if isinstance(norm_mod, torch.nn.RMSNorm):  # eager kernel: nothing compiled in a graph
            return F.rms_norm(x, norm_mod.normalized_shape, norm_mod.weight, norm_mod.eps)
        return norm_mod(x)

    def _embed(self, ids):
        emb = self.module.embedding.word_embeddings
        if self.tp is None:
            return F.embedding(ids, emb.weight)
        lo, hi = emb.vocab_start_index, emb.vocab_end_index
        outside = (ids < lo) | (ids >= hi)
        x = F.embedding((ids - lo).masked_fill(outside, 0), emb.weight)
        return self._all_reduce(x.masked_fill(outside[..., None], 0))

    def _qkv(self, layer, x, cos, sin):
        """x [..., H] -> q [..., heads, d], k/v [..., groups, d] after q/k-norm and RoPE."""
        att = layer.self_attention
        h = self._norm(layer.input_layernorm, x, att.linear_qkv)
        qkv = self._linear(att.linear_qkv, h, "column")
        per = self.heads // self.groups
        qkv = qkv.view(*x.shape[:-1], self.groups, per + 2, self.head_dim)
        q = qkv[..., :per, :].reshape(*x.shape[:-1], self.heads, self.head_dim)
        k, v = qkv[..., per, :], qkv[..., per + 1, :]
        if getattr(att, "q_layernorm", None) is not None:
            q, k = self._norm(att.q_layernorm, q), self._norm(att.k_layernorm, k)
        return _rope_half(q, cos, sin), _rope_half(k, cos, sin), v

    def _mlp(self, layer, x):
        fc1 = getattr(layer.mlp, "linear_fc1", None)
        h = self._norm(layer.pre_mlp_layernorm, x, fc1)
        if fc1 is None:  # a MoE layer: Megatron's module on [s, b, h]
            out, bias = layer.mlp(h.reshape(-1, 1, h.shape[-1]).contiguous())
            out = out if bias is None else out + bias
            return out.reshape(h.shape)
        gate, up = self._linear(fc1, h, "column").chunk(2, dim=-1)
        return self._linear(layer.mlp.linear_fc2, F.silu(gate) * up, "row")

    def _logits(self, x):
        m = self.module
        x = self._norm(m.decoder.final_layernorm, x)
        w = m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights \
            else m.output_layer.weight
        logits = F.linear(x, w)
        if self.tp is not None:
            rows, part = logits.shape  # [rows, V / tp] -> [rows, V]
            parts = torch.empty(self.ps.tp_size * rows, part, dtype=logits.dtype,
                                device=logits.device)
            dist.all_gather_into_tensor(parts, logits.contiguous(), group=self.tp)
            logits = parts.view(self.ps.tp_size, rows, part).transpose(0, 1).reshape(rows, -1)
        return logits

    # -- prefill ---------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, lengths: list[int], slots: list[int]) -> torch.Tensor:
        """Run right-padded prompts `ids` [n, P] (true lengths `lengths`) causally, write their
        K/V into cache rows `slots` at positions 0..P-1, return the logits of each row's last
        prompt token [n, V] (full vocabulary, activation dtype)."""
        n, P = ids.shape
        if P > self.max_len:
            raise ValueError(f"prompt of {P} tokens exceeds the KV cache length {self.max_len}")
        slot_t = torch.tensor(slots, device=self.device)
        cos, sin = self._cos[:P, None, :], self._sin[:P, None, :]  # [P, 1, rot]
        x = self._embed(ids.to(self.device))  # [n, P, H]
        per = self.heads // self.groups
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)  # [n, P, h, d]
            self.k[li, slot_t, :, :P] = k.transpose(1, 2)
            self.v[li, slot_t, :, :P] = v.transpose(1, 2)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if per > 1:
                k, v = k.repeat_interleave(per, dim=1), v.repeat_interleave(per, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            o = o.transpose(1, 2).reshape(n, P, self.heads * self.head_dim)
            x = x + self._linear(layer.self_attention.linear_proj, o, "row")
            x = x + self._mlp(layer, x)
        last = torch.tensor(lengths, device=self.device) - 1
        return self._logits(x[torch.arange(n, device=self.device), last])

    # -- decode ----------------------------------------------------------------------------
    def _blocks_ok(self) -> bool:
        """The fused per-layer blocks cover plain dense layers: torch RMSNorms, no LoRA, no
        row-parallel biases, no MoE (those run the generic path)."""
        if self.moe:
            return False
        for layer in self.layers:
            att, mlp = layer.self_attention, layer.mlp
            norms = [layer.input_layernorm, layer.pre_mlp_layernorm,
                     _qk_norm(att, "q_layernorm"), _qk_norm(att, "k_layernorm")]
            if not all(n is None or isinstance(n, torch.nn.RMSNorm) for n in norms):
                return False
            linears = [att.linear_qkv, att.linear_proj, mlp.linear_fc1, mlp.linear_fc2]
            if any(hasattr(m, "lora_a") for m in linears):
                return False
            if any(getattr(m, "bias", None) is not None
                   for m in (att.linear_proj, mlp.linear_fc1, mlp.linear_fc2)):
                return False
        return True

    def _block_fns(self):
        """The three fused per-layer functions: compiled on CUDA (inductor fuses the norms,
        RoPE, softmax and SwiGLU; one compilation serves every layer and length bucket), plain
        eager functions on CPU (the same code the tests check)."""
        if self._fns is None:
            fns = (qkv_raw_block if self._prologue else qkv_block, attend_block, mlp_in_block)
            if self.device.type == "cuda":
                fns = tuple(torch.compile(f, dynamic=True) for f in fns)
            self._fns = fns
        return self._fns

    @property
    def _prologue(self) -> bool:
        """The fused blocks hand the raw QKV rows to the Triton kernel, which applies the q/k
        norm and RoPE itself (decode_attention.Prologue): the kernel path with RoPE over the
        whole head."""
        return self.attention == "triton" and self.inv_freq.numel() * 2 == self.head_dim

    def _decode_eager(self, kv_len: int) -> torch.Tensor:
        """One token per slot: self.tokens at self.positions -> logits [slots, V]."""
        pos = self.positions
        bias = length_bias(pos, kv_len) if self.attention == "torch" else None  # [B, 1, 1, S]
        x = self._embed(self.tokens)  # [B, H]
        if self._blocks and self._prologue:  # the kernel reads cos/sin at pos itself
            return self._logits(self._decode_blocks(x, None, None, bias, kv_len))
        cos, sin = self._cos[pos][:, None, :], self._sin[pos][:, None, :]  # [B, 1, rot]
        if self._blocks:
            return self._logits(self._decode_blocks(x, cos, sin, bias, kv_len))
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)  # q [B, heads, d], k/v [B, g, d]
            o = self._attend(li, q, k, v, bias, kv_len, attend_block)
            x = x + self._linear(layer.self_attention.linear_proj, o, "row")
            x = x + self._mlp(layer, x)
        return self._logits(x)

    def _attend(self, li: int, q, k, v, bias, kv_len: int, attend_fn):
        """Layer li: write the step's k/v [B, g, d] at self.positions and attend q [B, heads, d]
        to keys 0..position -> [B, heads*d] (GQA: the query heads of a KV head share its keys)."""
        pos = self.positions
        if self.attention == "triton":
            return decode_attention(q, k, v, self.k[li], self.v[li], pos, self.scale, kv_len,
                                    splits=self.attention_splits, prefix=self._prefix())
        self.k[li, self._slot_index, :, pos] = k
        self.v[li, self._slot_index, :, pos] = v
        return attend_fn(q, self.k[li, :, :, :kv_len], self.v[li, :, :, :kv_len], bias, self.scale)

    def _prefix(self):
        """The shared-prompt pointers for the Triton kernel (`point_prefix`)."""
        return self.prefix_src, self.prefix_len

    def _decode_blocks(self, x, cos, sin, bias, kv_len):
        qkv_fn, attend_fn, mlp_fn = self._block_fns()
        eps = self.eps
        per = self.heads // self.groups
        for li, layer in enumerate(self.layers):
            att, mlp = layer.self_attention, layer.mlp
            qn, kn = _qk_norm(att, "q_layernorm"), _qk_norm(att, "k_layernorm")
            qn, kn = None if qn is None else qn.weight, None if kn is None else kn.weight
            ln, qkv_w = layer.input_layernorm.weight, att.linear_qkv.weight
            qkv_b = getattr(att.linear_qkv, "bias", None)
            if self._prologue:  # q/k norm + RoPE inside the attention kernel
                qkv = qkv_fn(x, ln, qkv_w, qkv_b, eps, self.groups, per)
                o = decode_attention(qkv[:, :, :per], qkv[:, :, per], qkv[:, :, per + 1],
                                     self.k[li], self.v[li], self.positions, self.scale, kv_len,
                                     splits=self.attention_splits,
                                     prologue=Prologue(self._cos, self._sin, qn, kn, eps),
                                     prefix=self._prefix())
            else:
                q, k, v = qkv_fn(x, ln, qkv_w, qkv_b, qn, kn, cos, sin, eps, self.groups, per)
                o = self._attend(li, q, k, v, bias, kv_len, attend_fn)
            x, act = mlp_fn(x, self._all_reduce(F.linear(o, att.linear_proj.weight)),
                            layer.pre_mlp_layernorm.weight, mlp.linear_fc1.weight, eps)
            if self.tp is None:  # the residual add in fc2's GEMM epilogue (beta = 1), in place
                # on mlp_fn's fresh x: no add kernel and no copy of x into a new output
                x = x.addmm_(act, mlp.linear_fc2.weight.t())
            else:
                x = x + self._all_reduce(F.linear(act, mlp.linear_fc2.weight))
        return x

    def _weights_moved(self) -> bool:
        ptrs = tuple(p.data_ptr() for p in self.module.parameters())
        moved = ptrs != self._weight_ptrs
        self._weight_ptrs = ptrs
        return moved

    def check_weights(self) -> None:
        """Drop captured graphs if any weight tensor was re-allocated since they were taken
        (and re-check which decode path the layers allow: LoRA may have been added)."""
        if self._weights_moved():
            self._graphs.clear()
            self._pool = None  # a pool whose graphs are gone cannot be captured into again
            self._blocks = self.fused_blocks and self._blocks_ok()

    @torch.no_grad()
    def decode(self, kv_len: int) -> torch.Tensor:
        """Logits [slots, V] for self.tokens at self.positions; keys beyond `kv_len` are not
        read (the caller guarantees every position < kv_len)."""
        if not self.use_graphs:
            return self._decode_eager(kv_len)
        entry = self._graphs.get(kv_len)
        if entry is None:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up (allocator, cuBLAS handles) off-graph
                self._decode_eager(kv_len)
            torch.cuda.current_stream().wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # thread_local: a DARTS streaming worker may launch on its own stream meanwhile
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = self._decode_eager(kv_len)
            entry = self._graphs[kv_len] = (graph, out)
        graph, out = entry
        graph.replay()
        return out


def _qk_norm(att, name: str):
    """The attention's q/k norm module, or None where Megatron put an IdentityOp."""
    from megatron.core.transformer.identity_op import IdentityOp

    mod = getattr(att, name, None)
    return None if mod is None or isinstance(mod, IdentityOp) else mod


# -- the fused decode blocks (pure functions of tensors: one torch.compile serves all layers) ----
def _rope_half(x, cos, sin):
    """x [..., n, d] with cos/sin [..., 1, rot]: Megatron's non-interleaved (rotate-half) RoPE
    on the first `rot` channels."""
    rot = cos.shape[-1]
    t, rest = x[..., :rot], x[..., rot:]
    t1, t2 = t.chunk(2, dim=-1)
    t = t * cos + torch.cat((-t2, t1), dim=-1) * sin
    return torch.cat((t, rest), dim=-1) if rest.shape[-1] else t


def qkv_block(x, ln_w, qkv_w, qkv_b, qn_w, kn_w, cos, sin, eps: float, groups: int, per: int):
    """[B, H] -> q [B, groups*per, d], k/v [B, groups, d]: input RMSNorm, the (column-parallel)
    QKV projection in Megatron's per-group [q x per, k, v] layout, q/k RMSNorm, RoPE."""
    qkv = F.linear(rms_norm_reference(x, ln_w, eps), qkv_w, qkv_b)
    B = x.shape[0]
    qkv = qkv.view(B, groups, per + 2, -1)
    q = qkv[:, :, :per].reshape(B, groups * per, -1)
    k, v = qkv[:, :, per], qkv[:, :, per + 1]
    if qn_w is not None:
        q, k = rms_norm_reference(q, qn_w, eps), rms_norm_reference(k, kn_w, eps)
    return _rope_half(q, cos, sin), _rope_half(k, cos, sin), v.contiguous()


def qkv_raw_block(x, ln_w, qkv_w, qkv_b, eps: float, groups: int, per: int):
    """`qkv_block` up to its GEMM: [B, H] -> the projection rows [B, groups, per + 2, d] (q x
    per, k, v per group), for the attention kernel's prologue (decode_attention.Prologue)."""
    qkv = F.linear(rms_norm_reference(x, ln_w, eps), qkv_w, qkv_b)
    return qkv.view(x.shape[0], groups, per + 2, -1)


def mlp_in_block(x, attn_out, ln_w, fc1_w, eps: float):
    """Residual add of the attention output, pre-MLP RMSNorm, fc1 and SwiGLU -> (x, act)."""
    x = x + attn_out
    gate, up = F.linear(rms_norm_reference(x, ln_w, eps), fc1_w).chunk(2, dim=-1)
    return x, F.silu(gate) * up
