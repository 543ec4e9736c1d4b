"""The actor: a Megatron-Core policy with its DDP wrapper, optimizer and LR schedule.

It owns two operations on ragged batches of sequences (prompt + response token ids):

* `logprobs(seqs, response_starts)` - per-token log-probs (and entropy) of every response, no
  grad: the "old" and "reference" log-probs of an RL step;
* `train_mini_batch(seqs, response_starts, loss_fn)` - forward/backward over token-budget
  micro-batches and one optimizer step; `loss_fn` (from `megatron_rl.algo`) turns the current
  log-probs of a micro-batch into a loss already normalized by the *global* normalizer of the
  mini-batch (e.g. the number of response tokens over all micro-batches and DP ranks), so the
  result does not depend on how the mini-batch was split.

* `train_step(batch, make_loss, ...)` - the mini-batch x epoch loop of one RL step over a
  `TrainBatch`, with the global (all micro-batches, all DP ranks) normalizers of each mini-batch.

Micro-batches come from the one planner (`actor/microbatch.py`, the csrc length-bucketed
planner). They are right-padded by default: with causal attention a valid token never attends to
the padding after it, so no mask is needed and the result equals the unpadded forward. With
`packed` (trainer.micro_batch_layout=packed) each micro-batch is one THD row built by the csrc
pack kernel, attention runs per document (flex attention on `cu_seqlens`), and no padding is
computed; the padded path stays as its reference (tests compare them). Both operations run
through Megatron's `get_forward_backward_func`, so pipeline parallelism works
unchanged (log-probs then exist on the last pipeline stage only).

Megatron's schedule divides each micro-batch loss by the number of micro-batches and its DDP
averages gradients over data-parallel ranks; `train_mini_batch` multiplies the loss by both
factors so the gradient is that of the globally normalized loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from megatron_rl.actor.guards import guarded_step
from megatron_rl.actor.microbatch import plan_micro_batches
from megatron_rl.actor.output_logprobs import (
    gather_sequence,
    hidden_states_only,
    output_weight,
    rows_logprobs,
)
from megatron_rl.actor.routing_replay import pack_routes, replay
from megatron_rl.actor.stage_sync import (
    dp_sum_parts,
    equal_micro_batch_count,
    from_last_stage,
    metrics_from_last_stage,
)
from megatron_rl.config import OptimizerConfig
from megatron_rl.parallel import ParallelState

# loss_fn(sample_indices, logprobs per sample, entropy per sample) -> (loss, metrics)
LossFn = Callable[[list[int], list[torch.Tensor], list[torch.Tensor]], tuple[torch.Tensor, dict]]


@dataclass
class _MicroBatch:
    indices: list[int]
    tokens: torch.Tensor  # [b, s] right-padded, or [1, total] packed (THD)
    lengths: list[int]
    starts: list[int]
    offsets: list[int] | None = None  # packed: first row of each sample in the packed row
    positions: torch.Tensor | None = None  # packed: position of each token inside its sample
    packed_seq_params: object = None  # packed: megatron PackedSeqParams (per-document attention)
    routes: torch.Tensor | None = None  # MoE routing replay: [moe layers, tokens, k] (R3)


class Policy:
    """Megatron policy model + optimizer. Build it with `build_policy`.

    Example:
        ps = init_parallel(cfg.parallel)
        policy = build_policy(hf_config, ps, cfg.optimizer, total_optimizer_steps=100)
        old_lp, _ = policy.logprobs(seqs, starts)
        metrics = policy.train_mini_batch(seqs, starts, loss_fn)
    """

    def __init__(self, model, tcfg, ps: ParallelState, optimizer=None, scheduler=None):
        self.model = model  # DDP-wrapped GPTModel (or the bare module when frozen)
        self.tcfg = tcfg
        self.ps = ps
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.micro_batch_tokens = 8192
        self.pad_id = 0
        self.packed = False  # micro-batches as one THD row per micro-batch (trainer.micro_batch_layout)
        self.logprob_chunk_tokens = 8192  # response rows per output-layer chunk
        self.fused_logprobs: bool | None = None  # None: fused where the output layer allows

    @property
    def module(self):
        """The bare GPTModel (shared with the built-in rollout engine: same weights, no copy)."""
        return getattr(self.model, "module", self.model)

    # ----------------------------------------------------------------------------------------
    def _micro_batches(self, seqs: list[torch.Tensor], starts: list[int]) -> list[_MicroBatch]:
        lengths = [int(s.numel()) for s in seqs]
        if self.packed:
            return self._packed_micro_batches(seqs, starts, lengths)
        out = []
        for idx in plan_micro_batches(lengths, self.micro_batch_tokens, padded=True):
            width = max(lengths[i] for i in idx)
            if self.tcfg.sequence_parallel:  # (MoE at TP > 1) the sequence is split over TP
                width += -width % self.ps.tp_size
            toks = torch.full((len(idx), width), self.pad_id, dtype=torch.long)
            for row, i in enumerate(idx):
                toks[row, : lengths[i]] = seqs[i]
            out.append(
                _MicroBatch(idx, toks.to(self.ps.device), [lengths[i] for i in idx],
                            [starts[i] for i in idx])
            )
        return out

    def _plan(self, seqs: list[torch.Tensor], starts: list[int],
              routing: list[torch.Tensor] | None = None) -> list[_MicroBatch]:
        """This rank's micro-batches with the routes to replay (MoE, `routing` per sample) and,
        under expert parallelism, empty micro-batches (indices []) appended up to the most any
        data-parallel rank runs: every MoE forward is an all-to-all (actor/stage_sync.py)."""
        mbs = self._micro_batches(seqs, starts)
        if routing is not None:
            for mb in mbs:
                mb.routes = pack_routes([routing[i] for i in mb.indices], mb.lengths,
                                        width=int(mb.tokens.shape[1]), tcfg=self.tcfg, ps=self.ps,
                                        offsets=mb.offsets)
        for _ in range(equal_micro_batch_count(len(mbs), self.ps) - len(mbs)):
            mbs.append(self._empty_micro_batch())
        return mbs

    def _empty_micro_batch(self) -> _MicroBatch:
        """Two pad tokens (one "response" token), in this policy's layout; no sample reads it."""
        width = 2 + (-2 % self.ps.tp_size if self.tcfg.sequence_parallel or self.packed else 0)
        tokens = torch.full((1, width), self.pad_id, dtype=torch.long, device=self.ps.device)
        if not self.packed:
            return _MicroBatch([], tokens, [2], [1])
        from megatron_rl.ops import packed_seq_params

        cu = torch.tensor([0, width], dtype=torch.int32, device=self.ps.device)
        return _MicroBatch([], tokens, [2], [1], offsets=[0],
                           positions=torch.arange(width, device=self.ps.device).unsqueeze(0),
                           packed_seq_params=packed_seq_params(cu, width))

    def _packed_micro_batches(self, seqs, starts, lengths) -> list[_MicroBatch]:
        """One THD row per micro-batch, gathered from a flat ragged buffer of all sequences by
        the csrc pack kernel; no padding except up to a multiple of the TP size (sequence
        parallelism splits the row), as one extra document that no sample reads."""
        from megatron_rl.ops import pack, packed_layout, packed_seq_params

        flat = torch.cat(seqs)
        offs = [0]
        for n in lengths:
            offs.append(offs[-1] + n)
        tp = self.ps.tp_size
        out = []
        for idx in plan_micro_batches(lengths, self.micro_batch_tokens):
            lens = [lengths[i] for i in idx]
            layout = packed_layout(lens, idx, offsets=offs)
            tokens, cu, pos = pack(flat, layout), layout.cu_seqlens, layout.position_ids
            extra = -layout.total % tp
            if extra:
                tokens = torch.cat([tokens, tokens.new_full((extra,), self.pad_id)])
                cu = torch.cat([cu, cu.new_tensor([layout.total + extra])])
                pos = torch.cat([pos, torch.arange(extra, dtype=pos.dtype)])
            dev = self.ps.device
            cu = cu.to(dev)
            out.append(_MicroBatch(
                idx, tokens.to(dev).unsqueeze(0), lens, [starts[i] for i in idx],
                offsets=cu[:-1].tolist()[: len(idx)], positions=pos.to(dev).unsqueeze(0),
                packed_seq_params=packed_seq_params(cu, max(lens + [extra])),
            ))
        return out

    def _response_logprobs(self, hidden, mb: _MicroBatch, temperature: float, with_entropy: bool):
        """Final-norm hidden states [s(/tp), b, h] -> per-sample response log-probs (and
        entropy), views of `_flat_response_logprobs`'s rows."""
        lp, ent, spans = self._flat_response_logprobs(hidden, mb, temperature, with_entropy)
        lps = list(lp.split(spans))
        ents = list(ent.split(spans)) if ent is not None else [None] * len(spans)
        return lps, ents

    def _flat_response_logprobs(self, hidden, mb: _MicroBatch, temperature: float,
                                with_entropy: bool):
        """The micro-batch's response log-probs (and entropy) as one flat row each, sample after
        sample, with the per-sample lengths. Only the response rows reach the output layer
        (actor/output_logprobs.py): one gather of every response position, then chunked
        log-probs without [T, V] logits."""
        tp_group = self.ps.pgs.tp if self.ps.tp_size > 1 else None
        hidden = gather_sequence(self.module, hidden, tp_group)
        b = int(hidden.shape[1])
        firsts, spans = [], []
        for r, (n, p) in enumerate(zip(mb.lengths, mb.starts)):
            # [s, b] layout: token t of sample r is row t * b + r (packed: b = 1, from offsets[r])
            firsts.append(mb.offsets[r] + p - 1 if mb.offsets is not None else (p - 1) * b + r)
            spans.append(n - p)
        # host index arithmetic in numpy: torch's CPU repeat_interleave took ~5 ms a call on
        # the H200 host (its intra-op thread pool), more than the rest of the indexing
        span = np.asarray(spans, dtype=np.int64)
        step = np.arange(int(span.sum()), dtype=np.int64) - np.repeat(np.cumsum(span) - span, span)
        pos = torch.from_numpy(np.repeat(np.asarray(firsts, dtype=np.int64), span) + step * b)
        pos = pos.to(hidden.device, non_blocking=True)
        rows = hidden.flatten(0, 1).index_select(0, pos)
        targets = mb.tokens.t().reshape(-1).index_select(0, pos + b)
        lp, ent = rows_logprobs(self.module, rows, targets, temperature=temperature,
                                tp_group=tp_group, with_entropy=with_entropy,
                                chunk_tokens=self.logprob_chunk_tokens, fused=self.fused_logprobs)
        return lp, ent, spans

    def _run(self, mbs: list[_MicroBatch], forward_only: bool, loss_closure):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        it = iter(mbs)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            # R3: the engine's experts (None: the router's); the last stage stops at the final
            # norm and the loss closure applies the output layer to the response rows only
            last = self.module.post_process
            with replay(self.module, mb.routes), \
                    (hidden_states_only(self.module) if last else nullcontext()):
                if mb.packed_seq_params is not None:
                    out = model(mb.tokens, mb.positions, None,
                                packed_seq_params=mb.packed_seq_params)
                    return out, lambda hidden: loss_closure(mb, hidden)
                b, s = mb.tokens.shape
                pos = torch.arange(s, device=mb.tokens.device).unsqueeze(0).expand(b, s)
                out = model(mb.tokens, pos, None)
            return out, lambda hidden: loss_closure(mb, hidden)

        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=it,
            model=[self.model],
            num_microbatches=len(mbs),
            seq_length=max(int(m.tokens.shape[1]) for m in mbs),
            micro_batch_size=max(int(m.tokens.shape[0]) for m in mbs),
            forward_only=forward_only,
        )

    # ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def logprobs(
        self, seqs: list[torch.Tensor], starts: list[int], temperature: float = 1.0,
        with_entropy: bool = False, routing: list[torch.Tensor] | None = None,
        non_blocking: bool = False,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Response log-probs per sample ([len_i - start_i] fp32, on CPU), on every pipeline
        stage (broadcast from the last). routing: per-sample routed experts to replay (MoE R3,
        actor/routing_replay.py), None to route afresh. non_blocking: leave the results on the
        device, with no host sync (DARTS streaming launches these forwards on a second CUDA
        stream between decode steps and syncs later, rollout/streaming.py)."""
        self.model.eval()
        mbs = self._plan(seqs, starts, routing)
        lps: list = [None] * len(seqs)
        ents: list = [None] * len(seqs)

        def closure(mb, hidden):
            lp, ent, spans = self._flat_response_logprobs(hidden, mb, temperature, with_entropy)
            # one device-to-host copy (and sync) per micro-batch, not one per sample; on the host
            # each sample gets its own storage (a saved view would carry the whole micro-batch)
            own = (lambda t: t) if non_blocking else (lambda t: t.clone())
            if not non_blocking:
                lp, ent = lp.cpu(), (None if ent is None else ent.cpu())
            for i, a, h in zip(mb.indices, lp.split(spans),
                               ent.split(spans) if ent is not None else [None] * len(spans)):
                lps[i], ents[i] = own(a), (None if h is None else own(h))
            return hidden.new_zeros(()), {}

        self._run(mbs, forward_only=True, loss_closure=closure)
        sizes = [int(s.numel()) - p for s, p in zip(seqs, starts)]
        lps = from_last_stage(lps, sizes, self.ps)
        return lps, (from_last_stage(ents, sizes, self.ps) if with_entropy else None)

    def train_mini_batch(
        self, seqs: list[torch.Tensor], starts: list[int], loss_fn: LossFn,
        temperature: float = 1.0, with_entropy: bool = False,
        routing: list[torch.Tensor] | None = None,
    ) -> dict:
        """One optimizer step over a mini-batch. Returns this rank's summed metric parts (the
        last pipeline stage's, on every stage) + grad_norm, lr. routing: as in `logprobs`."""
        assert self.optimizer is not None, "frozen policy (no optimizer) cannot train"
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        mbs = self._plan(seqs, starts, routing)
        scale = len(mbs) * self.ps.dp_size  # undo Megatron's 1/num_microbatches and DP average

        def closure(mb, hidden):
            if not mb.indices:  # an empty micro-batch (expert parallel count padding)
                # (the output weight too: every parameter takes part in every backward)
                return (hidden.sum() + output_weight(self.module).sum()) * 0.0, {}
            lp, ent = self._response_logprobs(hidden, mb, temperature, with_entropy)
            loss, metrics = loss_fn(mb.indices, lp, ent)
            metrics = {k: torch.as_tensor(v, dtype=torch.float32).detach() for k, v in metrics.items()}
            return loss * scale, metrics

        outputs = self._run(mbs, forward_only=False, loss_closure=closure)
        update_ok, grad_norm = guarded_step(self.optimizer, outputs)  # skips a non-finite update
        if self.scheduler is not None and update_ok:
            self.scheduler.step(increment=1)
        metrics: dict[str, float] = {}
        for out in outputs or []:  # sum over micro-batches (loss_fn reports additive parts)
            for k, v in out.items():
                metrics[k] = metrics.get(k, 0.0) + float(v)
        metrics = metrics_from_last_stage(metrics, self.ps)
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else math.nan
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["update_skipped"] = float(not update_ok)
        return metrics

    def train_step(self, batch, make_loss: Callable, *, mini_batches: int, epochs: int,
                   temperature: float) -> dict:
        """`epochs` passes of `mini_batches` optimizer steps over one rollout's TrainBatch.
        make_loss(mini_batch, global_num_tokens, global_num_seqs) -> LossFn. Returns the metrics
        averaged over the optimizer steps taken, the loss parts summed over the data-parallel
        ranks (the global mini-batch values, the same on every rank). MoE: the batch's
        `routed_experts` are replayed when present (R3)."""
        totals: dict[str, float] = {}
        steps = 0
        for _ in range(epochs):
            for mb in batch.mini_batches(mini_batches):
                n_tok = self.dp_sum(float(mb.num_loss_tokens()))
                n_seq = self.dp_sum(float(len(mb)))
                m = self.train_mini_batch(
                    [mb.input_ids(i) for i in range(len(mb))], [len(p) for p in mb.prompt_ids],
                    make_loss(mb, n_tok, n_seq), temperature=temperature, with_entropy=True,
                    routing=getattr(mb, "routed_experts", None),
                )
                for k, v in m.items():
                    totals[k] = totals.get(k, 0.0) + v
                steps += 1
        return dp_sum_parts({k: v / steps for k, v in totals.items()}, self.ps)

    def dp_sum(self, x: float) -> float:
        """Sum of a host number over the data-parallel ranks (on the group's device)."""
        if self.ps.dp_size == 1:
            return x
        import torch.distributed as dist

        t = torch.tensor([x], dtype=torch.float64, device=self.ps.device)
        dist.all_reduce(t, group=self.ps.pgs.dp)
        return float(t)


