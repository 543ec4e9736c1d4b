"""Forward-only logits of a (TP/PP/EP-split) GPTModel, gathered on every rank.

For parity checks, conversion tools and tests -- not the training path (the actor uses
Megatron's pipeline schedules and vocab-parallel losses). Pipeline stages pass hidden states
with plain send/recv on the PP group; the last stage gathers the vocab-split logits over TP and
broadcasts the full [b, s, vocab] fp32 logits to every rank of the PP group.

    logits = forward_logits(model, ps, input_ids, position_ids, attention_mask)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.parallel import ParallelState


def padding_attention_mask(lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[b] lengths of right-padded rows -> Megatron mask [b, 1, s, s] (True = masked out):
    causal, and no query attends to a padding key."""
    keys = torch.arange(seq_len, device=lengths.device)
    pad_key = keys.view(1, 1, 1, -1) >= lengths.view(-1, 1, 1, 1)
    future = keys.view(1, 1, -1, 1) < keys.view(1, 1, 1, -1)
    return pad_key | future


@torch.no_grad()
def forward_logits(
    model,
    ps: ParallelState,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    packed_seq_params=None,
) -> torch.Tensor:
    """Full-vocabulary logits [b, s, V] (fp32) on every rank; the model is run in eval mode."""
    model.eval()
    b, s = input_ids.shape
    device = ps.device
    input_ids = input_ids.to(device)
    if position_ids is None:
        position_ids = torch.arange(s, device=device).expand(b, s)
    position_ids = position_ids.to(device)
    if attention_mask is not None:
        attention_mask = attention_mask.to(device)
    cfg = model.config
    pp = ps.pgs.pp
    if ps.pp_size > 1 and not ps.is_first_stage:
        s_local = s // ps.tp_size if cfg.sequence_parallel else s
        hidden = torch.empty(s_local, b, cfg.hidden_size, dtype=cfg.params_dtype, device=device)
        dist.recv(hidden, src=dist.get_global_rank(pp, ps.pp_rank - 1), group=pp)
        model.set_input_tensor(hidden)
    out = model(input_ids, position_ids, attention_mask, packed_seq_params=packed_seq_params)
    if not ps.is_last_stage:
        dist.send(out.contiguous(), dst=dist.get_global_rank(pp, ps.pp_rank + 1), group=pp)
        logits = None
    else:
        logits = out.float()  # [b, s, V/tp]
        if ps.tp_size > 1 and getattr(model, "parallel_output", True):
            parts = [torch.empty_like(logits) for _ in range(ps.tp_size)]
            dist.all_gather(parts, logits.contiguous(), group=ps.pgs.tp)
            logits = torch.cat(parts, dim=-1)
    if ps.pp_size > 1:
        vocab = model.vocab_size
        if logits is None:
            logits = torch.empty(b, s, vocab, dtype=torch.float32, device=device)
        src = dist.get_global_rank(pp, ps.pp_size - 1)
        dist.broadcast(logits, src=src, group=pp)
    return logits
