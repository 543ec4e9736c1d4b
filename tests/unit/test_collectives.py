"""Every all-reduce of a host number goes to the device its group's backend needs.

An NCCL-like group stand-in: torch.distributed reports an initialized world of 2 whose backend
is "nccl", the accelerator device is `meta` (this machine has no CUDA), and `all_reduce` records
the device of what it is handed, then stops the caller (a meta tensor has no values to read
back). Each caller that reduces host numbers -- the helpers, the metrics' DP mean, the held-out
evaluation, the dynamic-sampling decision, the update guards -- must hand NCCL a tensor on the
accelerator; with gloo the same callers use the CPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_rl import collectives


class ReducedError(Exception):
    def __init__(self, device):
        self.device = device


@pytest.fixture(params=["nccl", "gloo"])
def backend(request, monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: request.param)
    monkeypatch.setattr(collectives, "_accelerator_device", lambda: torch.device("meta"))

    def all_reduce(t, op=None, group=None):
        raise ReducedError(t.device)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return request.param


def _device_used(fn):
    with pytest.raises(ReducedError) as e:
        fn()
    return e.value.device.type


def _want(backend):
    return "meta" if backend == "nccl" else "cpu"


def test_helpers_reduce_on_the_groups_device(backend):
    assert collectives.group_device().type == _want(backend)
    for fn in (lambda: collectives.all_reduce_floats([1.0, 2.0]),
               lambda: collectives.all_ranks(True), lambda: collectives.any_rank(False)):
        assert _device_used(fn) == _want(backend)


def test_metrics_dp_mean(backend):
    from megatron_rl.metrics import dp_mean

    assert _device_used(lambda: dp_mean({"a": 1.0}, group="dp")) == _want(backend)


def test_held_out_evaluation(backend):
    from megatron_rl.config import RewardConfig
    from megatron_rl.eval.accuracy import evaluate
    from megatron_rl.rollout.engine import SamplingParams
    from megatron_rl.tokenizer import CharTokenizer
    from megatron_rl.types import Prompt, Sample

    tok = CharTokenizer()

    class Engine:
        def state_dict(self):
            return {}

        def generate(self, prompts, n, sampling):
            return [Sample(prompt_ids=p, response_ids=tok.encode("2")) for p in prompts]

    val = SimpleNamespace(prompts=[Prompt(uid="p", prompt_ids=[5], prompt="1+1=",
                                          ground_truth="2")], dp_size=2)
    ps = SimpleNamespace(dp_size=2, dp_rank=0, pgs=SimpleNamespace(dp="dp"))
    reward = lambda r, gt, *, prompt, sample: 1.0  # noqa: E731
    assert _device_used(lambda: evaluate(Engine(), val, reward, tok, RewardConfig(),
                                         SamplingParams(), 1, ps)) == _want(backend)


def test_update_guards(backend):
    from megatron_rl.actor.guards import has_learning_signal

    algo = SimpleNamespace(kl_coef=0.0, entropy_coef=0.0)
    assert _device_used(lambda: has_learning_signal(torch.zeros(3), algo, "dp")) == _want(backend)
