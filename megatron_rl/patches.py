"""Every shim of a dependency, in one place: Megatron-Core on CPU (gloo).

Megatron-Core assumes CUDA in about ten places. On a machine without a GPU `apply_patches()`
redirects each of them to the CPU, without editing Megatron's files; none of those is applied
when CUDA is available. Six shims apply on GPU too: 10 covers a missing Transformer-Engine,
12 removes a copy that does nothing, 13 applies packed (THD) RoPE in one pass (numbers
unchanged), 15 compiles RoPE on CUDA tensors, 16 routes SwiGLU to a Triton kernel when
models/kernel_backend.py asks for it and 17 skips a compiled call that has nothing to do; 14 applies on GPU only (the grad norm without a host sync per tensor). Each patch names the Megatron function
or module it covers; all were
written for megatron-core 0.16.1 (`PINNED_MEGATRON_VERSION`), and `check_patch_targets()` (run by
the tests) fails loudly when a version bump moves or removes a target. Why over 450 lines: every
shim stays in this one file, so that the numbered list below, the version pin and
`check_patch_targets()` cover all of them.

The list (docs/design.md, "Megatron-Core on CPU"):
  1. torch.cuda.current_device / set_device / device_count -> the CPU device
  2. the CUDA RNG tracker -> the CPU default generator
  3. torch.cuda.synchronize -> no-op
  4. transformer.utils.get_default_causal_mask (+ its import in fusions.fused_softmax) -> CPU
  5. inert torch.cuda.Stream / Event / current_stream / default_stream / stream()
  6. modules with literal device="cuda" -> tensor creation redirected to CPU, scoped per module
  7. moe_utils.maybe_move_tensor_to_cpu -> also numpy-convert CPU split sizes (alltoall)
  8. Tensor.cuda() / Module.cuda() -> no-ops
  9. no-argument Tensor.type() reports torch.cuda.*Tensor (optimizer type checks)
 10. MoE without Transformer-Engine: moe_utils.te_general_gemm = None (on GPU too)
 11. sequence-parallel local norm: handled where the norm is built (models/), not here.
 12. token_dispatcher.sort_chunks_by_idxs with the identity order -> its inputs (on GPU too)
 13. rope_utils._apply_rotary_pos_emb_thd without context parallelism -> one pass over the packed
     rows, cos/sin built once per forward (on GPU too)
 14. without TE / apex, megatron's local multi-tensor l2 norm and scale -> torch's foreach
     kernels (GPU only: the local norm syncs the host once per parameter tensor)
 15. rope_utils._apply_rotary_pos_emb_bshd (and 13's rotation) on CUDA tensors -> one compiled
     pass (CPU tensors: Megatron's eager code); cos / sin built once per forward, not per call.
     With models/kernel_backend.py's "triton" backend: models/rope_triton.py.
 16. transformer.mlp.bias_swiglu_impl with models/kernel_backend.py's "triton" backend (CUDA
     tensors, no bias, no FP8 input store, no activation offloading) -> models/swiglu_triton.py;
     otherwise Megatron's function
 17. moe.router.TopKRouter._apply_expert_bias -> returns at once when the router has no expert
     bias (on GPU too): Megatron calls this torch.compile'd function in every router forward,
     and without expert bias it does nothing; on CPU its compile imported Inductor and ran a
     Dynamo trace in every MoE process, on GPU each call still costs a guard check
"""

from __future__ import annotations

import functools
import importlib
import types

import torch

PINNED_MEGATRON_VERSION = "0.16.1"

# Modules that create tensors with a literal device="cuda" or torch.cuda.current_device().
# Their module-level `torch` name is replaced by a proxy that maps CUDA devices to the CPU.
_CUDA_LITERAL_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.tensor_parallel.data",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.rerun_state_machine",
    "megatron.core.utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.module",
    "megatron.core.parallel_state",
    "megatron.core.inference.contexts.static_context",
    "megatron.core.inference.text_generation_controllers.text_generation_controller",
)

_FACTORIES = (
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "rand",
    "randn",
    "randint",
    "randperm",
    "eye",
    "linspace",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "rand_like",
    "randn_like",
    "empty_strided",
)

_applied = False


def _to_cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _cpu_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    return wrapper


class _CpuTorchProxy(types.ModuleType):
    """Stands in for `torch` inside one Megatron module: factories never see a CUDA device."""

    def __init__(self):
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def device(*args, **kwargs):
        if args and isinstance(args[0], str) and args[0].startswith("cuda"):
            return torch.device("cpu")
        return torch.device(*args, **kwargs)