def enable_fused_adam(optimizer) -> int:
    """Switch torch's Adam/AdamW -- megatron-core's optimizer when neither Transformer-Engine
    nor apex is importable -- to torch's fused CUDA kernel (one launch per step instead of
    foreach passes). Only where every parameter is on CUDA; returns how many were switched."""
    switched = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        params = [p for g in inner.param_groups for p in g["params"]]
        if not params or not all(p.is_cuda for p in params):
            continue
        inner.defaults.update(fused=True, foreach=False)
        for group in inner.param_groups:
            group.update(fused=True, foreach=False)
        switched += 1
    return switched


def build_optimizer(model, tcfg, ocfg: OptimizerConfig, total_optimizer_steps: int, ps):
    """Megatron's optimizer (distributed optimizer on request) and its LR/WD scheduler."""
    from megatron.core.optimizer import OptimizerConfig as MOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    bf16 = tcfg.params_dtype == torch.bfloat16
    mcfg = MOptimizerConfig(
        optimizer="adam",
        lr=ocfg.lr,
        min_lr=ocfg.min_lr,
        weight_decay=ocfg.weight_decay,
        adam_beta1=ocfg.adam_beta1,
        adam_beta2=ocfg.adam_beta2,
        adam_eps=ocfg.adam_eps,
        clip_grad=ocfg.clip_grad,
        bf16=bf16,
        params_dtype=tcfg.params_dtype,
        use_distributed_optimizer=ocfg.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(mcfg, [model], pg_collection=ps.pgs,
                                       use_gloo_process_groups=False)
    enable_fused_adam(optimizer)
    total = max(1, total_optimizer_steps)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if ocfg.lr_warmup_steps > 0 else ocfg.lr,
        max_lr=ocfg.lr,
        min_lr=ocfg.min_lr,
        lr_warmup_steps=ocfg.lr_warmup_steps,
        lr_decay_steps=max(total, ocfg.lr_warmup_steps + 1),
        lr_decay_style=ocfg.lr_decay_style,
        start_wd=ocfg.weight_decay,
        end_wd=ocfg.weight_decay,
        wd_incr_steps=total,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def wrap_ddp(module, tcfg, ps: ParallelState, use_distributed_optimizer: bool):
    """Megatron DDP around a GPTModel, with the config hooks its schedule expects."""
    from functools import partial

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    ddp = DistributedDataParallel(
        config=tcfg,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=use_distributed_optimizer,
        ),
        module=module,
        pg_collection=ps.pgs,
    )
    tcfg.finalize_model_grads_func = partial(finalize_model_grads, pg_collection=ps.pgs)
    tcfg.no_sync_func = ddp.no_sync
    return ddp


def build_policy(
    module, tcfg, ps: ParallelState, ocfg: OptimizerConfig | None, total_optimizer_steps: int = 1,
    micro_batch_tokens: int = 8192, pad_id: int = 0, packed: bool = False,
) -> Policy:
    """Wrap a built GPTModel into a trainable Policy (ocfg=None: a frozen reference policy).
    packed: micro-batches as THD rows (the model must run flex or TE attention)."""
    tcfg.variable_seq_lengths = True  # micro-batches differ in shape (pipeline p2p needs this)
    if ocfg is None:
        for p in module.parameters():
            p.requires_grad_(False)
        policy = Policy(module, tcfg, ps)
    else:
        ddp = wrap_ddp(module, tcfg, ps, ocfg.use_distributed_optimizer)
        optimizer, scheduler = build_optimizer(ddp, tcfg, ocfg, total_optimizer_steps, ps)
        tcfg.grad_scale_func = optimizer.scale_loss
        policy = Policy(ddp, tcfg, ps, optimizer, scheduler)
    policy.micro_batch_tokens = micro_batch_tokens
    policy.pad_id = pad_id
    policy.packed = packed
    return policy
