"""Checkpoints that cannot lie, without a model: the manifest catches every kind of damage, the
newest complete checkpoint is chosen (a corrupt newer one is skipped with a warning),
keep_last prunes, the pointer is atomic, each rank's RNG round-trips, and the output-folder
policy (run_dir) refuses what it must and classifies config changes."""

from __future__ import annotations

import dataclasses
import json
import os
import random

import numpy as np
import pytest
import torch

from megatron_rl.actor import rng_state
from megatron_rl.actor.checkpoint import _prune, choose_checkpoint, step_folders
from megatron_rl.actor.manifest import read_pointer, verify, write_manifest, write_pointer
from megatron_rl.config import RLConfig
from megatron_rl.run_dir import _decide, classify, config_diffs


def _fake_ckpt(root, step, cfg=None, complete=True):
    d = os.path.join(root, "checkpoints", f"step_{step:06d}")
    os.makedirs(os.path.join(d, "model"))
    open(os.path.join(d, "model", "shard.distcp"), "wb").write(os.urandom(1000))
    extra = {"step": step, "layout": {"dp": 1},
             "config": dataclasses.asdict(cfg or RLConfig()), "run": {}}
    json.dump(extra, open(os.path.join(d, "extra.json"), "w"))
    if complete:
        write_manifest(d, {"step": step})
    return d


@pytest.mark.parametrize("damage", ["truncate", "delete", "flip", "no_manifest"])
def test_manifest_catches_damage_naming_the_file(tmp_path, damage):
    d = _fake_ckpt(str(tmp_path), 3)
    shard = os.path.join(d, "model", "shard.distcp")
    assert verify(d) is None
    if damage == "truncate":
        with open(shard, "r+b") as f:
            f.truncate(10)
    elif damage == "delete":
        os.remove(shard)
    elif damage == "flip":
        data = bytearray(open(shard, "rb").read())
        data[500] ^= 1
        open(shard, "wb").write(bytes(data))
    else:
        os.remove(os.path.join(d, "manifest.json"))
    problem = verify(d)
    assert problem is not None
    assert ("manifest.json" if damage == "no_manifest" else "shard.distcp") in problem


def test_newest_complete_checkpoint_is_chosen_with_a_warning(tmp_path):
    root = str(tmp_path)
    _fake_ckpt(root, 1)
    good = _fake_ckpt(root, 2)
    bad = _fake_ckpt(root, 3)
    os.remove(os.path.join(bad, "extra.json"))
    os.makedirs(os.path.join(root, "checkpoints", "step_000004.tmp"))  # a killed save
    assert step_folders(root)[0] == bad
    chosen, problems = choose_checkpoint(root)
    assert chosen == good
    assert len(problems) == 1 and "step_000003" in problems[0] and "extra.json" in problems[0]


def test_keep_last_prunes_the_oldest_complete_ones(tmp_path):
    root = str(tmp_path)
    for s in (1, 2, 3, 4):
        _fake_ckpt(root, s)
    _prune(os.path.join(root, "checkpoints"), keep_last=2)
    assert [os.path.basename(d) for d in step_folders(root)] == ["step_000004", "step_000003"]


def test_pointer_is_replaced_atomically(tmp_path):
    write_pointer(str(tmp_path), "latest", "step_000001")
    write_pointer(str(tmp_path), "latest", "step_000002")
    assert read_pointer(str(tmp_path), "latest") == "step_000002"
    assert sorted(os.listdir(tmp_path)) == ["latest"]


def test_rng_state_round_trips_every_generator(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = rng_state.capture()
    torch.save(state, tmp_path / "r.pt")
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    rng_state.restore(torch.load(tmp_path / "r.pt", weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want


def _cfg(out, *overrides):
    from megatron_rl.recipe import load_config

    return load_config(RLConfig, None, [f"trainer.output_dir={out}", *overrides])


def test_run_dir_policy(tmp_path):
    out = str(tmp_path / "run")
    assert _decide(_cfg(out), {"dp": 1}).checkpoint is None  # a new folder
    ckpt = _fake_ckpt(out, 4, cfg=_cfg(out))
    plan = _decide(_cfg(out), {"dp": 1})
    assert plan.checkpoint == ckpt and not plan.changes
    # changes that do not move the trajectory are free; others refused unless allowed
    assert _decide(_cfg(out, "trainer.save_interval=7", "trainer.total_steps=200"),
                   {"dp": 1}).checkpoint == ckpt
    with pytest.raises(ValueError, match=r"rollout\.n: 8 -> 16"):
        _decide(_cfg(out, "rollout.n=16"), {"dp": 1})
    plan = _decide(_cfg(out, "optimizer.lr=2e-6", "trainer.resume_allow_changes=[optimizer.lr]"),
                   {"dp": 1})
    assert plan.changes == ["optimizer.lr: 1e-06 -> 2e-06"] and plan.schedule_changed
    with pytest.raises(ValueError, match=r"parallel\.data_parallel_size: 1 -> 2"):
        _decide(_cfg(out), {"dp": 2})
    with pytest.raises(ValueError, match=r"trainer\.total_steps.*below"):
        _decide(_cfg(out, "trainer.total_steps=3"), {"dp": 1})
    with pytest.raises(ValueError, match=r"holds another run.*trainer\.resume=false"):
        _decide(_cfg(out, "trainer.resume=false"), {"dp": 1})
    assert _decide(_cfg(out, "trainer.resume=false", "trainer.overwrite=true"),
                   {"dp": 1}).checkpoint is None


def test_total_steps_changes_the_trajectory_under_a_decaying_schedule():
    saved = dataclasses.asdict(_cfg("x", "optimizer.lr_decay_style=cosine"))
    now = dataclasses.asdict(_cfg("x", "optimizer.lr_decay_style=cosine", "trainer.total_steps=7"))
    refused, _ = classify(config_diffs(saved, now), now, [])
    assert refused == ["trainer.total_steps: 100 -> 7"]


def test_distributed_optimizer_refuses_a_model_parallel_reshard(tmp_path):
    """dp_reshardable optimizer checkpoints follow DP changes only: a resume at another TP size
    with the distributed optimizer is refused up front, naming the field (megatron-core would
    otherwise fail deep in the bucket load); without it the allowed reshard goes ahead."""
    out = str(tmp_path / "run")
    dist_opt = "optimizer.use_distributed_optimizer=true"
    _fake_ckpt(out, 2, cfg=_cfg(out, dist_opt, "parallel.tensor_model_parallel_size=2"))
    allow = "trainer.resume_allow_changes=[parallel.tensor_model_parallel_size]"
    with pytest.raises(ValueError, match=r"optimizer\.use_distributed_optimizer.*"
                                         r"tensor_model_parallel_size: 2 -> 1"):
        _decide(_cfg(out, dist_opt, allow), {"dp": 1})
    both = "trainer.resume_allow_changes=[parallel.tensor_model_parallel_size," \
           "optimizer.use_distributed_optimizer]"
    with pytest.raises(ValueError, match=r"not supported with the distributed optimizer"):
        _decide(_cfg(out, both), {"dp": 1})  # the checkpoint's optimizer was distributed
    out2 = str(tmp_path / "run2")
    ckpt = _fake_ckpt(out2, 2, cfg=_cfg(out2, "parallel.tensor_model_parallel_size=2"))
    assert _decide(_cfg(out2, allow), {"dp": 1}).checkpoint == ckpt
