"""NeMo-Run launch scripts (tools/launch/): a real Local launch and Slurm / Docker dry runs.

- Local executor, run.Script: `tools/launch/train.py --executor local --nproc 2` launches
  torchrun with 2 gloo ranks of the tiny model for 2 RL steps (tests/e2e/test_train_cpu.py's
  overrides); both ranks ran, the metrics hold steps 1 and 2, the script exits 0.
- Local executor, run.Partial: a bad override fails on every rank with the nearest-key message,
  the NeMo-Run job is FAILED and the script exits 1 (a failure is never reported as success).
- Slurm dry run: the sbatch script asks for the nodes and GPUs, runs the image with the mounts
  through srun, exports the env, and runs torchrun over the nodes with the recipe resolved
  inside the image.
- Docker dry run: the `docker run` command NeMo-Run's arguments amount to (nvidia runtime, GPUs,
  volumes, env, the image, torchrun with the megatron-rl command).
- An example's launch script (examples/qwen3_30b_a3b_darts/launch.py) dry-runs on Slurm.
Needs nemo-run (`pip install .[launch]`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("nemo_run", reason="nemo-run is not installed (pip install .[launch])")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests", "e2e"))
from test_train_cpu import BASE  # noqa: E402

pytestmark = pytest.mark.slow


def launch(kind: str, args: list[str], tmp_path, timeout: float = 300):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               NEMORUN_HOME=str(tmp_path / "nemo_run_home"))
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", "launch", f"{kind}.py"),
                           *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_local_executor_launches_a_two_rank_train(tmp_path):
    out = tmp_path / "run"
    r = launch("train", ["--executor", "local", "--nproc", "2", "--env", "OMP_NUM_THREADS=1",
                         "--", *BASE, "trainer.total_steps=2", f"trainer.output_dir={out}"],
               tmp_path)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    assert "nemo-run job megatron-rl-train: SUCCEEDED" in r.stdout
    assert "[default0]:" in log and "[default1]:" in log  # torchrun's two local ranks
    with open(out / "metrics.jsonl") as f:
        steps = {row["step"] for row in map(json.loads, f) if "reward/mean" in row}
    assert steps == {1, 2}
    results = [ln for ln in log.splitlines() if '"pass_at_1_before"' in ln]
    assert len(results) == 1, results  # one result line for the job (rank 0)


def test_local_partial_task_failure_is_a_failure(tmp_path):
    r = launch("train", ["--executor", "local", "--nproc", "2", "--task", "partial", "--",
                         "trainer.total_step=2", f"trainer.output_dir={tmp_path / 'run'}"],
               tmp_path)
    log = r.stdout + r.stderr
    assert r.returncode == 1, log[-4000:]
    assert "nemo-run job megatron-rl-train: FAILED" in r.stdout
    assert "did you mean `trainer.total_steps`" in log
    assert not (tmp_path / "run").exists()


def test_slurm_dry_run_sbatch_script(tmp_path):
    r = launch("train", ["--executor", "slurm", "--nodes", "2", "--gpus-per-node", "8",
                         "--account", "acct", "--partition", "batch", "--time", "02:00:00",
                         "--container-image", "megatron-rl:0.1.0", "--mount", "/lustre:/lustre",
                         "--env", "WANDB_MODE=offline", "--job-dir", str(tmp_path / "jobs"),
                         "--dryrun", "--", "--config", "examples/quickstart/grpo.yaml",
                         "trainer.output_dir=/lustre/runs/grpo"], tmp_path, timeout=120)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    script = r.stdout.split("sbatch script:\n", 1)[1]
    for line in ("#SBATCH --account=acct", "#SBATCH --partition=batch", "#SBATCH --nodes=2",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --time=02:00:00",
                 "export WANDB_MODE=offline"):
        assert line in script, line
    srun = next(ln for ln in script.splitlines() if ln.startswith("srun "))
    assert "--container-image megatron-rl:0.1.0" in srun
    assert "--container-mounts /lustre:/lustre," in srun
    torchrun = srun.split(" torchrun ", 1)[1]
    assert "--nnodes 2 --nproc-per-node 8" in torchrun
    assert "--node-rank $SLURM_NODEID" in torchrun and "$head_node_ip:" in torchrun
    assert torchrun.endswith("-m megatron_rl.cli train --config "
                             "/opt/megatron-rl/examples/quickstart/grpo.yaml "
                             "trainer.output_dir=/lustre/runs/grpo")


def test_docker_dry_run_command(tmp_path):
    r = launch("sft", ["--executor", "docker", "--gpus-per-node", "4",
                       "--container-image", "megatron-rl:0.1.0", "--mount", "/data:/data",
                       "--env", "HF_HUB_OFFLINE=1", "--dryrun", "--",
                       "--config", "examples/quickstart/sft.yaml",
                       "trainer.output_dir=/data/runs/sft"], tmp_path, timeout=120)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    cmd = r.stdout.split("docker command:\n", 1)[1].strip().splitlines()[0]
    assert cmd.startswith("docker run ")
    for part in ("--runtime nvidia", "--gpus 4", "--ipc host", "--volume /data:/data",
                 "--env HF_HUB_OFFLINE=1", " megatron-rl:0.1.0 bash -c "):
        assert part in cmd, part
    assert ("--nnodes 1 --nproc-per-node 4" in cmd and "-m megatron_rl.cli sft --config "
            "/opt/megatron-rl/examples/quickstart/sft.yaml trainer.output_dir=/data/runs/sft" in cmd)


def test_container_runs_refuse_a_relative_output_dir(tmp_path):
    r = launch("train", ["--executor", "docker", "--container-image", "img", "--dryrun", "--",
                         "--config", "examples/quickstart/grpo.yaml"], tmp_path, timeout=120)
    assert r.returncode == 2 and "trainer.output_dir=/ABS/PATH" in r.stderr


def test_example_launch_script_dry_run(tmp_path):
    """examples/qwen3_30b_a3b_darts/launch.py: one node of 8 GPUs, the recipe from the image."""
    env = dict(os.environ, NEMORUN_HOME=str(tmp_path / "nemo_run_home"))
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, os.path.join(REPO, "examples", "qwen3_30b_a3b_darts",
                                                     "launch.py"),
                        "--account", "acct", "--container-image", "megatron-rl:0.1.0",
                        "--job-dir", str(tmp_path / "jobs"), "--dryrun",
                        "trainer.output_dir=/lustre/runs/q30"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    script = r.stdout.split("sbatch script:\n", 1)[1]
    assert "#SBATCH --nodes=1" in script and "#SBATCH --gpus-per-node=8" in script
    assert ("--nnodes 1 --nproc-per-node 8 --node-rank 0 --tee 3 -m megatron_rl.cli "
            "train --config /opt/megatron-rl/examples/qwen3_30b_a3b_darts/grpo_darts.yaml "
            "trainer.output_dir=/lustre/runs/q30") in script