class _InertStream:
    """torch.cuda.Stream / Event stand-in: every method is a no-op (CPU work is synchronous)."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        # record_event() etc. return another inert object so chained calls keep working.
        return lambda *a, **k: _InertStream()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _NullContext:
    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    # 1. current_device & friends -> CPU (rotary, TP layers, p2p and inference buffers).
    cuda.current_device = lambda: torch.device("cpu")
    cuda.set_device = lambda *a, **k: None
    cuda.device_count = lambda: 0
    # 2. RNG: torch.cuda.{get,set}_rng_state / manual_seed -> the CPU default generator.
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = cuda.manual_seed
    # 3. synchronize -> no-op (pipeline p2p, checkpoint save).
    cuda.synchronize = lambda *a, **k: None
    # 5. streams and events are inert (alltoall dispatcher, DDP grad sync, static inference).
    cuda.Stream = _InertStream
    cuda.Event = _InertStream
    cuda.current_stream = lambda *a, **k: _InertStream()
    cuda.default_stream = lambda *a, **k: _InertStream()
    cuda.stream = _NullContext
    cuda.nvtx.range_push = lambda *a, **k: None
    cuda.nvtx.range_pop = lambda *a, **k: None
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.empty_cache = lambda: None


def _patch_tensor_methods() -> None:
    # 8. Tensor.cuda() / Module.cuda() are no-ops (static inference, optimizer state).
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self

    # 9. Megatron's optimizers check `param.type()` against torch.cuda.*Tensor names.
    original_type = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original_type(self)
            return name.replace("torch.", "torch.cuda.", 1) if "cuda" not in name else name
        if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
            dtype = dtype.replace("torch.cuda.", "torch.", 1)
        return original_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_


class _DropMessage:
    def __init__(self, text: str):
        self.text = text

    def filter(self, record) -> bool:
        return self.text not in record.getMessage()


def _patch_megatron() -> None:
    import logging

    from megatron.core.tensor_parallel import random as mrandom

    # 2. Megatron's own RNG helpers (tensor_parallel.random._get/_set_cuda_rng_state).
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # With the "CUDA" RNG aliased to the CPU generator, CudaRNGStatesTracker.fork's check that the
    # CPU state is untouched inside the fork is expected to trip; the fork itself stays correct.
    logging.getLogger(mrandom.__name__).addFilter(
        _DropMessage("CPU RNG state changed within GPU RNG context")
    )

    # 4. get_default_causal_mask allocates on "cuda"; fused_softmax imported it by name.
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    @functools.lru_cache
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    tutils.get_default_causal_mask = get_default_causal_mask
    fused_softmax.get_default_causal_mask = get_default_causal_mask

    # 6. Literal device="cuda" in these modules -> CPU, scoped to each module.
    proxy = _CpuTorchProxy()
    for name in _CUDA_LITERAL_MODULES:
        mod = importlib.import_module(name)
        if getattr(mod, "torch", None) is torch:
            mod.torch = proxy

    # 7. MoE alltoall split sizes must be python lists/numpy on CPU (moe_utils and the
    # token dispatcher imported it by name).
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original_move = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        out = original_move(tensor, as_numpy=as_numpy, record_stream=record_stream)
        if as_numpy and isinstance(out, torch.Tensor):
            out = out.numpy()
        return out

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu



def _patch_missing_te() -> None:
    """10. megatron-core 0.16.x MoE without Transformer-Engine (CPU *and* GPU without TE).

    `moe_utils.RouterGatingLinearFunction.forward` reads the module global `te_general_gemm`,
    which 0.16.1 only defines when TE imports, so the MoE router raises NameError without TE.
    """
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_identity_chunk_sort() -> None:
    """12. megatron-core 0.16.x alltoall dispatcher at EP x TP = 1 with several local experts.

    `dispatch_postprocess` / `combine_preprocess` reorder the expert chunks from (rank, expert)
    to (expert, rank) order with `sort_chunks_by_idxs` (split into E chunks + cat), also when
    there is a single rank, where the order is the identity: a full copy of every routed token
    (top-k x tokens x hidden) per layer, in each direction and again in backward. With the
    identity order the inputs are returned as they are (same values, no copy). The fused (TE)
    path and every other order run Megatron's function.
    """
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.sort_chunks_by_idxs
    if getattr(original, "_megatron_rl_identity_skip", False):
        return

    @functools.wraps(original)
    def sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs=None, fused=False):
        if not fused and sorted_idxs.device.type == "cpu" and torch.equal(
            sorted_idxs, torch.arange(sorted_idxs.numel(), dtype=sorted_idxs.dtype)
        ):
            return input, probs
        return original(input, split_sizes, sorted_idxs, probs=probs, fused=fused)

    sort_chunks_by_idxs._megatron_rl_identity_skip = True
    token_dispatcher.sort_chunks_by_idxs = sort_chunks_by_idxs


def _patch_thd_rope() -> None:
    """13. megatron-core 0.16.x RoPE on packed (THD) rows without Transformer-Engine.

    `_apply_rotary_pos_emb_thd` reads the sequence lengths to the host (`.tolist()`, a device
    sync), splits the rows per sequence, slices and concatenates the frequencies per sequence and
    takes cos / sin of them: for q and k in every layer, and the split / cat again in backward
    (the packed actor step spent more in these small kernels than in its matmuls). Without
    context parallelism the per-row frequencies are `freqs[position in its sequence]`: one
    gather from `cu_seqlens` on the device (no sync), and cos / sin of it are built once per
    (cu_seqlens, freqs) pair -- every layer of a forward passes the same two tensors -- then one
    rotation of the whole row. The same operations on the same values as Megatron's (equal
    bits: tests/unit/test_patches.py). Context parallelism and multi-latent attention run
    Megatron's function.
    """
    from megatron.core.models.common.embeddings import rope_utils

    original = rope_utils._apply_rotary_pos_emb_thd
    if getattr(original, "_megatron_rl_one_pass", False):
        return
    last: list = []  # [key, (cos, sin)] of the last call (a forward's layers share the key)

    def cos_sin(cu_seqlens, freqs, rows: int, mscale: float, dtype):
        key = (cu_seqlens, freqs, cu_seqlens._version, freqs._version, rows, mscale, dtype)
        if last and all(a is b or (type(a) is not torch.Tensor and a == b)
                        for a, b in zip(last[0], key)):
            return last[1]
        if freqs.size(0) == rows:  # Megatron's "exact mapping" case: row i takes freqs[i]
            packed = freqs[:rows]
        else:  # position of each row within its own sequence
            cu = cu_seqlens.long()
            starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=rows)
            packed = freqs[torch.arange(rows, device=cu.device) - starts]
        packed = packed.squeeze(1)  # [rows, 1, dim]: broadcasts over the heads of [rows, h, dim]
        value = ((torch.cos(packed) * mscale).to(dtype), (torch.sin(packed) * mscale).to(dtype))
        last[:] = [key, value]  # strong references: an identical `is` means the same tensor
        return value

    @functools.wraps(original)
    def _apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, rotary_interleaved=False,
                                  multi_latent_attention=False, mscale=1.0, cp_group=None):
        if cp_group is None or cp_group.size() > 1 or multi_latent_attention:
            return original(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                            multi_latent_attention=multi_latent_attention, mscale=mscale,
                            cp_group=cp_group)
        cos, sin = cos_sin(cu_seqlens, freqs, int(t.shape[0]), mscale, t.dtype)
        if rotary_interleaved:
            rot = freqs.shape[-1]
            x, rest = t[..., :rot], t[..., rot:]
            x = (x * cos) + (rope_utils._rotate_half(x, rotary_interleaved) * sin)
            return torch.cat((x, rest), dim=-1)
        return _rope_fn(t)(t, cos, sin)  # (shim 15: compiled on CUDA)

    _apply_rotary_pos_emb_thd._megatron_rl_one_pass = True
    rope_utils._apply_rotary_pos_emb_thd = _apply_rotary_pos_emb_thd


def _foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """amp_C.multi_tensor_l2norm's contract (total norm as a [1] fp32 device tensor, None) from
    torch's foreach norm: no host round trip. Megatron's local version builds a host tensor
    of the per-tensor norms (one sync per parameter tensor) and copies the total back."""
    norms = [n for tl in tensor_lists if tl for n in torch._foreach_norm(tl)]
    if not norms:
        return torch.zeros(1, dtype=torch.float32, device=torch.cuda.current_device()), None
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
    return total.reshape(1), None


def _foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """amp_C.multi_tensor_scale's contract, dst = src * scale, in foreach launches: in place when
    src and dst are the same tensors (grad clipping), a plain copy at scale 1 (the fp32 main
    params back into the bf16 model params), else Megatron's own per-tensor loop (no extra
    memory)."""
    from megatron.core import utils

    src, dst = tensor_lists[0], tensor_lists[1]
    if not src:
        return
    if all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    elif scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        utils.local_multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale)


def _patch_multi_tensor_ops() -> None:
    """14. megatron-core 0.16.x without TE or apex: `megatron.core.utils.local_multi_tensor_l2_norm`
    (grad clipping's norm) and `local_multi_tensor_scale` (clipping's scale, and the copy of
    the fp32 main params into the model's bf16 params after every step), which
    `optimizer.clip_grads` and `optimizer.optimizer` bound at import, -> `_foreach_l2_norm` /
    `_foreach_scale`. The local norm converts a list of device scalars to a host tensor: one
    sync per parameter tensor (226 per optimizer step at the Qwen3-0.6B shape,
    tools/bench/sync_probe.py). Applied on GPU only; the norm equals Megatron's within fp32
    rounding (a different reduction order), the scale and copy are equal
    (tests/unit/test_patches.py)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    if getattr(clip_grads, "l2_norm_impl", None) is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _foreach_l2_norm
    for mod in (clip_grads, optimizer):
        if getattr(mod, "multi_tensor_scale_impl", None) is utils.local_multi_tensor_scale:
            mod.multi_tensor_scale_impl = _foreach_scale


def rope_rotate(t, cos, sin):
    """Non-interleaved RoPE of t [..., dim] by cos/sin [..., rot] (broadcasting), the channels
    past rot passed through: the operations of Megatron's `_apply_rotary_pos_emb_bshd` once its
    cos/sin are built (shim 15 compiles this on CUDA)."""
    rot = cos.shape[-1]
    x, rest = t[..., :rot], t[..., rot:]
    x1, x2 = torch.chunk(x, 2, dim=-1)
    x = (x * cos) + (torch.cat((-x2, x1), dim=-1) * sin)
    return torch.cat((x, rest), dim=-1)


_COMPILED_ROPE: list = []


def _rope_fn(t):
    """`rope_rotate`, compiled for CUDA tensors (one fused kernel forward and one backward
    instead of six or more passes over [s, b, heads, dim]), as is for CPU ones; with
    models/kernel_backend.py's "triton" backend, the Triton kernel (models/rope_triton.py)."""
    if not t.is_cuda:
        return rope_rotate
    if not _COMPILED_ROPE:
        _COMPILED_ROPE.append(torch.compile(rope_rotate, dynamic=True))
    from megatron_rl.models import kernel_backend

    if kernel_backend.use_triton(t):
        return _rope_triton_or_compiled
    return _COMPILED_ROPE[0]


def _rope_triton_or_compiled(t, cos, sin):
    """The Triton RoPE where the call's cos / sin layout fits it, else the compiled one."""
    from megatron_rl.models.rope_triton import rope_triton, rope_triton_fits

    if rope_triton_fits(t, cos, sin):
        return rope_triton(t, cos, sin)
    return _COMPILED_ROPE[0](t, cos, sin)


def _patch_compiled_rope() -> None:
    """15. megatron-core 0.16.x RoPE without Transformer-Engine's fused kernel (the padded
    layout's `_apply_rotary_pos_emb_bshd`, and shim 13's packed rotation): on CUDA tensors one
    compiled pass (`rope_rotate`) -- Megatron's eager code runs t * cos, the half rotation
    (chunk, neg, cat), * sin, the add and a cat with the pass-through channels as separate
    kernels over the whole q / k tensors, forward and backward, in every layer. The same
    operations; inductor keeps fp32 between them where eager rounds each to the activation
    dtype, so bf16 results can differ by an ulp (tests/unit/test_patches.py). CPU tensors,
    interleaved RoPE and multi-latent attention run Megatron's function."""
    from megatron.core.models.common.embeddings import rope_utils

    original = rope_utils._apply_rotary_pos_emb_bshd
    if getattr(original, "_megatron_rl_compiled", False):
        return

    last: list = []  # [key, (cos, sin)]: every layer's q and k rotate by the same freqs

    @functools.wraps(original)
    def _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=False,
                                   multi_latent_attention=False, mscale=1.0):
        if rotary_interleaved or multi_latent_attention or not t.is_cuda:
            return original(t, freqs, rotary_interleaved=rotary_interleaved,
                            multi_latent_attention=multi_latent_attention, mscale=mscale)
        # (inference mode in the key: tables made there cannot be saved for a later backward)
        key = (freqs, freqs._version, mscale, t.dtype, torch.is_inference_mode_enabled())
        if not (last and last[0][0] is freqs and last[0][1:] == key[1:]):
            last[:] = [key, ((torch.cos(freqs) * mscale).to(t.dtype),
                             (torch.sin(freqs) * mscale).to(t.dtype))]
        cos, sin = last[1]
        return _rope_fn(t)(t, cos, sin)

    _apply_rotary_pos_emb_bshd._megatron_rl_compiled = True
    rope_utils._apply_rotary_pos_emb_bshd = _apply_rotary_pos_emb_bshd


