"""Shared by the NeMo-Run launch scripts (tools/launch/train.py, tools/launch/sft.py).

    python tools/launch/train.py --executor local --nproc 2 -- --config R.yaml key=value ...
    python tools/launch/train.py --executor slurm --nodes 4 --gpus-per-node 8 --account A \\
        --partition P --container-image IMG --mount /data:/data --dryrun -- --config ...
    python tools/launch/train.py --executor docker --gpus-per-node 8 --container-image IMG \\
        --mount /data:/data --dryrun -- --config ...

Everything after `--` is the `megatron-rl <kind>` command line. The task is a `run.Script`
(`torchrun ... -m megatron_rl.cli <kind> ...`, the default) or, with `--task partial`, a
`run.Partial` of `mrl_entry.megatron_rl` (NeMo-Run serializes the call and runs it on every
rank; the job then needs nemo-run installed, as the Dockerfile's image has). Executors:
- local: `LocalExecutor` with the torchrun launcher on this machine (`--nproc` ranks);
- slurm: `SlurmExecutor` (sbatch + srun with pyxis: `--container-image`, `--mount`, `--env`)
  through a local tunnel (on the login node) or `--ssh-host` / `--ssh-user`;
- docker: `DockerExecutor` (the nvidia runtime, host IPC, `--mount` volumes).
In containers the code is the image's (the Dockerfile installs it at /opt/megatron-rl,
`--code-dir`); relative recipe paths are resolved there, and `trainer.output_dir` must be an
absolute path (on a mount), or the run would write inside the container.
`--dryrun` prints what would run (the torchrun command, the sbatch script, the `docker run`
command built from the arguments NeMo-Run hands to the Docker engine) and launches nothing.
A launched job that fails makes the script exit 1.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
IMAGE_CODE_DIR = "/opt/megatron-rl"  # Dockerfile: COPY . /opt/megatron-rl


def parse(kind: str, argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(launcher options, the megatron-rl command line after `--`)."""
    if "--" in argv:
        cut = argv.index("--")
        argv, cmd = argv[:cut], argv[cut + 1 :]
    else:
        cmd = []
    p = argparse.ArgumentParser(prog=f"tools/launch/{kind}.py",
                                description=f"Launch `megatron-rl {kind}` with NeMo-Run.")
    p.add_argument("--executor", choices=["local", "slurm", "docker"], default="local")
    p.add_argument("--task", choices=["script", "partial"], default="script")
    p.add_argument("--nproc", type=int, default=1, help="local: ranks on this machine")
    p.add_argument("--nodes", type=int, default=1, help="slurm: nodes")
    p.add_argument("--gpus-per-node", type=int, default=8, help="slurm / docker: ranks per node")
    p.add_argument("--container-image", help="slurm / docker: the image (see the Dockerfile)")
    p.add_argument("--mount", action="append", default=[], help="SRC:DST (repeatable)")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the job (repeatable)")
    p.add_argument("--code-dir", help=f"where the code lives in the job (containers: {IMAGE_CODE_DIR})")
    p.add_argument("--account", help="slurm account")
    p.add_argument("--partition", help="slurm partition")
    p.add_argument("--time", default="04:00:00", help="slurm time limit")
    p.add_argument("--job-dir", default=os.path.join(REPO, "runs", "nemo_run_jobs"),
                   help="slurm: where sbatch scripts and logs go (on the cluster)")
    p.add_argument("--ssh-host", help="slurm: submit through ssh to this login node")
    p.add_argument("--ssh-user", help="slurm: ssh user")
    p.add_argument("--name", default=f"megatron-rl-{kind}", help="experiment name")
    p.add_argument("--dryrun", action="store_true", help="print what would run; launch nothing")
    a = p.parse_args(argv)
    if not cmd:
        p.error("give the megatron-rl command line after `--` (e.g. -- --config R.yaml)")
    if a.executor != "local" and not a.container_image:
        p.error(f"--executor {a.executor} needs --container-image (build it from the Dockerfile)")
    if a.executor == "slurm" and not a.account:
        p.error("--executor slurm needs --account")
    for item in a.env:
        if "=" not in item:
            p.error(f"--env {item!r} is not KEY=VALUE")
    for item in a.mount:
        if ":" not in item:
            p.error(f"--mount {item!r} is not SRC:DST")
    a.code_dir = a.code_dir or (REPO if a.executor == "local" else IMAGE_CODE_DIR)
    return a, cmd


def job_command(kind: str, cmd: list[str], code_dir: str, executor: str) -> list[str]:
    """`megatron-rl <kind>` arguments with relative recipe paths resolved inside `code_dir`."""
    out, it = [kind], iter(cmd)
    for arg in it:
        if arg == "--config":
            path = next(it, None)
            if path is None:
                raise ValueError("`--config` needs a recipe path")
            out += ["--config", path if os.path.isabs(path) else os.path.join(code_dir, path)]
            continue
        if arg.startswith("trainer.output_dir=") and executor != "local":
            if not os.path.isabs(arg.split("=", 1)[1]):
                raise ValueError(f"override `{arg}`: give an absolute path on a mounted volume; "
                                 "a relative one would be written inside the container")
        out.append(arg)
    if executor != "local" and not any(a.startswith("trainer.output_dir=") for a in cmd):
        raise ValueError("containers need `trainer.output_dir=/ABS/PATH` on a mounted volume "
                         "(the recipe's relative default would be written inside the container)")
    return out


