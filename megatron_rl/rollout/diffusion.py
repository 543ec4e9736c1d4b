"""Diffusion-LM samplers behind the rollout-engine protocol (docs/algorithms.md C.3).

`DiffusionEngine.generate(prompts, n, SamplingParams)` returns `Sample`s like the AR engines;
the sampler is picked by `DiffusionSampling.algorithm`:

- `llada` (C.3.1): semi-autoregressive blocks of `block_size`, `steps_per_block` steps each;
  per-step quota n_s = floor(m / T_b) + [s < m mod T_b]; proposal x0 = argmax(logits + tau G)
  (Gumbel-max at the sampling temperature, greedy at 0); confidence softmax(logits)[x0]
  (`low_confidence`) or U(0,1) (`random`); commit the top-n_s masked positions of the block.
- `dream` (C.3.3): shifted logits (C.0.5), t_i = linspace(1, eps, T + 1); unmask
  k = floor(#mask (1 - s/t)) per step (all on the last); confidence `maskgit_plus` (prob of the
  sampled token), `topk_margin`, `entropy`, or `origin` (each mask w.p. 1 - s/t); top-k by
  confidence, or positions sampled from softmax(conf / alg_temp).
- `sdar` (C.3.4): a grid of `block_size` blocks from the first prompt token (global origin);
  complete prompt blocks are prefilled into the KV cache; each block is denoised against the
  cache (+ itself, bidirectionally) with per-step quotas over `steps_per_block`, transfer rule
  `low_confidence_dynamic` (commit every masked p > threshold if at least n_s, else the top
  n_s), `low_confidence_static` or `sequential`; a finished block is forwarded once more to
  store its clean KV. Stops after the block in which every sample has produced a stop token.
- `llada2` (C.3.5, LLaDA2.0): the same block decoder with threshold decoding (tau = 0.95,
  32 steps by default) and EOS early stop inside a block (a sample stops once a stop token is
  committed and everything before it is decoded). With `token_editing` (LLaDA2.1, off by
  default): after each mask transfer, every already-decoded generated position of the current
  block whose new sample differs from its token with probability > `editing_threshold` is
  overwritten; a sample's block iterates until it has no mask and made no edit, for at most
  `max_post_steps` forwards after its masks ran out; the EOS stop is then checked at block end
  (as in the LLaDA2.1 reference), so an edit can still revise a committed stop token. Masks are
  transferred by the LLaDA2.0 rule (quota n_s, which is 2.1's minimum of 1 per step at the
  recommended steps = block size = 32).

Block decoding without the cache (`use_cache=False`) re-forwards the window up to the current
block with the block-causal mask (C.2 step 9); it gives the same tokens as the cached decoder.
Batches: prompts are left-padded; for block decoders the padding of each sample is a multiple
of the block size so that every sample's block grid lines up with the others'.
Sampling knobs are the AR engine's (temperature, top-k, top-p, stop ids and strings,
max_new_tokens; the stop token is kept). Outputs never contain the mask token.
`Sample.response_logprobs` holds the log-probability each token had when it was committed.

    engine = DiffusionEngine(model, ps, mask_id=99, sampling=DiffusionSampling(algorithm="sdar"))
    samples = engine.generate([[1, 5, 6]], n=4, sampling=SamplingParams(max_new_tokens=16))

Why one file over 450 lines: the four samplers share the masking, transfer-quota, stop and
TP-sync primitives of one engine; one file per sampler would scatter those shared rules.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl.parallel import ParallelState
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.local import filter_logits
from megatron_rl.types import Sample

_RULES = {
    "llada": ("low_confidence", "random"),
    "dream": ("maskgit_plus", "topk_margin", "entropy", "origin"),
    "sdar": ("low_confidence_dynamic", "low_confidence_static", "sequential"),
    "llada2": ("low_confidence_dynamic",),
}


@dataclass(kw_only=True)
class DiffusionSampling:
    """Sampler choice and its knobs (defaults: DARE / SDAR values, docs/algorithms.md C.3)."""

    algorithm: str = "sdar"
    """llada | dream | sdar | llada2."""
    block_size: int = 4
    """llada: semi-AR block length; sdar/llada2: the model's block size; dream: unused."""
    steps_per_block: int = 4
    """llada: steps per block T_b; sdar: denoising steps T_blk; llada2: steps per block;
    dream: total steps T."""
    threshold: float = 0.9
    """Confidence threshold tau of low_confidence_dynamic (sdar, llada2)."""
    remasking: str = ""
    """Transfer rule (empty: the algorithm's first): see `_RULES`."""
    use_cache: bool = True
    """Block decoders: KV cache of clean blocks (False: re-forward the whole window)."""
    eps: float = 1e-3
    """Dream: final timestep."""
    alg_temp: float = 0.0
    """Dream: 0 commits the top-k by confidence, > 0 samples positions from softmax(conf/alg_temp)."""
    token_editing: bool = False
    """llada2 only: LLaDA2.1 token editing (docs/algorithms.md C.3.5). False = LLaDA2.0 decoding."""
    editing_threshold: float = 0.9
    """LLaDA2.1: a decoded (non-prompt) token of the current block is replaced by the new sample
    when they differ and the sample's probability is > this (C.3.5; HF signature default 0.9)."""
    max_post_steps: int = 16
    """LLaDA2.1: most forwards of a block after its masks are exhausted (editing only, C.3.5)."""

    def __post_init__(self):
        if self.algorithm not in _RULES:
            raise ValueError(f"diffusion sampler `algorithm`: {self.algorithm!r} not in {sorted(_RULES)}")
        if not self.remasking:
            self.remasking = _RULES[self.algorithm][0]
        if self.remasking not in _RULES[self.algorithm]:
            raise ValueError(
                f"diffusion sampler `remasking`: {self.remasking!r} not in {_RULES[self.algorithm]}"
            )
        if self.block_size < 1 or self.steps_per_block < 1:
            raise ValueError("diffusion sampler `block_size` and `steps_per_block` must be >= 1")
        if self.token_editing and self.algorithm != "llada2":
            raise ValueError("diffusion sampler `token_editing` is LLaDA2.1's (algorithm llada2)")
        if self.max_post_steps < 0:
            raise ValueError("diffusion sampler `max_post_steps` must be >= 0")

    @classmethod
    def for_model(cls, hf_config: dict, **overrides) -> DiffusionSampling:
        """The family's default sampler (models/dllm.py) with C.3 defaults, then overrides."""
        from megatron_rl.models.dllm import block_size, diffusion_spec

        spec = diffusion_spec(hf_config)
        if spec is None:
            raise ValueError(f"{hf_config.get('architectures')} is not a diffusion LM")
        defaults = {
            "llada": dict(block_size=32, steps_per_block=32),
            "dream": dict(steps_per_block=64),
            "sdar": dict(block_size=block_size(hf_config), steps_per_block=block_size(hf_config)),
            "llada2": dict(block_size=block_size(hf_config), steps_per_block=32, threshold=0.95),
        }[spec.sampler]
        return cls(**{"algorithm": spec.sampler, **defaults, **overrides})


