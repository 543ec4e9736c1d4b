"""MoE routing replay (R3): the experts the rollout engine routed each token to, replayed by the
actor in its old-log-prob and training forwards (docs/algorithms.md F.15).

Why: top-k routing is discrete, so an engine whose kernels differ from the actor's by rounding
can send a token to another expert, and the actor's pi_old is then another function than the
policy that sampled. Replaying the engine's choice makes the actor's forward the engine's
function up to rounding (the mixing weights are still the actor's softmax of its own router
logits at the replayed experts, so gradients flow to the router as usual).

Format (`Sample.routed_experts`, SGLang's `return_routed_experts` layout restricted to the MoE
layers): int [P + L - 1, num_moe_layers, topk] -- for every token the engine *fed* (the prompt
and all response tokens but the last, which is sampled and never fed), in layer order, the
top-k expert ids. The actor's forward also runs the last token and any padding; their experts
do not affect a response log-prob (causal attention), so they get experts 0..k-1.

Mechanism: megatron-core 0.16.1's own `RouterReplay` (`moe_enable_routing_replay`, switched on
for every MoE model in models/builder.py; with no action set it routes exactly as without it).
We drive each router's instance directly (not its class-level list, which collects every model
ever built): `replay(module, routes)` sets REPLAY_FORWARD with this micro-batch's indices for
one forward; `record(module)` sets RECORD and returns what each router chose (the built-in
engine's own recording). Indices are in the router's token order: the [s, b] flattening of its
input, s-major, on this rank's sequence-parallel shard and this pipeline stage's layers.

    routes = pack_routes(samples_routes, lengths, offsets=None, width=s, ps=ps)  # [moe, s*b, k]
    with replay(module, routes):
        out = model(tokens, positions, None)
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def moe_layer_ids(tcfg) -> list[int]:
    """Global indices of the MoE layers (Megatron `moe_layer_freq`), in order."""
    if tcfg.num_moe_experts is None:
        return []
    freq = tcfg.moe_layer_freq
    n = tcfg.num_layers
    if isinstance(freq, int):
        return [i for i in range(n) if i % freq == 0]
    return [i for i in range(n) if freq[i]]


def stage_routers(module) -> list[tuple[int, object]]:
    """(MoE-layer index over the whole model, TopKRouter) for the MoE layers of this stage."""
    ids = moe_layer_ids(module.config)
    out = []
    for layer in module.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            out.append((ids.index(layer.layer_number - 1), router))
    return out


def _replay_state(router):
    state = getattr(router, "router_replay", None)
    if state is None:
        raise ValueError("routing replay needs the model built with moe_enable_routing_replay "
                         "(models/builder.py does this for every MoE family)")
    return state


@contextmanager
def replay(module, routes: torch.Tensor | None):
    """Route this stage's MoE layers by routes[moe_layer] ([tokens, k] int64, router token order)
    for the forwards inside the block; a no-op for routes None."""
    if routes is None:
        yield
        return
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    states = []
    try:
        for j, router in stage_routers(module):
            state = _replay_state(router)
            state.target_topk_idx = routes[j]  # (set_target_indices would also queue it for a
            state.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)  # recompute)
            states.append(state)
        yield
    finally:
        for state in states:
            state.clear_router_replay_action()
            state.target_topk_idx = None


@contextmanager
def record(module):
    """Record the experts every MoE router of this stage picks during the block. Yields a
    callable returning {moe_layer: [tokens, k] int64} of the last forward (one per router);
    call it inside the block (the recording is cleared on exit)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = stage_routers(module)
    states = [(j, _replay_state(r)) for j, r in routers]
    for _, state in states:
        state.recorded_topk_idx = None
        state.set_router_replay_action(RouterReplayAction.RECORD)

    def last() -> dict[int, torch.Tensor]:
        return {j: state.recorded_topk_idx for j, state in states}

    try:
        yield last
    finally:
        for _, state in states:
            state.clear_router_replay_action()
            state.recorded_topk_idx = None


def check_routes(routes: torch.Tensor, length: int, num_moe_layers: int, topk: int,
                 where: str) -> torch.Tensor:
    """Validate one sample's routed experts (see the module docstring); returns int64."""
    r = torch.as_tensor(routes)
    if r.dim() != 3 or r.shape[1:] != (num_moe_layers, topk) or r.shape[0] < length - 1:
        raise ValueError(
            f"{where}: routed_experts has shape {tuple(r.shape)}, expected "
            f"[>= {length - 1} fed tokens, {num_moe_layers} MoE layers, top-{topk}]")
    return r.long()


