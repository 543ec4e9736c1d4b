"""The catalogue of bad inputs (issue 14): every case is refused with exit code 2 and a message
naming the field, file or row, before the model is built, and leaves an existing run's files
byte-identical.

One table (`CASES`): id, the `megatron-rl train` overrides (`{run}` is an existing run's folder,
`{data}` / `{models}` hold the bad files `_make_inputs` writes), and the regexes the error must
match. Cases run in-process through `megatron_rl.cli.main` -- the code path of the command line,
exit code included, without a process start per case -- with `trainer.output_dir` pointing at a
finished run whose files are hashed before and after each case. Three cases also run as real
processes (`SUBPROCESS`), so the process's exit status is checked too. Reward results and the
one valid-but-odd input (a warning, not an error) are checked on the functions that see them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import warnings

import pytest

from tests.helpers import at_once

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = [
    "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64", "model.tiny.num_hidden_layers=2",
    "model.tiny.head_dim=8", "data.train_batch_size=4", "data.num_train_examples=64",
    "data.num_val_examples=8", "rollout.n=4", "rollout.max_new_tokens=4",
    "trainer.num_eval_examples=8", "trainer.progress_bar=false", "trainer.tensorboard=false",
    "optimizer.lr=1e-3",
]
GOOD = {"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}

# (id, overrides, regexes the message must match)
CASES = [
    # -- config values and cross-field checks (load_config / __post_init__)
    ("unknown_key", ["trainer.total_step=3"], [r"trainer\.total_step\b", r"trainer\.total_steps"]),
    ("wrong_type", ["rollout.n=abc"], [r"rollout\.n", "abc"]),
    ("clip_low_above_1", ["algorithm.clip_ratio_low=1.2"], [r"algorithm\.clip_ratio_low"]),
    ("clip_low_negative", ["algorithm.clip_ratio_low=-0.1"], [r"algorithm\.clip_ratio_low"]),
    ("clip_high_negative", ["algorithm.clip_ratio_high=-0.2"], [r"algorithm\.clip_ratio_high"]),
    ("warmup_negative", ["optimizer.lr_warmup_steps=-5"], [r"optimizer\.lr_warmup_steps"]),
    ("min_lr_above_lr", ["optimizer.min_lr=1.0"], [r"optimizer\.min_lr"]),
    ("beta2_one", ["optimizer.adam_beta2=1.0"], [r"optimizer\.adam_beta2"]),
    ("grpo_n_1", ["rollout.n=1"], [r"rollout\.n", "2 samples"]),
    ("greedy_rollout", ["rollout.temperature=0"], [r"rollout\.temperature"]),
    ("mini_batches_over_samples", ["trainer.mini_batches_per_step=100"],
     [r"trainer\.mini_batches_per_step", "16 samples"]),
    ("overlong_buffer", ["reward.overlong_buffer_len=8"], [r"reward\.overlong_buffer_len"]),
    ("nan_reward_scale", ["reward.correct_reward=nan"], [r"reward\.correct_reward", "finite"]),
    ("engine_typo", ["rollout.engine=sglng"], [r"rollout\.engine", "sglang"]),
    ("agg_mode", ["algorithm.loss_agg_mode=sum"], [r"algorithm\.loss_agg_mode", "token-mean"]),
    ("save_interval", ["trainer.save_interval=-1"], [r"trainer\.save_interval"]),
    ("keep_last", ["trainer.keep_last=-2"], [r"trainer\.keep_last"]),
    ("no_eval_examples", ["trainer.num_eval_examples=0"], [r"trainer\.num_eval_examples"]),
    ("darts_long_end", ["rollout.darts.enabled=true", "rollout.darts.long_end=9"],
     [r"rollout\.darts\.long_end"]),
    ("top_p_zero", ["rollout.top_p=0"], [r"rollout\.top_p"]),
    ("batch_zero", ["data.train_batch_size=0"], [r"data\.train_batch_size"]),
    ("dtype", ["model.dtype=fp64"], [r"model\.dtype"]),
    ("tp_over_world", ["parallel.tensor_model_parallel_size=3"], [r"parallel\.", "world size 1"]),
    # -- the model: sizes, files (checks.py, before any weight is built)
    ("past_positions", ["rollout.max_new_tokens=600"], [r"rollout\.max_new_tokens", "512"]),
    ("micro_batch_too_small", ["trainer.micro_batch_tokens=10"], [r"trainer\.micro_batch_tokens"]),
    ("tiny_vocab", ["model.tiny.vocab_size=50"], [r"model\.tiny\.vocab_size"]),
    ("no_model_folder", ["model.path=/nonexistent/model"], [r"model\.path", "/nonexistent/model"]),
    ("corrupt_config_json", ["trainer.init_from={models}/bad_config"],
     [r"bad_config/config\.json", "not valid JSON"]),
    ("corrupt_tokenizer", ["trainer.init_from={models}/bad_tokenizer"],
     [r"bad_tokenizer/char_tokenizer\.json", "not valid JSON"]),
    ("truncated_safetensors", ["trainer.init_from={models}/truncated"],
     [r"truncated/model\.safetensors", "truncated"]),
    ("missing_shard", ["trainer.init_from={models}/missing_shard"],
     [r"missing_shard/model-00002-of-00002\.safetensors", "missing"]),
    ("tokenizer_over_vocab", ["trainer.init_from={models}/small_vocab"],
     ["vocab_size is 50", "99 ids"]),
    ("few_positions", ["trainer.init_from={models}/few_positions"],
     [r"rollout\.max_new_tokens", "16 positions"]),
    # -- data files (data/prompts.py load_prompts)
    ("missing_file", ["data.train_files=[{data}/nope.jsonl]"], [r"nope\.jsonl", "does not exist"]),
    ("single_missing_path", ["data.train_files={data}/nope.jsonl"], [r"nope\.jsonl"]),
    ("bad_json_line", ["data.train_files={data}/bad_json.jsonl"],
     [r"bad_json\.jsonl` line 3", "not valid JSON"]),
    ("not_an_object", ["data.train_files={data}/not_object.jsonl"],
     [r"not_object\.jsonl` line 2", "not a JSON object"]),
    ("prompt_key_matches_nothing", ["data.train_files={data}/good.jsonl", "data.prompt_key=question"],
     [r"data\.prompt_key", "'question'", "columns: prompt, reward_model"]),
    ("row_without_prompt", ["data.train_files={data}/no_prompt.jsonl"],
     [r"no_prompt\.jsonl` line 2", "`prompt`"]),
    ("row_without_ground_truth", ["data.train_files={data}/no_gt.jsonl", "reward.name=exact_match"],
     [r"no_gt\.jsonl` line 4", r"reward_model\.ground_truth"]),
    ("reward_model_not_object", ["data.train_files={data}/rm_string.jsonl"],
     [r"rm_string\.jsonl` line 1", "reward_model"]),
    ("empty_val_file", ["data.train_files={data}/good.jsonl", "data.val_files={data}/empty.jsonl"],
     [r"empty\.jsonl", "has no rows"]),
    ("empty_train_file", ["data.train_files=[{data}/good.jsonl,{data}/empty.jsonl]"],
     [r"empty\.jsonl", "has no rows"]),
    ("batch_over_rows", ["data.train_files={data}/good.jsonl", "data.train_batch_size=16"],
     [r"data\.train_batch_size", "only 8"]),
    ("prompt_too_long", ["data.train_files={data}/long.jsonl", "data.max_prompt_length=20"],
     [r"long\.jsonl` line 2", "max_prompt_length=20"]),
    ("csv_file", ["data.train_files={data}/rows.csv"], [r"rows\.csv", "unsupported"]),
    ("corrupt_parquet", ["data.train_files={data}/corrupt.parquet"],
     [r"corrupt\.parquet", "not a readable parquet"]),
    # -- rewards
    ("reward_name", ["reward.name=nonsense"], [r"reward\.name", "nonsense"]),
    ("reward_path", ["reward.name=no_such_module:fn"], ["no_such_module:fn", "does not import"]),
    # -- the output folder (run_dir.py)
    ("resume_false_on_a_run", ["trainer.resume=false"], [r"trainer\.output_dir", "holds another run",
                                                         r"trainer\.overwrite=true"]),
    ("resume_changes_lr", ["optimizer.lr=5e-4"], [r"trainer\.resume", r"optimizer\.lr: 0\.001 -> 0\.0005",
                                                  r"trainer\.resume_allow_changes"]),
    ("total_steps_below_checkpoint", ["trainer.total_steps=1"],
     [r"trainer\.total_steps", r"checkpoint to resume, 2 \(`.*step_000002`\)"]),
    ("no_checkpoint_other_config", ["trainer.output_dir={run_no_ckpt}", "optimizer.lr=5e-4"],
     [r"trainer\.output_dir", "no complete checkpoint"]),
]
SUBPROCESS = ["unknown_key", "bad_json_line", "resume_false_on_a_run"]


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")


def _make_inputs(root, run_dir) -> dict:
    data, models = os.path.join(root, "data"), os.path.join(root, "models")
    os.makedirs(data)
    _write_jsonl(f"{data}/good.jsonl", [GOOD] * 8)
    _write_jsonl(f"{data}/bad_json.jsonl", [GOOD, GOOD, '{"prompt": "1+'])
    _write_jsonl(f"{data}/not_object.jsonl", [GOOD, "[1, 2]"])
    _write_jsonl(f"{data}/no_prompt.jsonl", [GOOD, {"question": "2+2="}] + [GOOD] * 6)
    _write_jsonl(f"{data}/no_gt.jsonl", [GOOD, GOOD, "", {"prompt": "3+3="}] + [GOOD] * 5)
    _write_jsonl(f"{data}/rm_string.jsonl", [{"prompt": "1+1=", "reward_model": "2"}] * 8)
    _write_jsonl(f"{data}/long.jsonl", [GOOD, {**GOOD, "prompt": "9" * 50}] + [GOOD] * 6)
    open(f"{data}/empty.jsonl", "w").close()
    open(f"{data}/rows.csv", "w").write("prompt\n1+1=\n")
    open(f"{data}/corrupt.parquet", "wb").write(b"PAR1 this is not parquet")
    final = os.path.join(run_dir, "final")
    for name in ("bad_config", "bad_tokenizer", "truncated", "missing_shard", "small_vocab",
                 "few_positions"):
        shutil.copytree(final, f"{models}/{name}")
    open(f"{models}/bad_config/config.json", "w").write('{"architectures": ["Qwen3')
    open(f"{models}/bad_tokenizer/char_tokenizer.json", "w").write("{not json")
    weights = f"{models}/truncated/model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    json.dump({"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}},
              open(f"{models}/missing_shard/model.safetensors.index.json", "w"))
    for name, key, value in (("small_vocab", "vocab_size", 50),
                             ("few_positions", "max_position_embeddings", 16)):
        cfg = json.load(open(f"{models}/{name}/config.json"))
        cfg[key] = value
        json.dump(cfg, open(f"{models}/{name}/config.json", "w"))
    return {"data": data, "models": models}


def _cli(args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def _digest(folder) -> dict[str, str]:
    out = {}
    for d, _, names in os.walk(folder):
        for n in names:
            p = os.path.join(d, n)
            out[os.path.relpath(p, folder)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A finished 2-step run with checkpoints, a run killed before its first checkpoint (only
    config.yaml + metrics.jsonl), and the bad files."""
    root = str(tmp_path_factory.mktemp("bad_inputs"))
    run = os.path.join(root, "run")
    r = _cli(BASE + ["trainer.total_steps=2", "trainer.save_interval=1",
                     f"trainer.output_dir={run}"])
    assert r.returncode == 0, r.stderr[-3000:]
    no_ckpt = os.path.join(root, "run_no_ckpt")
    os.makedirs(no_ckpt)
    for name in ("config.yaml", "metrics.jsonl"):
        shutil.copy(os.path.join(run, name), no_ckpt)
    return {"run": run, "run_no_ckpt": no_ckpt, **_make_inputs(root, run)}


