"""The built-in rollout engine: batched generation on the actor's own Megatron weights.

No copy and no weight sync: the engine holds a reference to the policy's GPTModel, so every
optimizer step is visible to the next `generate`. Generation is tensor-parallel aware (the
vocabulary-parallel logits are gathered, one TP rank samples and broadcasts the tokens) and
uses Megatron's static KV cache (`StaticInferenceContext`):

* prompts are left-padded to a common length; padded key positions are masked out and, since
  RoPE scores depend only on the distance between query and key, a left-padded sample sees
  exactly the logits it would see alone;
* one prefill forward, then one decode forward per new token over the whole batch;
* sampling: temperature, top-k, top-p; stop token ids and stop strings; `max_new_tokens`;
* the per-token log-prob of each sampled token is that of the temperature-scaled policy
  (before top-k/top-p truncation), which is what the actor recomputes as pi_old.

Requests beyond `max_batch_size` run in successive waves. Pipeline parallelism is not
supported by this engine (a clear error); use the SGLang engine for PP > 1.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch
import torch.distributed as dist

from megatron_rl.parallel import ParallelState
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.types import Sample


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / top-p (nucleus) set to -inf. logits: [B, V] fp32."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p
        drop = probs.cumsum(-1) - probs >= top_p
        drop[..., 0] = False
        mask = torch.zeros_like(drop).scatter(-1, idx, drop)
        logits = logits.masked_fill(mask, float("-inf"))
    return logits


class LocalEngine:
    """Generate on the policy's own weights.

    Example:
        engine = LocalEngine(policy.module, ps, pad_id=tok.pad_token_id, tokenizer=tok)
        samples = engine.generate([[1, 2, 3]], n=4, sampling=SamplingParams(max_new_tokens=16))
    """

    def __init__(
        self,
        module,
        ps: ParallelState,
        *,
        pad_id: int,
        max_batch_size: int = 256,
        tokenizer=None,
        seed: int = 0,
    ):
        if ps.pp_size > 1:
            raise ValueError(
                "config field `rollout.engine`: the built-in engine does not support pipeline "
                "parallelism (parallel.pipeline_model_parallel_size > 1); use rollout.engine=sglang"
            )
        self.module = module
        self.ps = ps
        self.pad_id = pad_id
        self.max_batch_size = max_batch_size
        self.tokenizer = tokenizer
        self.generator = torch.Generator(device=ps.device).manual_seed(seed)
        self._ids = itertools.count()
        self._aborted: set[str] = set()
        self.policy_version = 0

    # -- protocol --------------------------------------------------------------------------
    def abort(self, sample_ids: Iterable[str]) -> None:
        self._aborted.update(sample_ids)

    def sleep(self) -> None:  # the static KV cache lives only inside `generate`
        pass

    def wake(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[Sample]:
        if sampling.seed is not None:
            self.generator.manual_seed(sampling.seed)
        requests = [p for p in prompts for _ in range(n)]
        out: list[Sample] = []
        was_training = self.module.training
        self.module.eval()
        try:
            for s in range(0, len(requests), self.max_batch_size):
                out += self._generate_wave(requests[s : s + self.max_batch_size], sampling)
        finally:
            self.module.train(was_training)
        self._aborted.clear()
        return out

    # -- internals -------------------------------------------------------------------------
    def _tp_group(self):
        return self.ps.pgs.tp if self.ps.tp_size > 1 else None

    def _sample(self, logits_bv: torch.Tensor, sp: SamplingParams):
        """logits [B, V] (Megatron gathers TP shards in inference) -> (tokens [B], logprobs [B]),
        identical on every TP rank."""
        full = logits_bv.float()
        if sp.temperature > 0:
            scaled = full / sp.temperature
            logp = torch.log_softmax(scaled, -1)
            probs = filter_logits(scaled, sp.top_k, sp.top_p).softmax(-1)
            tokens = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
        else:
            logp = torch.log_softmax(full, -1)
            tokens = full.argmax(-1)
        lp = logp.gather(-1, tokens[:, None]).squeeze(-1)
        group = self._tp_group()
        if group is not None:  # one sampler per TP group: broadcast rank 0's draw
            src = dist.get_global_rank(group, 0)
            dist.broadcast(tokens, src, group=group)
            dist.broadcast(lp, src, group=group)
        return tokens, lp

    def _hit_stop_string(self, response: list[int], stops: list[str]) -> bool:
        if not stops:
            return False
        if self.tokenizer is None:
            raise ValueError("SamplingParams.stop strings need the engine's tokenizer")
        text = self.tokenizer.decode(response)
        return any(s in text for s in stops)

    def _generate_wave(self, prompts: list[list[int]], sp: SamplingParams) -> list[Sample]:
        from megatron.core.inference.contexts import StaticInferenceContext

        dev = self.ps.device
        B = len(prompts)
        P = max(len(p) for p in prompts)
        if P == 0:
            raise ValueError("empty prompt given to the rollout engine")
        total = P + sp.max_new_tokens
        tokens = torch.full((B, total), self.pad_id, dtype=torch.long, device=dev)
        valid = torch.zeros(B, total, dtype=torch.bool, device=dev)
        for i, p in enumerate(prompts):
            tokens[i, P - len(p) : P] = torch.tensor(p, dtype=torch.long)
            valid[i, P - len(p) : P] = True
        valid[:, P:] = True
        ctx = StaticInferenceContext(B, total)
        positions = torch.arange(total, device=dev).unsqueeze(0).expand(B, total)

        # Prefill: causal over the prompt slots, pad keys masked (True = masked out). A pad
        # query keeps its own diagonal so no softmax row is empty.
        causal = torch.ones(P, P, dtype=torch.bool, device=dev).triu(1)
        mask = causal[None] | ~valid[:, None, :P]
        mask &= ~torch.eye(P, dtype=torch.bool, device=dev)[None]
        logits = self.module(tokens[:, :P], positions[:, :P], mask[:, None], inference_context=ctx,
                             runtime_gather_output=True)
        ctx.increment_sequence_len_offset(P)

        responses: list[list[int]] = [[] for _ in range(B)]
        logprobs: list[list[float]] = [[] for _ in range(B)]
        reasons = ["length"] * B
        done = torch.zeros(B, dtype=torch.bool)
        stop_ids = torch.tensor(sorted(set(sp.stop_token_ids)) or [-1], device=dev)
        ids = [f"s{next(self._ids)}" for _ in range(B)]
        for t in range(sp.max_new_tokens):
            nxt, lp = self._sample(logits[:, -1, :], sp)
            nxt_cpu, lp_cpu = nxt.cpu(), lp.cpu()
            is_stop = torch.isin(nxt, stop_ids).cpu()
            for i in range(B):
                if done[i]:
                    continue
                responses[i].append(int(nxt_cpu[i]))
                logprobs[i].append(float(lp_cpu[i]))
                if is_stop[i] or self._hit_stop_string(responses[i], sp.stop):
                    done[i], reasons[i] = True, "stop"
                elif ids[i] in self._aborted:
                    done[i], reasons[i] = True, "abort"
            if bool(done.all()) or t == sp.max_new_tokens - 1:
                break
            cur = P + t
            tokens[:, cur] = torch.where(done.to(dev), self.pad_id, nxt)
            step_mask = ~valid[:, None, None, : cur + 1]
            logits = self.module(
                tokens[:, cur : cur + 1], positions[:, cur : cur + 1], step_mask,
                inference_context=ctx, runtime_gather_output=True,
            )
            ctx.increment_sequence_len_offset(1)
        return [
            Sample(
                prompt_ids=list(p),
                response_ids=r,
                response_logprobs=torch.tensor(lp, dtype=torch.float32) if sp.logprobs else None,
                finish_reason=fr,
                sample_id=sid,
                policy_version=self.policy_version,
            )
            for p, r, lp, fr, sid in zip(prompts, responses, logprobs, reasons, ids)
        ]
