"""Prompt datasets: file layouts, bad rows, DP sharding, resumability."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl.config import DataConfig
from megatron_rl.data.prompts import PromptDataset
from megatron_rl.tokenizer import CharTokenizer

TOK = CharTokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def task_ds(**kw):
    return PromptDataset.from_task(
        "synthetic_arithmetic", num_examples=40, tokenizer=TOK, seed=kw.pop("seed", 7), **kw
    )


def test_jsonl_and_parquet_layouts(tmp_path):
    rows = [
        {"prompt": "1+1=", "reward_model": {"ground_truth": "2"}, "data_source": "toy"},
        {"prompt": [{"role": "user", "content": "2+2="}], "reward_model": {"ground_truth": "4"}},
    ]
    jsonl = write_jsonl(tmp_path / "a.jsonl", rows)
    # a parquet column has one type: chat messages, as in the DAPO / verl files
    pq.write_table(pa.Table.from_pylist([rows[1], rows[1]]), tmp_path / "b.parquet")
    ds = PromptDataset.from_files([jsonl, str(tmp_path / "b.parquet")], tokenizer=TOK, seed=0)
    assert len(ds) == 4
    p0, p1 = ds.prompts[0], ds.prompts[1]
    assert p0.prompt_ids == TOK.encode("1+1=", add_special_tokens=True)
    assert p1.prompt_ids == TOK.encode("2+2=", add_special_tokens=True)  # chat template
    assert (p0.ground_truth, p0.data_source, p1.ground_truth) == ("2", "toy", "4")
    assert ds.prompts[3].prompt_ids == p1.prompt_ids and len({p.uid for p in ds.prompts}) == 4


def test_row_without_prompt_names_file_and_row(tmp_path):
    path = write_jsonl(
        tmp_path / "bad.jsonl",
        [{"prompt": "1+1="}, {"question": "2+2=", "reward_model": {"ground_truth": "4"}}],
    )
    with pytest.raises(ValueError) as e:
        PromptDataset.from_files([path], tokenizer=TOK, seed=0)
    # rows are counted as lines, from 1 (the JSON errors' convention)
    assert path in str(e.value) and "line 2" in str(e.value) and "`prompt`" in str(e.value)


def test_too_long_prompt_names_row(tmp_path):
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "1+1="}, {"prompt": "9" * 50}])
    with pytest.raises(
        ValueError, match=r"long\.jsonl` line 2: prompt has 51 tokens.*max_prompt_length=20"
    ):
        PromptDataset.from_files([path], tokenizer=TOK, seed=0, max_prompt_length=20)


def test_bad_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "1"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"broken\.jsonl` line 2"):
        PromptDataset.from_files([str(path)], tokenizer=TOK, seed=0)


def test_state_dict_round_trip_gives_same_next_batch():
    ds = task_ds()
    it = ds.batches(8)
    for _ in range(6):  # 40 prompts = 5 batches per epoch: crosses an epoch boundary
        next(it)
    state = ds.state_dict()
    expected = [p.uid for p in next(it)]
    resumed = task_ds()
    resumed.load_state_dict(state)
    assert [p.uid for p in next(resumed.batches(8))] == expected
    with pytest.raises(ValueError, match="seed"):
        task_ds(seed=8).load_state_dict(state)


def test_dp_shards_are_disjoint_and_cover_each_global_batch():
    full = task_ds().batches(8)
    shards = [task_ds(dp_rank=r, dp_size=4).batches(8) for r in range(4)]
    for _ in range(7):  # also crosses the epoch boundary
        parts = [[p.uid for p in next(s)] for s in shards]
        assert all(len(p) == 2 for p in parts)
        flat = [u for p in parts for u in p]
        assert len(set(flat)) == 8
        assert flat == [p.uid for p in next(full)]


def test_epoch_order_is_seeded_and_reshuffled():
    def first_epoch_then_second(seed):
        it = task_ds(seed=seed).batches(40)
        return [p.uid for p in next(it)], [p.uid for p in next(it)]

    e0, e1 = first_epoch_then_second(1)
    assert (e0, e1) == first_epoch_then_second(1)
    assert sorted(e0) == sorted(e1) and e0 != e1
    assert e0 != first_epoch_then_second(2)[0]


def test_batch_size_checks_and_from_config():
    with pytest.raises(ValueError, match="multiple of the data-parallel size 4"):
        next(task_ds(dp_rank=0, dp_size=4).batches(6))
    with pytest.raises(ValueError, match="training set has only"):
        next(task_ds().batches(64))
    cfg = DataConfig(num_train_examples=16, num_val_examples=4, max_prompt_length=16)
    train = PromptDataset.from_config(cfg, tokenizer=TOK, seed=0)
    val = PromptDataset.from_config(cfg, tokenizer=TOK, seed=0, split="val")
    assert (len(train), len(val)) == (16, 4)
    assert not {p.prompt for p in train.prompts} & {p.prompt for p in val.prompts}