def pack_routes(routes: list[torch.Tensor], lengths: list[int], *, width: int, tcfg, ps,
                offsets: list[int] | None = None) -> torch.Tensor:
    """Per-sample routes -> [num_moe_layers, tokens, k] in the router's token order for one
    micro-batch: right-padded rows [b, width] (offsets None) or one packed row of `width` tokens
    whose sample i starts at offsets[i]. Rows beyond a sample's routes get experts 0..k-1; with
    sequence parallelism only this TP rank's slice of the sequence is kept."""
    n_moe, k = len(moe_layer_ids(tcfg)), tcfg.moe_router_topk
    b = 1 if offsets is not None else len(routes)
    fill = torch.arange(k, dtype=torch.long)
    grid = fill.expand(b, width, n_moe, k).clone()  # [b, s, layers, k]
    for i, (r, n) in enumerate(zip(routes, lengths)):
        r = check_routes(r, n, n_moe, k, f"sample {i} of the micro-batch")[:n]
        if offsets is None:
            grid[i, : r.shape[0]] = r
        else:
            grid[0, offsets[i] : offsets[i] + r.shape[0]] = r
    if tcfg.sequence_parallel and ps.tp_size > 1:
        part = width // ps.tp_size
        grid = grid[:, ps.tp_rank * part : (ps.tp_rank + 1) * part]
    # router token order: [s, b] flattened s-major
    return grid.permute(2, 1, 0, 3).reshape(n_moe, -1, k).to(ps.device)


ENGINES_WITHOUT_ROUTES = ("vllm",)
"""rollout.engine values that cannot report routed experts (refused with routing replay)."""


def check_setup(cfg, hf_config: dict) -> None:
    """Refuse, before any model is built, a routing replay that cannot run."""
    rc = cfg.algorithm.rollout_correction
    if not rc.routing_replay:
        return
    from megatron_rl.models import get_family

    arch = get_family(hf_config).transformer_config(hf_config)
    if "num_moe_experts" not in arch:
        raise ValueError(
            "config field `algorithm.rollout_correction.routing_replay`: the model "
            f"({hf_config.get('architectures')}) has no MoE layers to replay")
    if cfg.rollout.engine in ENGINES_WITHOUT_ROUTES:
        raise ValueError(
            "config field `algorithm.rollout_correction.routing_replay`: rollout.engine="
            f"{cfg.rollout.engine} does not return the experts it routed each token to; use "
            "rollout.engine=local (records its own) or sglang (return_routed_experts)")
    if cfg.model.recompute == "full":
        raise ValueError(
            "config field `algorithm.rollout_correction.routing_replay`: not supported with "
            "model.recompute=full (the recomputed forward in the backward pass would route "
            "afresh); use model.recompute=selective or none")


def routes_to_replay(batch, cfg) -> list[torch.Tensor] | None:
    """The batch's engine routes when `algorithm.rollout_correction.routing_replay` is on (an
    error if the engine returned none), else None -- and the batch then drops any it carries,
    so the training forwards route afresh too."""
    if not cfg.algorithm.rollout_correction.routing_replay:
        batch.routed_experts = None
        return None
    if batch.routed_experts is None:
        raise ValueError(
            f"config field `algorithm.rollout_correction.routing_replay`: rollout.engine="
            f"{cfg.rollout.engine} returned samples without routed experts (Sample."
            "routed_experts); use an engine that reports them (local records its own; sglang "
            "with return_routed_experts)")
    return batch.routed_experts


class EngineRoutes:
    """The built-in engine's recording (continuous batching, rollout/local.py): a per-slot
    buffer [slots, max_len, moe_layers, k] filled at the positions each prefill / decode step
    feeds; `take(slot, n)` is a finished sample's `routed_experts` (its first n fed tokens)."""

    def __init__(self, module, slots: int, max_len: int, device):
        tcfg = module.config
        self.module = module
        self.n_moe, self.k = len(moe_layer_ids(tcfg)), tcfg.moe_router_topk
        dtype = torch.int16 if tcfg.num_moe_experts < 2**15 else torch.int32
        self.buf = torch.zeros(slots, max_len, self.n_moe, self.k, dtype=dtype, device=device)

    def prefill(self, fn, slots: list[int], width: int):
        """Run fn() (a prefill of len(slots) right-padded rows of `width` tokens, flattened
        row-major by the decoder) and store each row's experts at positions 0..width-1."""
        with record(self.module) as last:
            out = fn()
            chosen = last()
        slot_t = torch.tensor(slots, device=self.buf.device)
        for j, idx in chosen.items():
            self.buf[slot_t, :width, j] = idx.view(len(slots), width, self.k).to(self.buf.dtype)
        return out

    def decode(self, fn, positions: torch.Tensor):
        """Run fn() (one token per slot at `positions`) and store each slot's experts there."""
        with record(self.module) as last:
            out = fn()
            chosen = last()
        rows = torch.arange(self.buf.shape[0], device=self.buf.device)
        for j, idx in chosen.items():
            self.buf[rows, positions, j] = idx.to(self.buf.dtype)
        return out

    def take(self, slot: int, n: int) -> torch.Tensor:
        return self.buf[slot, :n].to("cpu", torch.long)