def _args(case, inputs) -> list[str]:
    overrides = [o.format(**inputs) for o in case[1]]
    out = [] if any(o.startswith("trainer.output_dir=") for o in overrides) else \
        [f"trainer.output_dir={inputs['run']}"]
    return BASE + ["trainer.total_steps=2"] + out + overrides


def _check_message(case, message: str) -> None:
    for pattern in case[2]:
        assert re.search(pattern, message), f"{case[0]}: {pattern!r} not in: {message}"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_naming_it(case, inputs, single_rank, capsys):
    from megatron_rl.cli import main

    before = {k: _digest(inputs[k]) for k in ("run", "run_no_ckpt")}
    rc = main(["train", *_args(case, inputs)])
    err = capsys.readouterr().err
    assert rc == 2, f"{case[0]}: exit code {rc}\n{err[-2000:]}"
    _check_message(case, err)
    assert {k: _digest(inputs[k]) for k in before} == before, f"{case[0]} touched a run's files"


@pytest.fixture(scope="module")
def refused(inputs):
    """The SUBPROCESS cases' processes, two at a time (one-thread children on the two cores):
    (the run's digest before them, name -> finished process, the digest after them)."""
    before = _digest(inputs["run"])
    procs = at_once(*(lambda case=case: _cli(_args(case, inputs))
                      for case in CASES if case[0] in SUBPROCESS))
    names = [case[0] for case in CASES if case[0] in SUBPROCESS]
    return before, dict(zip(names, procs, strict=True)), _digest(inputs["run"])


