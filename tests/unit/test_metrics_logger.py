"""MetricsLogger sinks (megatron_rl/metrics.py) and the plot specs (megatron_rl/plot.py).

- resume_step drops what a previous run logged after the resumed step, in metrics.jsonl and in
  TensorBoard (purge_step); 0 starts empty; None appends as before;
- wandb offline: a run written under <out>/wandb with no network, named after the run folder,
  holding exactly the logged rows (read back from the .wandb file);
- plots: titled with the run name, eval curves with markers, a loss figure for SFT.
"""

import glob
import json
import os
import struct
import sys
import time

import pytest

from megatron_rl.metrics import MetricsLogger, read_metrics, run_name
from megatron_rl.plot import figures, plot


def log_steps(out, steps, value, **kw):
    log = MetricsLogger(str(out), 10, tensorboard=kw.pop("tensorboard", False),
                        progress_bar=False, **kw)
    for s in steps:
        log.log(s, {"reward/mean": value + s})
    log.close()


def test_resume_step_truncates_jsonl(tmp_path):
    log_steps(tmp_path, range(0, 6), 0.0)
    log_steps(tmp_path, [6], 0.0)  # resume_step=None: appends (the old behaviour)
    assert [r["step"] for r in read_metrics(str(tmp_path))] == list(range(7))
    log_steps(tmp_path, [4, 5], 100.0, resume_step=3)
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert [r["reward/mean"] for r in rows] == [0, 1, 2, 3, 104, 105]
    log_steps(tmp_path, [1], 7.0, resume_step=0)  # a fresh start
    assert read_metrics(str(tmp_path)) == [{"step": 1, "reward/mean": 8.0}]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n')
    with pytest.raises(ValueError, match="metrics.jsonl: line 2 is not a metrics row"):
        log_steps(tmp_path, [], 0.0, resume_step=1)


def test_resume_step_purges_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_steps(tmp_path, range(1, 6), 0.0, tensorboard=True)
    log_steps(tmp_path, [4, 5], 100.0, tensorboard=True, resume_step=3)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    events = acc.Scalars("reward/mean")
    assert [(e.step, e.value) for e in events] == [(1, 1), (2, 2), (3, 3), (4, 104), (5, 105)]
    log_steps(tmp_path, [1, 2], 50.0, tensorboard=True, resume_step=0)  # a fresh start
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 51), (2, 52)]


def wandb_records(run_dir: str) -> list:
    """The protobuf records of an offline run's .wandb file (LevelDB log framing: 32 KiB
    blocks, 7-byte chunk headers crc32 / length / type, after a 7-byte ':W&B' header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, out, buf = 7, [], b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # block trailer / padding
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk: a record is complete
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
            buf = b""
    return out


@pytest.mark.slow
def test_wandb_offline_without_network(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    out = tmp_path / "quickstart" / "grpo"
    log = MetricsLogger(str(out), 3, tensorboard=False, progress_bar=False, wandb=True,
                        wandb_project="mrl-test", config={"rollout": {"n": 8}})
    log.log(0, {"eval/pass_at_1": 0.0}, advance=False)
    for s in (1, 2):
        log.log(s, {"reward/mean": s / 10})
    with pytest.raises(ValueError, match="wandb needs non-decreasing steps"):
        log.log(1, {"reward/mean": 9.0})
    log.log(3, {"eval/pass_at_1": 0.5}, advance=False)
    log.close()
    for _ in range(100):  # wandb-core may still be flushing the file when finish() returns
        records = wandb_records(str(out))
        if records and records[-1].WhichOneof("record_type") == "exit":
            break
        time.sleep(0.2)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "quickstart/grpo" and run.project == "mrl-test"
    assert {c.key: json.loads(c.value_json) for c in run.config.update}["rollout"] == {"n": 8}
    history = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in r.history.item}
            history.append({k: v for k, v in items.items() if not k.startswith("_")}
                           | {"step": r.history.step.num})
    assert history == [{"step": 0, "eval/pass_at_1": 0.0}, {"step": 1, "reward/mean": 0.1},
                       {"step": 2, "reward/mean": 0.2}, {"step": 3, "eval/pass_at_1": 0.5}]
    assert len(read_metrics(str(out))) == 4  # jsonl beside it, unchanged


def test_wandb_missing_is_refused(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ImportError, match=r"needs the wandb package: pip install 'megatron-rl"):
        MetricsLogger(str(tmp_path), 1, tensorboard=False, progress_bar=False, wandb=True)
    with pytest.raises(ValueError, match="wandb_mode must be 'offline' or 'online'"):
        MetricsLogger(str(tmp_path), 1, tensorboard=False, progress_bar=False, wandb_mode="x")


def test_plot_titles_markers_and_sft_loss(tmp_path):
    run = tmp_path / "quickstart" / "sft"
    run.mkdir(parents=True)
    rows = [{"step": s, "sft/loss": 2.0 / s, "sft/lr": 1e-3} for s in range(1, 31)]
    rows.append({"step": 31, "eval/pass_at_1": 0.1})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert run_name(str(run)) == "quickstart/sft"
    specs = {f.filename: f for f in figures(rows, run_name(str(run)))}
    assert set(specs) == {"loss.png", "accuracy.png"}
    assert specs["loss.png"].title == "quickstart/sft: loss"
    assert specs["loss.png"].markers == {"sft/loss": False}  # 30 points: a line
    assert specs["accuracy.png"].markers == {"eval/pass_at_1": True}
    written = plot(str(run))
    assert sorted(os.path.basename(p) for p in written) == ["accuracy.png", "loss.png"]
    assert all(os.path.getsize(p) > 5000 for p in written)
    rl = [{"step": s, "reward/mean": 0.1 * s, "response_length/mean": 5.0,
           "eval/pass_at_1": 0.2} for s in range(1, 40)]
    specs = {f.filename: f for f in figures(rl, "q/grpo")}
    assert specs["reward.png"].title == "q/grpo: reward"
    assert specs["accuracy.png"].markers["eval/pass_at_1"] is True  # 39 points, still marked
    assert specs["reward.png"].markers["reward/mean"] is False


@pytest.mark.parametrize("field,module,rl", [("wandb", "wandb", False),
                                             ("rollout_store", "zarr", True)])
def test_missing_output_package_is_refused_naming_the_field(monkeypatch, field, module, rl):
    import importlib.util

    from megatron_rl.checks import check_outputs_available
    from megatron_rl.config import TrainerConfig

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == module else real(name, *a))
    tr = TrainerConfig(wandb=field == "wandb")
    with pytest.raises(ImportError, match=f"trainer.{field}.*`{module}` package"):
        check_outputs_available(tr, rl=rl)
    check_outputs_available(TrainerConfig(wandb=False, rollout_store=False), rl=rl)  # not needed