class MegatronDenoiser:
    """Forward passes of a (TP-split) diffusion GPTModel for the samplers: full fp32 logits.

    Masks are Megatron's (bool, True = masked out, [B, 1, sq, sk]); the model is built with
    `attn_mask_type=no_mask`, so the mask given is the whole rule. RoPE positions are slots.
    """

    def __init__(self, module, ps: ParallelState):
        self.module = module
        self.ps = ps

    def _positions(self, b: int, start: int, s: int) -> torch.Tensor:
        return torch.arange(start, start + s, device=self.ps.device).unsqueeze(0).expand(b, s)

    def forward(self, tokens: torch.Tensor, masked_out: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        out = self.module(tokens, self._positions(b, 0, s), masked_out, runtime_gather_output=True)
        return out.float()

    def new_cache(self, batch: int, total: int):
        from megatron.core.inference.contexts import StaticInferenceContext

        ctx = StaticInferenceContext(batch, total)
        ctx.materialize_only_last_token_logits = False
        return ctx

    def forward_cached(self, ctx, tokens: torch.Tensor, masked_out: torch.Tensor, commit: bool):
        """Queries `tokens` at slots [offset, offset + s) against cached keys [0, offset) + themselves.
        commit=True keeps their K/V (advances the offset); otherwise the next call overwrites them."""
        b, s = tokens.shape
        off = ctx.sequence_len_offset
        out = self.module(tokens, self._positions(b, off, s), masked_out, inference_context=ctx,
                          runtime_gather_output=True)
        if commit:
            ctx.increment_sequence_len_offset(s)
        return out.float()


def transfer_quota(masks: torch.Tensor, steps: int, step: int) -> torch.Tensor:
    """n_s = floor(m / T) + [s < m mod T] (remainder front-loaded, C.3.1 / C.3.4). masks: [B]."""
    return masks // steps + (step < masks % steps).long()


def _top_per_row(conf: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
    """[B, n] bool: the quota[b] highest-confidence entries of each row (conf -inf: never)."""
    order = conf.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(conf.shape[-1], device=conf.device).expand_as(order))
    return (rank < quota[:, None]) & (conf > float("-inf"))


class DiffusionEngine:
    """Diffusion-LM rollout engine on the policy's own weights (no copy, no weight sync)."""

    def __init__(self, module, ps: ParallelState, *, mask_id: int, sampling: DiffusionSampling,
                 shift_logits: bool = False, pad_id: int = 0, tokenizer=None,
                 max_batch_size: int = 256, seed: int = 0):
        if ps.pp_size > 1:
            raise ValueError("the diffusion engine does not support pipeline parallelism")
        self.den = MegatronDenoiser(module, ps)
        self.module = module
        self.ps = ps
        self.mask_id = mask_id
        self.cfg = sampling
        self.shift_logits = shift_logits
        self.pad_id = pad_id
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.generator = torch.Generator(device=ps.device).manual_seed(seed)
        self._ids = itertools.count()
        self._aborted: set[str] = set()
        self.policy_version = 0

    # -- protocol --------------------------------------------------------------------------
    def abort(self, sample_ids: Iterable[str]) -> None:
        self._aborted.update(sample_ids)

    def sleep(self) -> None:  # caches live only inside `generate`
        pass

    def wake(self) -> None:
        pass

    def push_weights(self, module, version: int) -> None:
        """The actor's weights are this engine's weights: only the version moves."""
        if module is not self.module:
            raise ValueError("DiffusionEngine generates on the actor's own module; got another one")
        self.policy_version = version

    def state_dict(self) -> dict:
        """The sampling RNG (saved with checkpoints, so a resumed run draws the same samples)."""
        return {"rng": self.generator.get_state().tolist()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(torch.tensor(state["rng"], dtype=torch.uint8))

    def close(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[Sample]:
        if sampling.seed is not None:
            self.generator.manual_seed(sampling.seed)
        requests = [list(p) for p in prompts for _ in range(n)]
        if any(len(p) == 0 for p in requests):
            raise ValueError("empty prompt given to the diffusion engine")
        was_training = self.module.training
        self.module.eval()
        out: list[Sample] = []
        try:
            for s in range(0, len(requests), self.max_batch_size):
                out += self._wave(requests[s : s + self.max_batch_size], sampling)
        finally:
            self.module.train(was_training)
        self._aborted.clear()
        return out

    # -- sampling primitives ---------------------------------------------------------------
    def _sync(self, x: torch.Tensor) -> torch.Tensor:
        """One decision per TP group: TP rank 0's tokens win (logits agree up to all-reduce order)."""
        if self.ps.tp_size > 1:
            dist.broadcast(x, dist.get_global_rank(self.ps.pgs.tp, 0), group=self.ps.pgs.tp)
        return x

    def _propose(self, logits: torch.Tensor, sp: SamplingParams):
        """logits [B, n, V] -> (x0 [B, n], prob of x0 [B, n], probs [B, n, V]) with the AR knobs."""
        logits = logits.clone()
        logits[..., self.mask_id] = float("-inf")  # never propose [MASK]
        if sp.temperature > 0:
            z = filter_logits((logits / sp.temperature).flatten(0, 1), sp.top_k, sp.top_p)
            probs = z.softmax(-1)
            x0 = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
            probs = probs.view(*logits.shape)
            x0 = x0.view(logits.shape[:-1])
        else:
            probs = logits.softmax(-1)
            x0 = probs.argmax(-1)
        return x0, probs.gather(-1, x0[..., None]).squeeze(-1), probs

    def _propose_llada(self, logits: torch.Tensor, sp: SamplingParams):
        """C.3.1: Gumbel-max at temperature tau; confidence from the untempered softmax."""
        logits = logits.clone()
        logits[..., self.mask_id] = float("-inf")
        z = filter_logits(logits.flatten(0, 1), sp.top_k, sp.top_p).view(*logits.shape)
        if sp.temperature > 0:
            u = torch.rand(z.shape, generator=self.generator, device=z.device, dtype=torch.float64)
            x0 = (z.double() - sp.temperature * torch.log(-torch.log(u.clamp_min(1e-300)))).argmax(-1)
        else:
            x0 = z.argmax(-1)
        p = logits.softmax(-1).gather(-1, x0[..., None]).squeeze(-1)
        if self.cfg.remasking == "random":
            conf = torch.rand(p.shape, generator=self.generator, device=p.device)
        else:
            conf = p
        return x0, p, conf

    # -- decoders --------------------------------------------------------------------------
    def _wave(self, prompts: list[list[int]], sp: SamplingParams) -> list[Sample]:
        ids = [f"d{next(self._ids)}" for _ in prompts]
        if self.cfg.algorithm in ("sdar", "llada2"):
            x, lp, starts = self._block_decode(prompts, sp, ids)
        else:
            x, lp, starts = self._full_decode(prompts, sp, ids)
        return self._samples(prompts, x.cpu(), lp.cpu(), starts, sp, ids)

    def _left_pad(self, prompts, pads, total):
        dev = self.ps.device
        x = torch.full((len(prompts), total), self.mask_id, dtype=torch.long, device=dev)
        valid = torch.ones(len(prompts), total, dtype=torch.bool, device=dev)
        for i, (p, pad) in enumerate(zip(prompts, pads)):
            x[i, :pad] = self.pad_id
            valid[i, :pad] = False
            x[i, pad : pad + len(p)] = torch.tensor(p, dtype=torch.long)
        return x, valid

    def _full_decode(self, prompts, sp: SamplingParams, ids):
        """LLaDA (C.3.1) and Dream (C.3.3): full-sequence bidirectional forwards."""
        cfg = self.cfg
        P = max(len(p) for p in prompts)
        S = cfg.block_size if cfg.algorithm == "llada" else sp.max_new_tokens
        Lg = math.ceil(sp.max_new_tokens / S) * S
        x, valid = self._left_pad(prompts, [P - len(p) for p in prompts], P + Lg)
        B, T = x.shape
        lp = torch.zeros(B, T, device=x.device)
        masked_out = (~valid)[:, None, None, :].expand(B, 1, T, T)
        stops = torch.tensor(sorted(set(sp.stop_token_ids)) or [-1], device=x.device)
        if cfg.algorithm == "dream":
            ts = torch.linspace(1.0, cfg.eps, cfg.steps_per_block + 1)
        for blk in range(Lg // S):
            a, b = P + blk * S, P + (blk + 1) * S
            m0 = (x[:, a:b] == self.mask_id).sum(1)
            for s in range(cfg.steps_per_block):
                masked = x[:, a:b] == self.mask_id
                if not bool(masked.any()):
                    break
                logits = self.den.forward(x, masked_out)
                if self.shift_logits:
                    logits = torch.cat([logits[:, :1], logits[:, :-1]], 1)
                logits = logits[:, a:b]
                if cfg.algorithm == "llada":
                    x0, p, conf = self._propose_llada(logits, sp)
                    sel = _top_per_row(conf.masked_fill(~masked, float("-inf")),
                                       transfer_quota(m0, cfg.steps_per_block, s))
                else:
                    x0, p, sel = self._dream_step(logits, masked, sp, ts[s], ts[s + 1],
                                                  last=s == cfg.steps_per_block - 1)
                x[:, a:b] = torch.where(sel, x0, x[:, a:b])
                lp[:, a:b] = torch.where(sel, p.clamp_min(1e-30).log(), lp[:, a:b])
                self._sync(x)
            if self._all_stopped(x[:, P:b], stops, ids):
                break
        return x, lp, [P] * B

    def _dream_step(self, logits, masked, sp, t: float, s: float, last: bool):
        cfg = self.cfg
        x0, p, probs = self._propose(logits, sp)
        if cfg.remasking == "origin":
            u = torch.rand(p.shape, generator=self.generator, device=p.device)
            sel = masked & ((u < 1 - s / t) if not last else torch.ones_like(masked))
            return x0, p, sel
        if cfg.remasking == "maskgit_plus":
            conf = p
        elif cfg.remasking == "topk_margin":
            top2 = probs.topk(2, dim=-1).values
            conf = top2[..., 0] - top2[..., 1]
        else:  # entropy: negative entropy, higher = more confident
            conf = (probs * probs.clamp_min(1e-30).log()).sum(-1)
        n_mask = masked.sum(1)
        k = n_mask if last else (n_mask.double() * (1 - s / t)).floor().long()
        conf = conf.masked_fill(~masked, float("-inf"))
        if cfg.alg_temp > 0:
            # Positions sampled without replacement from softmax(conf / alg_temp) (Gumbel top-k).
            u = torch.rand(conf.shape, generator=self.generator, device=conf.device).clamp_min(1e-30)
            conf = conf / cfg.alg_temp - torch.log(-torch.log(u))
        return x0, p, _top_per_row(conf, k)

    def _block_decode(self, prompts, sp: SamplingParams, ids):
        """SDAR (C.3.4) / LLaDA2 (C.3.5): block-causal decoding over a global block grid."""
        cfg = self.cfg
        S = cfg.block_size
        full = [len(p) // S * S for p in prompts]
        C = max(full)
        pads = [C - f for f in full]  # multiples of S: every sample's blocks align on slots
        tail = max(len(p) - f for p, f in zip(prompts, full))
        nb = math.ceil((tail + sp.max_new_tokens) / S)
        x, valid = self._left_pad(prompts, pads, C + nb * S)
        B, T = x.shape
        dev = x.device
        lp = torch.zeros(B, T, device=dev)
        blk = torch.arange(T, device=dev) // S
        masked_out = ~((blk[None, :] <= blk[:, None])[None] & valid[:, None, :])[:, None]  # [B,1,T,T]
        stops = torch.tensor(sorted(set(sp.stop_token_ids)) or [-1], device=dev)
        starts = [pad + len(p) for p, pad in zip(prompts, pads)]
        gen_start = torch.tensor(starts, device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        ctx = None
        if cfg.use_cache:
            ctx = self.den.new_cache(B, T)
            if C > 0:
                self.den.forward_cached(ctx, x[:, :C], masked_out[:, :, :C, :C], commit=True)
        edit = cfg.token_editing
        for j in range(nb):
            a, b = C + j * S, C + (j + 1) * S
            m0 = (x[:, a:b] == self.mask_id).sum(1)
            if edit:  # LLaDA2.1 (C.3.5): per-sample state of this block's editing loop
                generated = torch.arange(a, b, device=dev)[None] >= gen_start[:, None]  # [B, S]
                active = ~done
                post = torch.zeros(B, dtype=torch.long, device=dev)
            # Masks run out after steps_per_block steps (the quotas sum to m0); editing adds at
            # most max_post_steps forwards per sample after that.
            for s in range(cfg.steps_per_block + (cfg.max_post_steps + 1 if edit else 0)):
                masked = (x[:, a:b] == self.mask_id) & ~done[:, None]
                if edit:
                    no_mask = ~masked.any(1)
                    post += (active & no_mask).long()
                    active &= post <= cfg.max_post_steps
                    masked &= active[:, None]
                    if not bool(active.any()):
                        break
                elif not bool(masked.any()):
                    break
                if ctx is not None:
                    logits = self.den.forward_cached(ctx, x[:, a:b], masked_out[:, :, a:b, :b], commit=False)
                else:
                    logits = self.den.forward(x[:, :b], masked_out[:, :, :b, :b])[:, a:b]
                x0, p, _ = self._propose(logits, sp)
                quota = torch.minimum(transfer_quota(m0, cfg.steps_per_block, s), masked.sum(1))
                if cfg.remasking == "sequential":
                    pos = torch.arange(S, device=dev).expand(B, S).float()
                    sel = _top_per_row((-pos).masked_fill(~masked, float("-inf")), quota)
                else:
                    sel = _top_per_row(p.masked_fill(~masked, float("-inf")), quota)
                    if cfg.remasking == "low_confidence_dynamic":
                        high = masked & (p > cfg.threshold)
                        sel = torch.where((high.sum(1) >= quota)[:, None], high, sel)
                if edit:  # decoded generated tokens the model now out-votes with p > threshold
                    before = x[:, a:b].clone()
                    sel = sel | (active[:, None] & generated & (before != self.mask_id)
                                 & (x0 != before) & (p > cfg.editing_threshold))
                x[:, a:b] = torch.where(sel, x0, x[:, a:b])
                lp[:, a:b] = torch.where(sel, p.clamp_min(1e-30).log(), lp[:, a:b])
                self._sync(x)
                if edit:  # no mask and no edit: settled (read from the synced tokens, TP-safe)
                    active &= ~(no_mask & (x[:, a:b] == before).all(1))
                if cfg.algorithm == "llada2" and not edit:  # EOS early stop inside the block
                    done |= self._stopped_rows(x[:, :b], gen_start, stops)
            done |= self._stopped_rows(x[:, :b], gen_start, stops)
            if bool(done.all()) or self._aborted.intersection(ids) == set(ids) or j == nb - 1:
                break
            if ctx is not None:  # store the finished block's clean K/V
                self.den.forward_cached(ctx, x[:, a:b], masked_out[:, :, a:b, :b], commit=True)
        return x, lp, starts

    def _stopped_rows(self, x, gen_start, stops) -> torch.Tensor:
        """[B] a stop token is committed in the generated region with no mask before it."""
        pos = torch.arange(x.shape[1], device=x.device)[None]
        gen = pos >= gen_start[:, None]
        is_stop = torch.isin(x, stops) & gen
        first = torch.where(is_stop, pos, x.shape[1]).min(1).values
        mask_before = ((x == self.mask_id) & gen & (pos < first[:, None])).any(1)
        return is_stop.any(1) & ~mask_before

    def _all_stopped(self, region, stops, ids) -> bool:
        has_stop = torch.isin(region, stops).any(1)
        return bool(has_stop.all()) or self._aborted.intersection(ids) == set(ids)

    # -- outputs ---------------------------------------------------------------------------
    def _samples(self, prompts, x, lp, starts, sp: SamplingParams, ids) -> list[Sample]:
        out = []
        stops = set(sp.stop_token_ids)
        for i, p in enumerate(prompts):
            seq = x[i, starts[i] : starts[i] + sp.max_new_tokens].tolist()
            lps = lp[i, starts[i] : starts[i] + sp.max_new_tokens].tolist()
            reason, cut = "length", len(seq)
            for t, tok in enumerate(seq):
                if tok in stops or self._hit_stop_string(seq[: t + 1], sp.stop):
                    reason, cut = "stop", t + 1
                    break
            if ids[i] in self._aborted and self.mask_id in seq[:cut]:  # aborted mid-decoding
                reason, cut = "abort", seq.index(self.mask_id)
            elif reason != "stop" and ids[i] in self._aborted:
                reason = "abort"
            seq, lps = seq[:cut], lps[:cut]
            assert self.mask_id not in seq, "diffusion sampler left a mask token in a response"
            out.append(Sample(
                prompt_ids=list(p), response_ids=seq,
                response_logprobs=torch.tensor(lps, dtype=torch.float32) if sp.logprobs else None,
                finish_reason=reason, sample_id=ids[i], policy_version=self.policy_version,
            ))
        return out

    def _hit_stop_string(self, response: list[int], stops: list[str]) -> bool:
        if not stops:
            return False
        if self.tokenizer is None:
            raise ValueError("SamplingParams.stop strings need the engine's tokenizer")
        return any(s in self.tokenizer.decode(response) for s in stops)


def build(ctx) -> DiffusionEngine:
    """The `diffusion` entry of rollout.ENGINES: the family's sampler (models/dllm.py) with the
    `rollout.diffusion` fields that were set."""
    from megatron_rl.models.dllm import diffusion_spec, mask_token_id

    hf, tok = ctx.src.hf_config, ctx.tokenizer
    sampling = DiffusionSampling.for_model(hf, **ctx.cfg.rollout.diffusion.overrides())
    return DiffusionEngine(ctx.module, ctx.ps, mask_id=mask_token_id(hf), sampling=sampling,
                           shift_logits=diffusion_spec(hf).shift_logits, pad_id=tok.pad_token_id,
                           tokenizer=tok, max_batch_size=ctx.cfg.rollout.max_batch_size,
                           seed=ctx.seed)
