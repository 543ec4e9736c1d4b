"""Contract types: Sample checks, grouping, TrainBatch splitting and padding; SamplingParams."""

import pytest
import torch

from megatron_rl.config import RolloutConfig
from megatron_rl.rollout.engine import RolloutEngine, SamplingParams
from megatron_rl.types import Prompt, Sample, TrainBatch, group_index, make_groups


def test_sample_checks():
    s = Sample(prompt_ids=[1], response_ids=[5, 6], response_logprobs=[-0.1, -0.2])
    assert s.response_logprobs.dtype == torch.float32 and s.response_length == 2
    with pytest.raises(ValueError, match="finish_reason"):
        Sample(prompt_ids=[1], response_ids=[2], finish_reason="eos")
    with pytest.raises(ValueError, match="response_logprobs"):
        Sample(prompt_ids=[1], response_ids=[2], response_logprobs=[-0.1, -0.2])


def test_make_groups_and_group_index():
    prompts = [Prompt(uid=f"p{i}", prompt_ids=[1, i], ground_truth=str(i)) for i in range(2)]
    samples = [Sample(prompt_ids=[1], response_ids=[3], sample_id=str(k)) for k in range(6)]
    groups = make_groups(prompts, samples, n=3)
    assert [g.group_id for g in groups] == ["p0", "p1"]
    assert [s.ground_truth for s in groups[1].samples] == ["1"] * 3
    assert group_index(samples).tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="5 samples"):
        make_groups(prompts, samples[:5], n=3)


def test_train_batch_split_and_padded():
    samples = [
        Sample(prompt_ids=[1, 2], response_ids=list(range(3 + k)), group_id=f"g{k // 2}", reward=k)
        for k in range(4)
    ]
    batch = TrainBatch.from_samples(samples, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    assert batch.num_loss_tokens() == 3 + 4 + 5 + 6
    assert batch.input_ids(1).tolist() == [1, 2, 0, 1, 2, 3]
    halves = batch.split(2)
    assert [len(h) for h in halves] == [2, 2] and halves[1].group_ids == ["g1", "g1"]
    assert halves[1].rewards.tolist() == [2.0, 3.0]
    with pytest.raises(ValueError, match="mini-batches"):
        batch.split(3)
    pad = halves[0].padded()
    assert pad["mask_BT"].tolist() == [[True] * 3 + [False], [True] * 4]
    assert pad["advantages_BT"][0].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert "old_logprobs_BT" not in pad and batch.rollout_logprobs is None


def test_sampling_params():
    sp = SamplingParams.from_config(
        RolloutConfig(temperature=0.7, val_temperature=0.0), eos_token_id=2
    )
    assert (sp.temperature, sp.stop_token_ids) == (0.7, [2])
    assert SamplingParams.from_config(RolloutConfig(), eos_token_id=2, val=True).temperature == 0.0
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=0)

    class Fake:
        def generate(self, prompts, n, sampling):
            return []

        def abort(self, sample_ids):
            pass

        def sleep(self):
            pass

        def wake(self):
            pass

    assert not isinstance(Fake(), RolloutEngine)  # no weight seam, close, state: not an engine

    class Full(Fake):
        policy_version = 0

        def push_weights(self, module, version):
            self.policy_version = version

        def close(self):
            pass

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    assert isinstance(Full(), RolloutEngine)