def _patch_triton_swiglu() -> None:
    """16. megatron-core 0.16.x `transformer.mlp.bias_swiglu_impl` (the dense MLP's fused SwiGLU,
    bound in mlp.py at import) -> the Triton SwiGLU (models/swiglu_triton.py) where
    models/kernel_backend.py picks it and the call has nothing that kernel lacks (bias, FP8
    input store, activation offloading); Megatron's compiled function otherwise. The default
    backend ("compiled") keeps Megatron's function for every call."""
    from megatron.core.transformer import mlp

    original = mlp.bias_swiglu_impl
    if getattr(original, "_megatron_rl_dispatch", False):
        return

    @functools.wraps(original)
    def bias_swiglu_impl(input, bias, fp8_input_store=False, cpu_offload_input=False):
        from megatron_rl.models import kernel_backend

        if (bias is None and not fp8_input_store and not cpu_offload_input
                and kernel_backend.use_triton(input)):
            from megatron_rl.models.swiglu_triton import swiglu_triton

            return swiglu_triton(input)
        return original(input, bias, fp8_input_store, cpu_offload_input)

    bias_swiglu_impl._megatron_rl_dispatch = True
    mlp.bias_swiglu_impl = bias_swiglu_impl


def skip_without_expert_bias(original):
    """17. `TopKRouter._apply_expert_bias` -> None at once for a router without expert bias (the
    method only adds the routed-token counts to `local_tokens_per_expert` when
    `enable_expert_bias` is on); `original` (Megatron's compiled method) otherwise."""

    @functools.wraps(original)
    def _apply_expert_bias(self, routing_map, padding_mask=None):
        if not self.enable_expert_bias:
            return None
        return original(self, routing_map, padding_mask=padding_mask)

    _apply_expert_bias._megatron_rl_skip = True
    return _apply_expert_bias