def build_task(a: argparse.Namespace, args: list[str]):
    import nemo_run as run

    if a.task == "script":
        return run.Script(path="megatron_rl.cli", args=args, entrypoint="python", m=True)
    sys.path.insert(0, HERE)
    from mrl_entry import megatron_rl

    return run.Partial(megatron_rl, argv=args)


def build_executor(a: argparse.Namespace):
    import nemo_run as run

    env = dict(item.split("=", 1) for item in a.env)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if a.task == "partial":  # the job imports mrl_entry from here
        launch_dir = os.path.join(a.code_dir, "tools", "launch")
        env["PYTHONPATH"] = os.pathsep.join(x for x in (launch_dir, a.code_dir, env.get("PYTHONPATH")) if x)
    if a.executor == "local":
        return run.LocalExecutor(ntasks_per_node=a.nproc, launcher="torchrun", env_vars=env)
    if a.executor == "docker":
        return run.DockerExecutor(container_image=a.container_image, num_gpus=a.gpus_per_node,
                                  ntasks_per_node=a.gpus_per_node, runtime="nvidia",
                                  ipc_mode="host", shm_size="16g", volumes=list(a.mount),
                                  env_vars=env, packager=run.Packager(), launcher="torchrun")
    if a.ssh_host:
        tunnel = run.SSHTunnel(host=a.ssh_host, user=a.ssh_user or os.environ.get("USER", ""),
                               job_dir=a.job_dir)
    else:
        tunnel = run.LocalTunnel(job_dir=a.job_dir)
    return run.SlurmExecutor(account=a.account, partition=a.partition, nodes=a.nodes,
                             ntasks_per_node=a.gpus_per_node, gpus_per_node=a.gpus_per_node,
                             time=a.time, container_image=a.container_image,
                             container_mounts=list(a.mount), env_vars=env, tunnel=tunnel,
                             packager=run.Packager(), launcher="torchrun")


class _RecordingDocker:
    """Stands in for the Docker SDK client: records what `containers.run` would be given."""

    def __init__(self):
        self.calls: list[tuple[tuple, dict]] = []
        outer = self

        class _Containers:
            def run(self, *args, **kwargs):
                outer.calls.append((args, kwargs))

        class _Networks:
            def list(self, *args, **kwargs):
                return [object()]

            def create(self, *args, **kwargs):
                return None

        self.containers, self.networks = _Containers(), _Networks()


def docker_run_command(image: str, command: str, kw: dict) -> str:
    """The `docker run` command line equivalent to a Docker SDK `containers.run` call (the SDK
    splits a string command with shlex, as below)."""
    parts = ["docker", "run", "--rm", "--detach", "--name", kw["name"], "--network", kw["network"],
             "--workdir", kw["working_dir"]]
    if kw.get("runtime"):
        parts += ["--runtime", kw["runtime"]]
    for req in kw.get("device_requests") or []:
        parts += ["--gpus", "all" if req["Count"] == -1 else str(req["Count"])]
    if kw.get("ipc_mode"):
        parts += ["--ipc", kw["ipc_mode"]]
    if kw.get("shm_size"):
        parts += ["--shm-size", kw["shm_size"]]
    for vol in kw.get("volumes") or []:
        parts += ["--volume", vol]
    for key, value in sorted((kw.get("environment") or {}).items()):
        parts += ["--env", f"{key}={value}"]
    return shlex.join([*parts, image, *shlex.split(command)])


def describe_dryrun(exp, executor: str) -> str:
    """What the dry run would launch: the sbatch script, the docker run command or torchrun's."""
    job = exp.jobs[0]
    info = job._dryrun_info  # nemo-run 0.11.1 keeps the scheduler's dry-run request here
    if executor == "slurm":
        return "sbatch script:\n" + info.request.materialize()
    if executor == "docker":
        from nemo_run.core.execution.docker import DockerContainer

        client = _RecordingDocker()
        lines = []
        for container in info.request.containers:
            DockerContainer.run(container, client, id=info.request.id)
        for args, kw in client.calls:
            image, command = args
            lines.append(docker_run_command(image, command, kw))
        return "docker command:\n" + "\n".join(lines)
    replicas = [r for rs in info.request.role_params.values() for r in rs]  # torchx PopenRequest
    return "command:\n" + "\n".join(shlex.join(r.args) for r in replicas)


def launch(kind: str, argv: list[str]) -> int:
    """Parse, build the task and executor, then dry-run (print) or run and wait."""
    a, cmd = parse(kind, argv)
    try:
        args = job_command(kind, cmd, a.code_dir, a.executor)
    except ValueError as e:
        print(f"tools/launch/{kind}.py: error: {e}", file=sys.stderr)
        return 2
    import nemo_run as run

    task, executor = build_task(a, args), build_executor(a)
    with run.Experiment(a.name, executor=executor, log_level="WARN") as exp:
        exp.add(task, tail_logs=not a.dryrun, name=a.name)
        if a.dryrun:
            exp.dryrun(log=False, delete_exp_dir=False)
            print(describe_dryrun(exp, a.executor))
            return 0
        exp.run(detach=False, tail_logs=True)
    state = str(exp.jobs[0].state)
    print(f"nemo-run job {exp.jobs[0].id}: {state}")
    return 0 if state.startswith("SUCCEEDED") else 1
