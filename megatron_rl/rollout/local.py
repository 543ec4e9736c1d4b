"""The built-in rollout engine: batched generation on the actor's own Megatron weights.

No copy and no weight sync: the engine holds a reference to the policy's GPTModel, so every
optimizer step is visible to the next `generate`. Generation is tensor-parallel aware (the
vocabulary-parallel logits are gathered, one TP rank samples and broadcasts the tokens).

Two decoders behind the same `generate`:

* `decoder="lean"` (the default, `auto`): `rollout.decoder.LeanDecoder` -- an engine-owned
  [layers, slots, kv_heads, len, d] KV cache, a CUDA-graphed decode step on GPU, and continuous
  batching: `max_batch_size` slots decode together, a slot whose sample finished is refilled
  from the waiting requests (prefilled in length-sorted chunks) while the others go on. Once
  nothing is left to refill, stop tokens are checked one step late (no host sync per token;
  `defer_stop_check`), with the same samples as the per-step check.
* `decoder="megatron"`: the slow reference. Megatron's own forward with its static KV cache
  (`StaticInferenceContext`): prompts left-padded to a common length (RoPE scores depend only
  on query-key distance, so a left-padded sample sees exactly its own logits), one prefill, one
  full-model decode forward per token, requests beyond `max_batch_size` in successive waves.

Both sample the same way: temperature, top-k, top-p; stop token ids and stop strings;
`max_new_tokens`; the per-token log-prob of each sampled token is that of the temperature-scaled
policy (before top-k/top-p truncation), which is what the actor recomputes as pi_old.
Pipeline parallelism is not supported by this engine, nor MoE models at tensor or expert
parallel > 1 (clear errors); use an external engine (SGLang, vLLM) for those layouts. For MoE
routing replay (R3) the lean decoder records the experts each fed token was routed to
(`record_routing`, actor/routing_replay.py `EngineRoutes`).

Why one file over 450 lines: the two decoders share the sampling, stop and abort rules and the
continuous-batching bookkeeping; split apart, each half would re-state them.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.actor.routing_replay import EngineRoutes
from megatron_rl.parallel import ParallelState
from megatron_rl.rollout.decode_attention import resolve_decode_attention
from megatron_rl.rollout.decoder import LeanDecoder, length_bucket
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.exp_race import exp_race_sample, exp_race_sample_triton
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
        decoder: str = "auto",
        cuda_graphs: bool | None = None,
        prefill_tokens: int = 65536,
        record_routing: bool = False,
        decode_attention: str = "auto",
    ):
        """decoder: auto | lean | megatron (see the module docstring); cuda_graphs: None = on
        for dense models on CUDA; prefill_tokens: most (padded) prompt tokens per prefill;
        record_routing: MoE, lean decoder: every Sample carries the experts its tokens were
        routed to (`Sample.routed_experts`, for the actor's routing replay);
        decode_attention: the lean decoder's decode attention, auto | triton | torch
        (`rollout.decode_attention`, rollout/decode_attention.py)."""
        if ps.pp_size > 1:
            raise ValueError(
                "config field `rollout.engine`: the built-in engine does not support pipeline "
                f"parallelism (parallel.pipeline_model_parallel_size={ps.pp_size}); use an "
                "external engine (rollout.engine=sglang or vllm)"
            )
        if record_routing and (module.config.num_moe_experts is None or decoder == "megatron"):
            raise ValueError(
                "config field `algorithm.rollout_correction.routing_replay`: the built-in engine "
                "records routing for MoE models on its lean decoder only (decoder=auto | lean)")
        if decoder not in ("auto", "lean", "megatron"):
            raise ValueError(f"LocalEngine decoder: {decoder!r} not in auto | lean | megatron")
        if decoder == "megatron" and decode_attention != "auto":
            raise ValueError("config field `rollout.decode_attention` is the lean decoder's; "
                             "the megatron decoder runs Megatron's own attention")
        self.module = module
        self.ps = ps
        self.pad_id = pad_id
        self.max_batch_size = max_batch_size
        self.tokenizer = tokenizer
        self.generator = torch.Generator(device=ps.device).manual_seed(seed)
        self._ids = itertools.count()
        self._aborted: set[str] = set()
        self.policy_version = 0
        self.decoder_kind = "lean" if decoder == "auto" else decoder
        self.prefill_tokens = prefill_tokens
        self.keep_graphs = True
        self.defer_stop_check = True
        """Lean decoder on the Triton attention path: read each decode step's stop flags one
        step later, without a host sync per step (`_generate_continuous`); False: the per-step
        check (the reference the tests compare against)."""
        self.deferred_checks = 0  # decode steps whose stop flags were read late (tests, benches)
        self.share_prompts = True
        """Lean decoder: requests of one refill with the same prompt (a GRPO group) prefill it
        once; the others get a copy of its K/V rows, and on the Triton path read them from the
        first one's slot (`LeanDecoder.point_prefix`). False: every request prefills its own
        prompt (the reference the tests compare against)."""
        self.shared_prompts = 0  # requests whose prompt was prefilled for another one (tests)
        self.record_routing = record_routing
        self._lean = (LeanDecoder(module, ps, cuda_graphs, decode_attention=decode_attention)
                      if self.decoder_kind == "lean" else None)
        self._exp_race = None

    # -- protocol --------------------------------------------------------------------------
    def abort(self, sample_ids: Iterable[str]) -> None:
        self._aborted.update(sample_ids)

    def sleep(self) -> None:
        """Free the KV cache and CUDA graphs (the weights are the actor's and stay) -- unless
        `keep_graphs` and graphs were captured: then both stay, so the next rollout replays the
        same graphs instead of re-capturing them (the optimizer updates the weights in place, so
        the captured pointers stay valid; the cache's memory stays held during training)."""
        if self._lean is not None and not (self.keep_graphs and self._lean.has_graphs):
            self._lean.release()

    def wake(self) -> None:  # the cache is re-allocated by the next `generate`
        pass

    def push_weights(self, module, version: int) -> None:
        """The actor's weights are this engine's weights: only the version moves."""
        if module is not self.module:
            raise ValueError("LocalEngine generates on the actor's own module; got another one")
        self.policy_version = version

    def state_dict(self) -> dict:
        """The sampling RNG (saved with checkpoints, so a resumed run draws the same samples)."""
        return {"rng": self.generator.get_state().tolist()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(torch.tensor(state["rng"], dtype=torch.uint8))

    def close(self) -> None:
        self.sleep()

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[Sample]:
        return self._run([p for p in prompts for _ in range(n)], sampling)

    @torch.no_grad()
    def _run(self, requests: list[list[int]], sampling: SamplingParams, group=None, counters=None,
             listener=None, budgets=None):
        """Seed, eval mode and abort bookkeeping around one batch of requests (both decoders).
        listener / budgets: see `generate_requests` (lean decoder only)."""
        if (listener is not None or budgets is not None) and self._lean is None:
            raise ValueError("streamed generation (a rollout listener or per-request budgets, "
                             "rollout.darts.streaming / roll) needs the lean decoder")
        if sampling.seed is not None:
            self.generator.manual_seed(sampling.seed)
        if any(len(p) == 0 for p in requests):
            raise ValueError("empty prompt given to the rollout engine")
        out: list[Sample] = []
        was_training = self.module.training
        self.module.eval()
        try:
            if self._lean is not None:
                out = self._generate_continuous(requests, sampling, group, counters, listener,
                                                budgets)
            else:
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
        if sp.temperature > 0 and sp.top_k <= 0 and sp.top_p >= 1.0:
            # multinomial's own draw (argmax of p / E, E ~ Exp(1), the same RNG stream), fused
            # (the fp32 upcast happens inside the kernel: no [B, V] fp32 copy; rollout/exp_race.py)
            noise = torch.empty(logits_bv.shape, dtype=torch.float32, device=logits_bv.device)
            noise.exponential_(generator=self.generator)
            return self._broadcast_draw(*self._exp_race_fn()(logits_bv, noise,
                                                              float(sp.temperature)))
        full = logits_bv.float()
        if sp.temperature > 0:
            scaled = full / sp.temperature
            logp = torch.log_softmax(scaled, -1)
            probs = filter_logits(scaled, sp.top_k, sp.top_p).softmax(-1)
            tokens = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
            lp = logp.gather(-1, tokens[:, None]).squeeze(-1)
        else:
            logp = torch.log_softmax(full, -1)
            tokens = full.argmax(-1)
            lp = logp.gather(-1, tokens[:, None]).squeeze(-1)
        return self._broadcast_draw(tokens, lp)

    def _broadcast_draw(self, tokens: torch.Tensor, lp: torch.Tensor):
        """One sampler per TP group: every rank takes TP rank 0's tokens and log-probs."""
        group = self._tp_group()
        if group is not None:
            src = dist.get_global_rank(group, 0)
            dist.broadcast(tokens, src, group=group)
            dist.broadcast(lp, src, group=group)
        return tokens, lp

    def _exp_race_fn(self):
        """`exp_race_sample`: with the lean decoder's Triton kernels (rollout.decode_attention
        auto on CUDA, or triton) the one-pass Triton draw, else compiled on CUDA, eager on CPU."""
        if self._exp_race is None:
            self._exp_race = exp_race_sample
            if self._lean is not None and self._lean.attention == "triton":
                self._exp_race = exp_race_sample_triton
            elif self.ps.device.type == "cuda":
                self._exp_race = torch.compile(exp_race_sample, dynamic=True)
        return self._exp_race

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

    # -- continuous batching on the lean decoder ----------------------------------------------
    def _slots_for(self, n_requests: int) -> int:
        """Slot count: max_batch_size, or the next power of two >= the request count (so CUDA
        graphs are reused across calls of similar size)."""
        if n_requests >= self.max_batch_size:
            return self.max_batch_size
        return min(self.max_batch_size, 1 << (n_requests - 1).bit_length())

    def generate_requests(self, requests: list[list[int]], sampling: SamplingParams, *,
                          listener=None, budgets: list[int] | None = None) -> list[Sample | None]:
        """One sample per request (token ids), in request order, for DARTS' streaming and roll
        modes (docs/algorithms.md B.5-B.6). budgets[i]: most new tokens of request i (<=
        sampling.max_new_tokens; a carried partial response continues with what it has left).
        listener (`rollout.streaming.RolloutListener`): `on_finish(i, sample)` as each request
        ends -- a True return stops the call: the running requests end with finish_reason
        `abort` and the tokens so far, the unstarted ones come back as None -- and `poll()`
        between decode steps (where streamed log-prob work runs)."""
        if budgets is not None:
            if len(budgets) != len(requests):
                raise ValueError(f"{len(budgets)} budgets for {len(requests)} requests")
            if any(not 1 <= b <= sampling.max_new_tokens for b in budgets):
                raise ValueError(f"per-request budgets must be in [1, {sampling.max_new_tokens}]")
        return self._run(requests, sampling, listener=listener, budgets=budgets)

    def generate_groups(self, prompts: list[list[int]], counters: list, sampling: SamplingParams,
                        listener=None) -> tuple[list[list[Sample]], dict[str, float]]:
        """DARTS generation (docs/algorithms.md B.3/B.5, `rollout.darts`): counters[k].m requests
        for prompts[k], kept or rejected by the prompt's `DualEndCounter` in finishing order, the
        rest of a prompt aborted once its counter says `prune`. Returns the kept samples of each
        prompt (request order) and the counts of generated, rejected and pruned ones.
        listener: as in `generate_requests` (its index is the request's; requests are the
        prompts' pools in prompt order; the sample's metadata says `darts_kept`)."""
        if self._lean is None:
            raise ValueError("DARTS generation needs the lean decoder (LocalEngine decoder=auto)")
        if len(counters) != len(prompts):
            raise ValueError(f"{len(counters)} DARTS counters for {len(prompts)} prompts")
        requests = [p for p, c in zip(prompts, counters) for _ in range(c.m)]
        group = [k for k, c in enumerate(counters) for _ in range(c.m)]
        samples = self._run(requests, sampling, group, counters, listener)
        out: list[list[Sample]] = [[] for _ in prompts]
        stats = {"generated": 0, "rejected": 0, "pruned": 0, "generated_tokens": 0}
        for k, s in zip(group, samples):
            if s is None:  # pruned before it started
                stats["pruned"] += 1
                continue
            stats["generated"] += 1
            stats["generated_tokens"] += len(s.response_ids)
            if s.metadata.pop("darts_kept"):
                out[k].append(s)
            elif s.finish_reason == "abort":
                stats["pruned"] += 1
            else:
                stats["rejected"] += 1
        return out, stats

    def _generate_continuous(self, requests: list[list[int]], sp: SamplingParams,
                             group: list[int] | None = None, counters: list | None = None,
                             listener=None, budgets: list[int] | None = None
                             ) -> list[Sample | None]:
        dec, dev = self._lean, self.ps.device
        n_req, max_new = len(requests), sp.max_new_tokens
        B = self._slots_for(n_req)
        dec.check_weights()
        dec.allocate(B, length_bucket(max(len(p) for p in requests) + max_new, 1 << 30))
        ids = [f"s{next(self._ids)}" for _ in range(n_req)]
        routes = EngineRoutes(self.module, B, dec.max_len, dev) if self.record_routing else None
        gen_tok = torch.zeros(B, max_new, dtype=torch.long, device=dev)
        gen_lp = torch.zeros(B, max_new, dtype=torch.float32, device=dev)
        count_dev = torch.zeros(B, dtype=torch.long, device=dev)
        active_dev = torch.zeros(B, dtype=torch.long, device=dev)
        slot_ix = torch.arange(B, device=dev)
        stop_ids = torch.tensor(sorted(set(sp.stop_token_ids)) or [-1], device=dev)
        host_tokens = bool(sp.stop)  # stop strings need the text of every response each step
        slot_req = np.full(B, -1)
        count = np.zeros(B, dtype=np.int64)
        limit = np.full(B, max_new, dtype=np.int64)  # new tokens allowed per slot (budgets)
        stop_all: list[bool] = []  # the listener asked to stop (generate_requests)
        pos = np.zeros(B, dtype=np.int64)
        texts: list[list[int]] = [[] for _ in range(B)]
        results: list[Sample | None] = [None] * n_req
        newly_pruned: set[int] = set()
        queue = deque(range(n_req))
        share = self.share_prompts and routes is None  # (routing replay records every prefill)
        slot_ix_host = np.arange(B)
        src_of = slot_ix_host.copy()  # the slot whose rows each slot reads its prompt from
        dec.point_prefix(list(range(B)), list(range(B)), [0] * B)

        def finish(slot: int, reason: str) -> None:
            r, k = int(slot_req[slot]), int(count[slot])
            results[r] = Sample(
                prompt_ids=list(requests[r]),
                response_ids=gen_tok[slot, :k].tolist(),
                response_logprobs=gen_lp[slot, :k].to("cpu", copy=True) if sp.logprobs else None,
                finish_reason=reason,
                sample_id=ids[r],
                policy_version=self.policy_version,
                # the fed tokens: the prompt and all but the last (never fed) response token
                routed_experts=None if routes is None else routes.take(
                    slot, len(requests[r]) + k - 1),
            )
            slot_req[slot] = -1
            if counters is not None:  # DARTS: finishing order decides (B.3); aborted = pruned
                c = counters[group[r]]
                kept = reason != "abort" and c.on_finish()
                results[r].metadata["darts_kept"] = kept
                if kept:  # which end of the length distribution it was kept for (the store's)
                    results[r].metadata["darts_end"] = (
                        "short" if c.finished <= c.n - c.long else "long")
                if c.prune:
                    newly_pruned.add(group[r])
            if listener is not None and listener.on_finish(r, results[r]):
                stop_all.append(True)

        def prune() -> None:
            """Abort the running requests of prompts whose counter says so (B.5 tail pruning)."""
            if not newly_pruned:
                return
            hit = [(int(s_), "abort") for s_ in np.flatnonzero(slot_req >= 0)
                   if group[slot_req[s_]] in newly_pruned]
            newly_pruned.clear()
            finish_all(hit)

        def finish_all(done: list[tuple[int, str]]) -> None:
            """Finish (slot, reason) pairs and park their slots (inactive, position 0; a parked
            slot's rows get overwritten, so the slots reading a prompt from them read their own
            copy again)."""
            for slot, reason in done:
                finish(slot, reason)
            if done:
                freed = np.array([d[0] for d in done])
                t = torch.as_tensor(freed, device=dev)
                active_dev[t] = 0
                dec.positions[t] = 0
                # the parked slots themselves too: a refill must not inherit their pointers
                unpoint = np.flatnonzero((np.isin(src_of, freed) | np.isin(slot_ix_host, freed))
                                         & (src_of != slot_ix_host))
                if unpoint.size:
                    src_of[unpoint] = unpoint
                    dec.point_prefix(unpoint.tolist(), unpoint.tolist(), [0] * unpoint.size)

        def after_sample(slots: np.ndarray, tokens: torch.Tensor, rows: np.ndarray) -> None:
            """Finish reasons for `slots`, which just received tokens[rows] (stop > abort >
            length). No host<->device traffic unless stop tokens or strings need checking."""
            hit = torch.isin(tokens, stop_ids).cpu().numpy()[rows] if sp.stop_token_ids else None
            if not host_tokens and not self._aborted:  # the vectorized common case
                stop = hit if hit is not None else np.zeros(len(slots), dtype=bool)
                full = ~stop & (count[slots] >= limit[slots])
                done = [(int(s_), "stop") for s_ in slots[stop]]
                done += [(int(s_), "length") for s_ in slots[full]]
            else:
                toks = tokens.cpu().numpy()[rows].tolist() if host_tokens else None
                done = []
                for j, slot in enumerate(slots.tolist()):
                    if host_tokens:
                        texts[slot].append(toks[j])
                    if hit is not None and hit[j]:
                        done.append((slot, "stop"))
                    elif host_tokens and self._hit_stop_string(texts[slot], sp.stop):
                        done.append((slot, "stop"))
                    elif ids[slot_req[slot]] in self._aborted:
                        done.append((slot, "abort"))
                    elif count[slot] >= limit[slot]:
                        done.append((slot, "length"))
            finish_all(done)

        # Deferred stop check: with nothing left to refill, no DARTS counters,
        # no listener, no stop strings and no abort, a stop token only ends its own slot, so the
        # host need not wait for each step's tokens: step t's stop flags travel to the host
        # while step t + 1 decodes, and the slots that stopped at t finish then, with their
        # tokens up to t (the extra token decoded for them is dropped). No other slot's numbers
        # change: each slot decodes independently and the Triton kernel's launch does not
        # depend on the length bucket. On the torch attention path the bucket changes the
        # matmuls' shapes, so it keeps the per-step check.
        pending: list = []  # [(flags on the host, event, slots)] of the last decode step

        def defer_ok() -> bool:
            return (self.defer_stop_check and bool(sp.stop_token_ids) and not queue
                    and counters is None
                    and listener is None and not host_tokens and not self._aborted
                    and dec.attention == "triton")

        def finish_flagged(entry, late: bool) -> np.ndarray:
            """Finish the slots of `entry` whose token was a stop token; `late`: one more step
            was decoded for them since (its token is not theirs). Returns those slots."""
            flags, event, slots = entry
            if event is not None:
                event.synchronize()
            hit = slots[flags.numpy()[slots]]
            if late:
                count[hit] -= 1
            finish_all([(int(s_), "stop") for s_ in hit])
            return hit

        def after_sample_deferred(slots: np.ndarray, tokens: torch.Tensor) -> None:
            """`after_sample` of a decode step whose stop flags are read one step later (or now,
            when a slot reaches its token limit: stop > length)."""
            self.deferred_checks += 1
            if pending:
                slots = slots[~np.isin(slots, finish_flagged(pending.pop(), late=True))]
            cuda = dev.type == "cuda"
            flags = torch.isin(tokens, stop_ids).to("cpu", non_blocking=cuda)  # (pinned)
            event = torch.cuda.Event() if cuda else None
            if event is not None:
                event.record()
            entry = (flags, event, slots)
            full = count[slots] >= limit[slots]
            if not full.any():
                pending.append(entry)
                return
            stopped = finish_flagged(entry, late=False)
            full = slots[full & ~np.isin(slots, stopped)]
            finish_all([(int(s_), "length") for s_ in full])

        def refill(free: list[int]) -> None:
            take = []
            while queue and len(take) < len(free):
                r = queue.popleft()
                if counters is None or not counters[group[r]].prune:
                    take.append(r)  # (a pruned prompt's unstarted requests are dropped)
            if not take:
                return
            take.sort(key=lambda r: len(requests[r]))
            first: dict[tuple, tuple[int, torch.Tensor | None]] = {}  # prompt -> (slot, logits)
            start = 0
            while start < len(take):  # length-sorted chunks of at most prefill_tokens
                end = start + 1
                while end < len(take) and (end + 1 - start) * len(requests[take[end]]) <= self.prefill_tokens:
                    end += 1
                chunk, slots = take[start:end], np.array(free[start:end])
                lengths = [len(requests[r]) for r in chunk]
                src = slots.copy()  # the slot that prefills each row's prompt
                if share:
                    for i, r in enumerate(chunk):
                        src[i] = first.setdefault(tuple(requests[r]), (int(slots[i]), None))[0]
                lead = np.flatnonzero(src == slots)
                P = max(lengths[i] for i in lead) if lead.size else 0
                ids_t = torch.full((len(lead), P), self.pad_id, dtype=torch.long)
                for j, i in enumerate(lead):
                    ids_t[j, : lengths[i]] = torch.tensor(requests[chunk[i]])
                lead_slots, lead_lengths = slots[lead].tolist(), [lengths[i] for i in lead]
                if not lead.size:
                    logits = None
                elif routes is None:
                    logits = dec.prefill(ids_t, lead_lengths, lead_slots)
                else:
                    logits = routes.prefill(partial(dec.prefill, ids_t, lead_lengths, lead_slots),
                                            lead_slots, P)
                for j, i in enumerate(lead if share else ()):  # (a later chunk's copies too)
                    first[tuple(requests[chunk[i]])] = (int(slots[i]), logits[j])
                if lead.size < len(chunk):  # rows whose prompt another slot prefilled
                    rows = [first[tuple(requests[r])][1] for r in chunk]
                    logits = torch.stack(rows)
                    copies = np.flatnonzero(src != slots)
                    dec.copy_prefix(slots[copies].tolist(), src[copies].tolist(),
                                    max(lengths[i] for i in copies))
                    self.shared_prompts += copies.size
                tokens, lp = self._sample(logits, sp)
                st = torch.as_tensor(slots, device=dev)
                gen_tok[st, 0], gen_lp[st, 0] = tokens, lp
                count_dev[st], active_dev[st] = 1, 1
                dec.tokens[st] = tokens
                dec.positions[st] = torch.tensor(lengths, device=dev)
                slot_req[slots], count[slots], pos[slots] = chunk, 1, lengths
                # a copy reads its prompt from the prefilling slot while that one runs
                point = np.flatnonzero((src != slots) & (slot_req[src] >= 0))
                if point.size:
                    src_of[slots[point]] = src[point]
                    dec.point_prefix(slots[point].tolist(), src[point].tolist(),
                                     [lengths[i] for i in point])
                if budgets is not None:
                    limit[slots] = [budgets[r] for r in chunk]
                for s_ in slots.tolist():
                    texts[s_] = []
                after_sample(slots, tokens, np.arange(len(slots)))
                prune()
                start = end
                if stop_all:
                    break

        def stop() -> None:
            """The listener said stop: the running requests end as aborted, the rest unstarted."""
            queue.clear()
            finish_all([(int(s_), "abort") for s_ in np.flatnonzero(slot_req >= 0)])

        refill_at = max(1, B // 4)
        while queue or (slot_req >= 0).any():
            if stop_all:
                stop()
                break
            if listener is not None:
                listener.poll()
            free = np.flatnonzero(slot_req < 0).tolist()
            busy = B - len(free)
            if queue and free and (len(free) >= refill_at or busy == 0 or len(queue) <= len(free)):
                refill(free)
                continue  # a refill can finish samples at once (stop token, max_new == 1)
            act = np.flatnonzero(slot_req >= 0)
            kv_len = length_bucket(int(pos[act].max()) + 1, dec.max_len)
            if routes is None:
                logits = dec.decode(kv_len)
            else:
                logits = routes.decode(partial(dec.decode, kv_len), dec.positions)
            tokens, lp = self._sample(logits, sp)
            col = count_dev.clamp(max=max_new - 1)
            gen_tok[slot_ix, col], gen_lp[slot_ix, col] = tokens, lp
            count_dev += active_dev
            dec.tokens.copy_(tokens)
            dec.positions += active_dev
            count[act] += 1
            pos[act] += 1
            if defer_ok():
                after_sample_deferred(act, tokens)
            else:
                if pending:  # the mode changed (an abort arrived): the deferred flags first
                    act = act[~np.isin(act, finish_flagged(pending.pop(), late=True))]
                after_sample(act, tokens, act)  # decode rows are slots
            prune()
        return results


def build(ctx) -> LocalEngine:
    """The `local` entry of rollout.ENGINES."""
    tok = ctx.tokenizer
    rc = getattr(getattr(ctx.cfg, "algorithm", None), "rollout_correction", None)
    engine = LocalEngine(ctx.module, ctx.ps, pad_id=tok.pad_token_id or 0, tokenizer=tok,
                         max_batch_size=ctx.cfg.rollout.max_batch_size, seed=ctx.seed,
                         record_routing=bool(rc is not None and rc.routing_replay),
                         decode_attention=ctx.cfg.rollout.decode_attention)
    engine.keep_graphs = ctx.cfg.rollout.keep_decode_graphs
    return engine


def check_available(rollout_cfg) -> None:
    """Refuse, before any model is built, `rollout.decode_attention=triton` without triton or
    CUDA (LeanDecoder refuses the same, and a head_dim the kernel lacks, at construction)."""
    resolve_decode_attention(rollout_cfg.decode_attention, torch.cuda.is_available())


def check_layout(parallel_cfg, hf_config: dict, decode_attention: str = "auto") -> None:
    """Refuse, before any model is built, a layout this engine cannot decode: pipeline
    parallelism, MoE models at tensor or expert parallel > 1, and `rollout.decode_attention=
    triton` for a head_dim the kernel lacks (LocalEngine and LeanDecoder refuse the same at
    construction; this says it before the run has built anything)."""
    from megatron_rl.models import get_family

    pp = parallel_cfg.pipeline_model_parallel_size
    tp, ep = parallel_cfg.tensor_model_parallel_size, parallel_cfg.expert_model_parallel_size
    if pp > 1:
        raise ValueError(
            "config field `rollout.engine`: the built-in engine does not support pipeline "
            f"parallelism (parallel.pipeline_model_parallel_size={pp}); use an external engine "
            "(rollout.engine=sglang or vllm)")
    tcfg = get_family(hf_config).transformer_config(hf_config)
    resolve_decode_attention(decode_attention, torch.cuda.is_available(), tcfg["kv_channels"])
    moe = "num_moe_experts" in tcfg
    if moe and (tp > 1 or ep > 1):
        raise ValueError(
            "config field `rollout.engine`: the built-in engine does not support MoE models at "
            f"tensor or expert parallel > 1 (parallel.tensor_model_parallel_size={tp}, "
            f"expert_model_parallel_size={ep}); it decodes MoE only at TP = EP = 1. "
            "Use an external engine (rollout.engine=sglang or vllm)")