def _patch_expert_bias_skip() -> None:
    from megatron.core.transformer.moe.router import TopKRouter

    if not getattr(TopKRouter._apply_expert_bias, "_megatron_rl_skip", False):
        TopKRouter._apply_expert_bias = skip_without_expert_bias(TopKRouter._apply_expert_bias)


def apply_patches() -> bool:
    """Apply every shim once: the TE-absence fix, the identity-sort skip, the one-pass THD
    RoPE, the compiled RoPE (CUDA tensors), the SwiGLU dispatch and the expert-bias skip always, the foreach multi-tensor ops on CUDA, the CPU shims when there is no CUDA.

    Returns True if the CPU shims were applied.
    """
    global _applied
    if _applied:
        return not torch.cuda.is_available()
    _patch_missing_te()
    _patch_identity_chunk_sort()
    _patch_thd_rope()
    _patch_compiled_rope()
    _patch_triton_swiglu()
    _patch_expert_bias_skip()
    if torch.cuda.is_available():
        _patch_multi_tensor_ops()
    else:
        _patch_torch_cuda()
        _patch_tensor_methods()
        _patch_megatron()
    _applied = True
    return not torch.cuda.is_available()


def check_patch_targets() -> list[str]:
    """Names of patch targets missing from the installed megatron-core (empty list = all there).

    Tests assert this is empty, so a version bump that moves a target fails loudly instead of
    silently leaving a CUDA call in place.
    """
    missing = []
    targets = {
        "megatron.core.tensor_parallel.random": ["_get_cuda_rng_state", "_set_cuda_rng_state"],
        "megatron.core.transformer.utils": ["get_default_causal_mask"],
        "megatron.core.fusions.fused_softmax": ["get_default_causal_mask"],
        "megatron.core.transformer.moe.moe_utils": ["maybe_move_tensor_to_cpu"],
        "megatron.core.models.common.embeddings.rope_utils": ["_apply_rotary_pos_emb_thd",
                                                              "_apply_rotary_pos_emb_bshd",
                                                              "_rotate_half"],
        "megatron.core.transformer.mlp": ["bias_swiglu_impl"],
        "megatron.core.transformer.moe.router": ["TopKRouter"],
        "megatron.core.transformer.moe.token_dispatcher": [
            "maybe_move_tensor_to_cpu",
            "sort_chunks_by_idxs",
        ],
    }
    for module, attrs in targets.items():
        mod = importlib.import_module(module)
        missing += [f"{module}.{a}" for a in attrs if not hasattr(mod, a)]
    router = getattr(importlib.import_module("megatron.core.transformer.moe.router"), "TopKRouter",
                     None)
    if router is not None and not hasattr(router, "_apply_expert_bias"):  # shim 17's method
        missing.append("megatron.core.transformer.moe.router.TopKRouter._apply_expert_bias")
    for module in _CUDA_LITERAL_MODULES:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    return missing
