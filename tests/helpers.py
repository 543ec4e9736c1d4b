"""Shared test helpers: tiny random HF checkpoints, two-rank torchrun launches, and CPU runs of
the RL loop through the CLI.

    path = make_tiny_hf("qwen3_moe", tmp_path / "hf")           # config.json + model.safetensors
    proc = run_ranks(["tests/distributed/_worker.py", "arg"])  # 2 gloo ranks, own free port
    proc = run_torchrun(["-m", "megatron_rl.cli", "train", ...])  # the same under torchrun
    out = train_cli(tiny_rl(max_new_tokens=4) + [DENSE_REWARD, f"trainer.output_dir={d}"], cwd)
    rows = metrics_rows(d)                                       # metrics.jsonl, one dict a line
    a, b = at_once(lambda: train_cli(x, cwd), lambda: train_cli(y, cwd))  # side by side

`run_torchrun` runs `python -m torch.distributed.run --nproc_per_node N --standalone` (its own free port)
with OMP_NUM_THREADS=1 and HF_HUB_OFFLINE=1 from the repository root, and raises with the
captured output if the job fails; `run_ranks` starts the same ranks without torchrun's agent
process (4 s of CPU less per launch), for the tests whose subject is not the launch.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A dense reward: the tiny random model's exact-match reward is 0 everywhere, and an update
# without a learning signal is skipped (no actor/* metrics to compare).
DENSE_REWARD = f"reward.name={os.path.join(REPO, 'tests', 'e2e', 'toy_rewards.py')}:digit_fraction"


def tiny_rl(max_new_tokens: int = 4, lr: float = 1e-3) -> list[str]:
    """Overrides of a seconds-long CPU RL run: the tiny built-in model, 4 prompts x 4 samples."""
    return [
        "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64",
        "model.tiny.num_hidden_layers=2", "model.tiny.head_dim=8", "data.train_batch_size=4",
        "data.num_train_examples=64", "data.num_val_examples=8", "rollout.n=4",
        f"rollout.max_new_tokens={max_new_tokens}", "trainer.num_eval_examples=8",
        "trainer.progress_bar=false", "trainer.tensorboard=false", f"optimizer.lr={lr:g}",
    ]


def train_cli(args: list[str], cwd, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m megatron_rl.cli train ARGS` in a child process (one torch thread)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)


def at_once(*calls):
    """Call the zero-argument `calls` two at a time (threads) and return their results in order.

    For independent one-thread child processes (train_cli's runs): the CI machine has two cores,
    and a child spends most of a short run importing torch and Megatron on one of them, so two
    side by side take about 60% of the wall time of one after the other (2-core development
    machine); their numbers are the ones they give one after the other.
    """
    with ThreadPoolExecutor(2) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def wait_for_setup(name: str, timeout_s: float = 1800.0) -> None:
    """Wait for a setup step that tools/test.sh runs beside pytest, and fail naming its log if
    that step failed.

    tools/test.sh starts the steps only some tests need (`vllm`: tools/setup_vllm.sh for
    tests/e2e/test_vllm_engine.py; `chromium`: the browser of tests/e2e/test_report.py) in the
    background and exports MEGATRON_RL_SETUP_STATUS, a folder where each leaves NAME.log and,
    once finished, NAME.rc (its exit status). Without that variable (pytest run by hand) there
    is nothing to wait for.
    """
    import time

    import pytest

    folder = os.environ.get("MEGATRON_RL_SETUP_STATUS")
    if not folder:
        return
    rc_file, log = os.path.join(folder, f"{name}.rc"), os.path.join(folder, f"{name}.log")
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(rc_file):
        if time.monotonic() > deadline:
            pytest.fail(f"tools/test.sh's background setup step {name!r} did not finish in "
                        f"{timeout_s:.0f} s; its log so far: {log}")
        time.sleep(2.0)
    with open(rc_file) as f:
        rc = f.read().strip()
    if rc != "0":
        with open(log, errors="replace") as f:
            tail = f.read()[-3000:]
        pytest.fail(f"tools/test.sh's background setup step {name!r} failed (exit {rc}); the end "
                    f"of its log {log}:\n{tail}")


def metrics_rows(run_dir, drop_prefixes: tuple[str, ...] = ()) -> list[dict]:
    """The run's metrics.jsonl rows, without the keys that start with `drop_prefixes`."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(drop_prefixes)}
                for line in f]

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

TINY_CONFIGS = {
    "qwen3": ("Qwen3Config", dict(_COMMON, tie_word_embeddings=False)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            _COMMON,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
    ),
    "qwen2": ("Qwen2Config", dict(_COMMON, tie_word_embeddings=False)),
    "llama": ("LlamaConfig", dict(_COMMON, tie_word_embeddings=True)),
}
"""Family name -> (transformers config class, kwargs) of the tiny test models."""


