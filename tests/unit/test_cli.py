"""Config loading: recipes, dotted overrides, unknown keys named with the nearest valid key."""

import subprocess
import sys

import pytest

from megatron_rl.config import RLConfig, SFTConfig
from megatron_rl.recipe import load_config, split_config_args


def test_quickstart_recipes_load_with_overrides():
    cfg = load_config(RLConfig, "examples/quickstart/grpo.yaml",
                      ["algorithm.clip_ratio_high=0.3", "data.train_files=[a.parquet,b.jsonl]"])
    assert cfg.algorithm.clip_ratio_high == 0.3
    assert cfg.data.train_files == ["a.parquet", "b.jsonl"]
    assert cfg.rollout.n == 8
    sft = load_config(SFTConfig, "examples/quickstart/sft.yaml", [])
    assert sft.sft.batch_size == 64


def test_unknown_override_names_nearest_key():
    with pytest.raises(ValueError, match=r"algorithm.clip_ratio_hgh.*algorithm.clip_ratio_high"):
        load_config(RLConfig, None, ["algorithm.clip_ratio_hgh=0.3"])


def test_unknown_recipe_key_names_file_and_nearest(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rollout:\n  temprature: 0.5\n")
    with pytest.raises(ValueError, match=r"rollout.temprature.*r.yaml.*rollout.temperature"):
        load_config(RLConfig, str(recipe), [])


def test_invalid_value_names_field():
    with pytest.raises(ValueError, match="rollout.top_p"):
        load_config(RLConfig, None, ["rollout.top_p=0"])


def test_free_form_dict_keys_are_allowed():
    cfg = load_config(RLConfig, None, ["data.task_kwargs.max_digits=3", "model.tiny.hidden_size=64"])
    assert cfg.data.task_kwargs == {"max_digits": 3} and cfg.model.tiny["hidden_size"] == 64


def test_split_config_args():
    assert split_config_args(["--config", "x.yaml", "a.b=1", "--flag"]) == ("x.yaml", ["a.b=1"], ["--flag"])


def test_config_imports_without_torch():
    code = ("import sys, megatron_rl.config, megatron_rl.cli, megatron_rl.recipe; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_rl.cli", *args], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("cmd,schema", [("train", RLConfig), ("sft", SFTConfig), ("eval", RLConfig)])
def test_help_lists_every_section_and_field(cmd, schema):
    from megatron_rl.recipe import _valid_keys, field_docs

    out = _cli(cmd, "--help")
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"usage: megatron-rl {cmd}" in out.stdout
    keys, _ = _valid_keys(schema)
    leaves = [k for k in keys if not any(o.startswith(k + ".") for o in keys)]
    missing = [k for k in leaves if f"  {k}: " not in out.stdout]
    assert not missing, missing
    sections = [k for k in keys if k not in leaves]
    assert all(f"[{k}]" in out.stdout for k in sections)
    # docstrings come along (one sample field per schema)
    assert " ".join(field_docs(type(schema().trainer))["total_steps"].split()) in out.stdout


def test_config_command_prints_a_loadable_default_recipe(tmp_path):
    out = _cli("config", "train")
    assert out.returncode == 0, out.stderr[-2000:]
    recipe = tmp_path / "full.yaml"
    recipe.write_text(out.stdout)
    assert load_config(RLConfig, str(recipe), []) == RLConfig()
    assert _cli("config", "nope").returncode == 2


def test_literal_fields_are_checked_by_name():
    # the message names the field and the choices (in either order)
    with pytest.raises(ValueError, match=r"(?s)rollout.engine.*sglang|sglang.*rollout.engine"):
        load_config(RLConfig, None, ["rollout.engine=sglng"])
    with pytest.raises(ValueError, match=r"(?s)algorithm.loss_agg_mode.*token-mean|"
                                         r"token-mean.*algorithm.loss_agg_mode"):
        load_config(RLConfig, None, ["algorithm.loss_agg_mode=sum"])
    with pytest.raises(ValueError, match=r"reward.diversity.weight"):
        load_config(RLConfig, None, ["reward.diversity.mode=multiplicative",
                                     "reward.diversity.weight=2"])


def test_empty_override_sets_an_empty_string():
    """`trainer.init_from=` clears a recipe's value (OmegaConf alone would read null)."""
    cfg = load_config(RLConfig, "examples/quickstart/grpo.yaml", ["trainer.init_from="])
    assert cfg.trainer.init_from == ""
