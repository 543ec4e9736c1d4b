"""DAPO dynamic sampling: group filtering and the refill arithmetic."""

import pytest

from megatron_rl.algo.dynamic_sampling import (
    DynamicSamplingState,
    filter_groups,
    num_prompts_to_request,
)
from megatron_rl.types import RolloutGroup, Sample


def group(uid, rewards):
    return RolloutGroup(
        group_id=uid,
        samples=[Sample(prompt_ids=[1], response_ids=[2], group_id=uid, reward=r) for r in rewards],
    )


def test_filter_groups_drops_all_equal():
    groups = [group("a", [1, 1]), group("b", [0, 1]), group("c", [0, 0]), group("d", [0.5])]
    kept, dropped = filter_groups(groups)
    assert [g.group_id for g in kept] == ["b"]
    assert dropped == 3


def test_num_prompts_to_request():
    assert num_prompts_to_request(6, 0.5) == 12  # ceil(6 / 0.5)
    assert num_prompts_to_request(5, 0.4) == 13  # ceil(5 / 0.4) = ceil(12.5)
    assert num_prompts_to_request(6, 0.5, max_prompts=8) == 8
    assert num_prompts_to_request(6, 0.0, max_prompts=8) == 8  # nothing kept yet: a full batch
    assert num_prompts_to_request(0, 0.5) == 0


def test_state_refills_then_takes_exactly_target():
    state = DynamicSamplingState(target=3, max_rounds=5)
    state.add([group("a", [1, 1]), group("b", [0, 1]), group("c", [0, 0]), group("d", [1, 0])])
    assert not state.done and state.keep_rate == 0.5
    assert state.num_prompts_to_request(batch_size=4) == 2  # ceil((3 - 2) / 0.5)
    state.add([group("e", [0, 1]), group("f", [1, 0])])
    assert state.done
    assert [g.group_id for g in state.take()] == ["b", "d", "e"]


def test_state_round_limit_warns_and_returns_fewer():
    state = DynamicSamplingState(target=2, max_rounds=2)
    state.add([group("a", [1, 1])])
    state.add([group("b", [0, 1])])
    assert state.done
    with pytest.warns(UserWarning, match="1 of 2"):
        assert len(state.take()) == 1