@pytest.mark.slow
@pytest.mark.parametrize("name", SUBPROCESS)
def test_bad_input_exit_code_of_the_process(name, refused):
    case = next(c for c in CASES if c[0] == name)
    before, procs, after = refused
    r = procs[name]
    assert r.returncode == 2, r.stderr[-2000:]
    _check_message(case, r.stderr)
    assert after == before


def test_a_single_path_is_accepted_where_a_list_is(tmp_path):
    from megatron_rl.config import RLConfig
    from megatron_rl.recipe import load_config

    cfg = load_config(RLConfig, None, ["data.train_files=/data/x.parquet", "rollout.stop=END"])
    assert cfg.data.train_files == ["/data/x.parquet"] and cfg.rollout.stop == ["END"]


@pytest.mark.parametrize("result,pattern", [
    (math.nan, r"non-finite score=nan"), (math.inf, r"non-finite score=inf"),
    (None, r"score=None"), ("1.0", r"score='1\.0' \(str\)"),
    ({"correct": 1.0}, r"without `score`"), ({"score": 1.0, "extra": math.nan}, r"extra=nan"),
])
def test_bad_reward_value_names_function_sample_and_value(result, pattern):
    from megatron_rl.config import RewardConfig
    from megatron_rl.rewards import compute_rewards
    from megatron_rl.tokenizer import CharTokenizer
    from megatron_rl.types import Sample

    def my_reward(response, ground_truth, *, prompt, sample):
        return result

    samples = [Sample(prompt_ids=[5], response_ids=[6], group_id="p0", sample_id=f"s{i}")
               for i in range(2)]
    with pytest.raises(ValueError) as e:
        compute_rewards(samples, my_reward, CharTokenizer(), RewardConfig())
    msg = str(e.value)
    assert "`my_reward`" in msg and "'s0'" in msg and re.search(pattern, msg), msg