def make_tiny_hf(family: str, out_dir, *, seed: int = 0, dtype=torch.float32, **overrides) -> str:
    """Save a tiny random HF model of `family` to `out_dir` and return the folder.

    Every weight is perturbed (norms around 1, the rest N(0, 0.05)) so that q/k norms, biases
    and the router all matter for parity.
    """
    import transformers

    cls_name, kwargs = TINY_CONFIGS[family]
    config = getattr(transformers, cls_name)(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    out_dir = str(out_dir)
    model.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        f.write('{"model_max_length": 256}\n')
    return out_dir


def padded_batch(vocab_size: int, lengths: list[int], seed: int = 0):
    """Right-padded random token batch: (input_ids [b, s], lengths [b]) (pads are token 0)."""
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    ids = torch.zeros(len(lengths), s, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, vocab_size, (n,), generator=g)
    return ids, torch.tensor(lengths)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(env: dict | None) -> dict:
    """The environment of a launched job: one torch thread, offline, the repository importable,
    then `env` on top."""
    child = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    child["PYTHONPATH"] = REPO + os.pathsep + child.get("PYTHONPATH", "")
    child.update(env or {})
    return child


def run_torchrun(
    args: list[str], nproc: int = 2, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run `torchrun --nproc_per_node nproc <args>` (a script path or `-m module ...`).

    Each call gets its own free port (torchrun --standalone); the child environment has OMP_NUM_THREADS=1,
    HF_HUB_OFFLINE=1 and the repository on PYTHONPATH. Raises AssertionError with stdout and
    stderr if the job exits non-zero.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--standalone",  # the agent binds a free port itself (no race between parallel jobs)
        *args,
    ]
    child_env = _child_env(env)
    proc = subprocess.run(
        cmd, cwd=REPO, env=child_env, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"torchrun failed ({proc.returncode}): {' '.join(cmd)}\n--- stdout\n"
            f"{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def run_ranks(
    args: list[str], nproc: int = 2, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run `python <args>` (a script path or `-m module ...`) as the `nproc` ranks of one job on
    this host: what `torchrun --standalone --nproc_per_node nproc <args>` runs, without its agent.

    The agent (torch.distributed.run) imports torch before it starts any rank: ~4 s of CPU and
    5-7 s of wall time per launch on the 2-core CI machine, and the worker tests launch ~40
    jobs. So the ranks are started here with the variables torch.distributed's env:// init reads
    (MASTER_ADDR / MASTER_PORT on a free port, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE;
    rank 0 hosts the store). Tests of the launch itself use `run_torchrun` (the README's form).

    The environment is run_torchrun's (OMP_NUM_THREADS=1, HF_HUB_OFFLINE=1, the repository on
    PYTHONPATH, cwd the repository). As under torchrun, a rank that fails stops the others.
    Returns stdout and stderr of the ranks concatenated in rank order; raises AssertionError with
    them if a rank exits non-zero, subprocess.TimeoutExpired after `timeout` seconds.
    """
    try:
        return _run_ranks(args, nproc, timeout, env)
    except AssertionError as e:  # the free port was taken before rank 0 bound it: once more
        if "EADDRINUSE" not in str(e) and "ddress already in use" not in str(e):
            raise
        return _run_ranks(args, nproc, timeout, env)


def _run_ranks(
    args: list[str], nproc: int, timeout: float, env: dict | None
) -> subprocess.CompletedProcess:
    import tempfile
    import time

    base = _child_env(env)
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc))
    cmd = [sys.executable, *args]
    with tempfile.TemporaryDirectory() as logs:
        files, procs = [], []
        for rank in range(nproc):
            out = open(os.path.join(logs, f"{rank}.out"), "w+")
            err = open(os.path.join(logs, f"{rank}.err"), "w+")
            files.append((out, err))
            procs.append(subprocess.Popen(
                cmd, cwd=REPO, stdout=out, stderr=err, text=True,
                env=dict(base, RANK=str(rank), LOCAL_RANK=str(rank))))
        deadline = time.monotonic() + timeout
        failed_at, timed_out = None, False
        try:
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                    failed_at = now  # give the others a moment to print their own error
                if failed_at is not None and now > failed_at + 5.0:
                    break
                if now > deadline:
                    timed_out = True
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()

        def read(f) -> str:
            f.seek(0)
            return f.read()

        stdout = "".join(read(o) for o, _ in files)
        stderr = "".join(f"[rank {r}]\n{read(e)}" if nproc > 1 else read(e)
                         for r, (_, e) in enumerate(files))
        for o, e in files:
            o.close()
            e.close()
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    codes = [p.returncode for p in procs]
    if any(codes):
        raise AssertionError(
            f"ranks failed (exit codes {codes}): {' '.join(cmd)}\n--- stdout\n{stdout[-6000:]}"
            f"\n--- stderr\n{stderr[-6000:]}")
    return subprocess.CompletedProcess(cmd, 0, stdout, stderr)