def test_more_eval_examples_than_the_held_out_set_warns(tmp_path):
    """Valid but odd: runs, with a one-line warning."""
    from types import SimpleNamespace

    from megatron_rl.config import RLConfig
    from megatron_rl.data.prompts import load_prompts
    from megatron_rl.recipe import load_config
    from megatron_rl.tokenizer import CharTokenizer

    cfg = load_config(RLConfig, None, BASE + ["trainer.num_eval_examples=50"])
    ps = SimpleNamespace(rank=0, dp_rank=0, dp_size=1)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        load_prompts(cfg, CharTokenizer(), ps)
    assert [str(x.message) for x in w if "num_eval_examples=50" in str(x.message)]


@pytest.mark.slow
def test_init_from_a_run_checkpoint_equals_its_hf_export(inputs):
    """trainer.init_from accepts a megatron-rl checkpoint (checkpoints/step_N) as its docstring
    says: evaluating it gives what evaluating the same weights exported as HF gives."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, HF_HUB_OFFLINE="1")

    def evaluate(folder: str) -> dict:
        r = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "eval", *BASE,
                            f"trainer.init_from={inputs['run']}/{folder}"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    outs = at_once(lambda: evaluate("checkpoints/step_000002"), lambda: evaluate("final"))
    assert outs[0] == outs[1]
