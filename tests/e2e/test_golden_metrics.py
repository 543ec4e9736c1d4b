"""A refactor changes no number (the torchtitan rule): a short quickstart -- SFT, then GRPO
(plain, with dynamic sampling + DARTS + KL, and RLOO with Dr.GRPO aggregation) from the SFT
checkpoint -- must reproduce every metrics.jsonl row pinned in golden/quickstart_short.json
(fixed seeds, CPU, fp32; wall-clock keys `time/*` and `throughput/*` excluded).

The golden rows were written by the code *before* the pipeline restructuring (issue 11) and the
restructured code reproduces them bit for bit on the development machine; the comparison allows
a relative 1e-6 so that another x86 machine whose BLAS sums in a different order still passes.
`rollout/logprob_gap_*` are the exception: they measure the rounding disagreement between the
engine's and the actor's fp32 log-probs of the same tokens (~1e-6), so their value *is* the
summation order -- the CI machine (another CPU, other SDPA/GEMM kernels) gave 2.9e-6 where this
one gives 2.1e-6. They are held to the rounding scale (absolute 2e-5, 4x the largest pinned
value, 5.1e-6); a real engine/actor mismatch is orders of magnitude above it.
The rows pin one machine's arithmetic, not only the vector width of torch's CPU kernels: forced
to AVX2 on an AVX512 machine (`ATEN_CPU_CAPABILITY=avx2`) the SFT's grad norm leaves the rows at
step 17 (2e-6 relative) and by the GRPO runs sampled tokens differ (reward 9% off); and the AVX512
rows written on one Intel machine (1c137db, 2026-12-04) were not reproduced on another Intel
AVX512 one (2026-12-07), neither by that commit (the first GRPO run's entropy 4e-6 off at step 1)
nor by today's code (the SFT's grad norm off from step 17, as above). So each file under golden/
records the machine that wrote it (`_machine`): torch's CPU capability, the CPU vendor and
`arithmetic_fingerprint()`, a hash of the bits of a fixed fp32 forward, backward and AdamW step
shaped like the tiny model's, in plain torch ops (none of ours, so a change of our code cannot
move it), on one thread. The test compares against the file whose fingerprint is this machine's
and skips, saying so, where none is (its rows would be another machine's rounding). Files:
quickstart_short_avx512_9446fcd34d1e6472.json, an Intel AVX512 machine (2026-12-07);
quickstart_short_avx2.json, a 2-core AMD EPYC AVX2 one, the kind CI runs on, written before
fingerprints existed: it records capability and vendor only and is matched by those until it is
rewritten on such a machine.
A change that is meant to move numbers rewrites the file of the machine it runs on on purpose
(and, where it can, the others'); on a machine without a file this writes a new one:

    MEGATRON_RL_WRITE_GOLDEN=1 python -m pytest tests/e2e/test_golden_metrics.py
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.helpers import at_once

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
QUIET = ["trainer.progress_bar=false", "trainer.tensorboard=false"]
SFT = ["sft", "--config", "examples/quickstart/sft.yaml", *QUIET, "trainer.total_steps=40",
       "data.num_train_examples=4000", "data.num_val_examples=32", "trainer.num_eval_examples=32"]
GRPO = ["train", "--config", "examples/quickstart/grpo.yaml", *QUIET, "data.train_batch_size=16",
        "data.num_train_examples=2000", "data.num_val_examples=32", "trainer.num_eval_examples=32"]
RUNS = {
    "grpo": ["trainer.total_steps=3", "trainer.eval_interval=2", "trainer.mini_batches_per_step=2"],
    "shaped": ["trainer.total_steps=2", "algorithm.dynamic_sampling=true",
               "rollout.darts.enabled=true", "algorithm.kl_coef=0.01"],
    "rloo": ["trainer.total_steps=2", "algorithm.name=rloo",
             "algorithm.loss_agg_mode=seq-mean-token-sum-norm"],
}
SKIP = ("time/", "throughput/")
ROUNDING = ("rollout/logprob_gap_",)  # keys whose value is rounding noise: absolute tolerance
ROUNDING_ABS = 2e-5


def _cli(args: list[str], cwd) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _rows(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(SKIP)} for line in f]


def run_all(tmp) -> dict[str, list[dict]]:
    """The SFT, then the GRPO runs from its checkpoint two at a time (one-thread processes on the
    two cores; the rows are the same as one after the other)."""
    _cli([*SFT, f"trainer.output_dir={tmp}/sft"], tmp)
    out = {"sft": _rows(f"{tmp}/sft")}
    at_once(*(lambda name=name, extra=extra: _cli(
        [*GRPO, f"trainer.init_from={tmp}/sft/final", *extra, f"trainer.output_dir={tmp}/{name}"],
        tmp) for name, extra in RUNS.items()))
    for name in RUNS:
        out[name] = _rows(f"{tmp}/{name}")
    return out


def arithmetic_fingerprint() -> str:
    """16 hex digits of a sha256 over the bits of a fixed fp32 computation shaped like the tiny
    model's step (vocab 96, width 128, 4 query / 2 KV heads of 32, SwiGLU 384, 8 x 40 tokens):
    embedding, RMSNorm, RoPE, causal SDPA, output log-softmax, cross-entropy, backward and two
    AdamW steps -- the GEMM, attention, reduction and vector-math kernels the golden runs lean
    on, in plain torch ops, on one thread (the runs' OMP_NUM_THREADS). Two machines with the same
    fingerprint round these the same way; where it differs, so do the golden rows."""
    import hashlib

    import torch
    import torch.nn.functional as F

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        B, T, D, nh, kvh, hd, ff, V = 8, 40, 128, 4, 2, 32, 384, 96

        def param(*shape):
            return (torch.randn(*shape, generator=g) * 0.1).requires_grad_()

        emb, wq, wkv, wo = param(V, D), param(nh * hd, D), param(2 * kvh * hd, D), param(D, nh * hd)
        w_up, w_down, norm_w = param(2 * ff, D), param(D, ff), param(D)
        params = [emb, wq, wkv, wo, w_up, w_down, norm_w]
        ids = torch.randint(0, V, (B, T), generator=g)
        angle = torch.outer(torch.arange(T).float(), 1e4 ** (-torch.arange(0, hd, 2) / hd))
        cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)

        def rope(t):
            return t * cos + torch.cat([-t[..., hd // 2:], t[..., :hd // 2]], -1) * sin

        def norm(t):
            return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + norm_w)

        opt = torch.optim.AdamW(params, lr=1e-3)
        bits = []
        for _ in range(2):
            x = emb[ids]
            h = norm(x)
            q = F.linear(h, wq).view(B, T, nh, hd).transpose(1, 2)
            k, v = (t.transpose(1, 2).repeat_interleave(nh // kvh, 1)
                    for t in F.linear(h, wkv).view(B, T, 2, kvh, hd).unbind(2))
            a = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
            x = x + F.linear(a.transpose(1, 2).reshape(B, T, nh * hd), wo)
            up, gate = F.linear(norm(x), w_up).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, w_down)
            logits = F.linear(norm(x), emb)
            loss = F.cross_entropy(logits.view(-1, V), ids.roll(-1, 1).view(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            bits += [torch.log_softmax(logits, -1), loss.view(1), *(p.grad for p in params),
                     *params]
        digest = hashlib.sha256()
        for t in bits:
            digest.update(t.detach().contiguous().numpy().tobytes())
        return digest.hexdigest()[:16]
    finally:
        torch.set_num_threads(threads)


def this_machine() -> dict:
    """What identifies a machine's arithmetic in a golden file's `_machine` (module docstring)."""
    import platform

    import torch

    vendor = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            vendor = next((line.split(":", 1)[1].strip() for line in f
                           if line.startswith("vendor_id")), vendor)
    return {"capability": torch.backends.cpu.get_cpu_capability(), "vendor": vendor,
            "fingerprint": arithmetic_fingerprint()}


def golden_file(machine: dict) -> str | None:
    """The golden file written on a machine of `machine`'s arithmetic: the same fingerprint, or
    for a file written before fingerprints were recorded, the same capability and vendor."""
    for name in sorted(os.listdir(_DIR)):
        path = os.path.join(_DIR, name)
        with open(path) as f:
            wrote = json.load(f)["_machine"]
        if wrote.get("fingerprint"):
            if wrote["fingerprint"] == machine["fingerprint"]:
                return path
        elif (wrote["capability"], wrote["vendor"]) == (machine["capability"], machine["vendor"]):
            return path
    return None


def test_fingerprint_is_stable_and_sees_the_kernels_vector_width():
    """The same bits twice in one process; torch's CPU kernels forced to their scalar
    (`default`) build in a child process change them."""
    mine = arithmetic_fingerprint()
    assert arithmetic_fingerprint() == mine
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "from test_golden_metrics import arithmetic_fingerprint as f; print(f())")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    scalar = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__)], env=env,
                            capture_output=True, text=True, timeout=300, check=True)
    assert scalar.stdout.split()[-1] != mine


@pytest.mark.slow
def test_short_quickstart_reproduces_golden_rows(tmp_path):
    machine = this_machine()
    path = golden_file(machine)
    if path is None and not os.environ.get("MEGATRON_RL_WRITE_GOLDEN"):
        pytest.skip(f"no golden rows were written on a machine of this one's arithmetic {machine} "
                    f"(files under {_DIR}; see the module docstring)")
    got = run_all(tmp_path)
    if os.environ.get("MEGATRON_RL_WRITE_GOLDEN"):
        path = path or os.path.join(
            _DIR, f"quickstart_short_{machine['capability'].lower()}_{machine['fingerprint']}.json")
        with open(path, "w") as f:
            json.dump({"_machine": machine, **got}, f, indent=1, sort_keys=True)
        pytest.skip(f"wrote {path} ({machine})")
    with open(path) as f:
        want = json.load(f)
    want.pop("_machine")
    assert sorted(got) == sorted(want)
    off = []  # every differing value, in run order (sft first: the others start from it)
    for name in ["sft", *sorted(n for n in want if n != "sft")]:
        assert len(got[name]) == len(want[name]), name
        for g, w in zip(got[name], want[name]):
            assert sorted(g) == sorted(w), (name, w["step"], set(g) ^ set(w))
            for k, v in w.items():
                abs_tol = ROUNDING_ABS if k.startswith(ROUNDING) else 1e-9
                same = g[k] == v or (isinstance(v, float) and math.isclose(g[k], v, rel_tol=1e-6,
                                                                            abs_tol=abs_tol))
                if not same:
                    off.append(f"{name} step {w['step']} {k}: got {g[k]!r}, golden {v!r}")
    assert not off, f"{len(off)} values differ; the first 20:\n" + "\n".join(off[:20])
    # the pinned run is not vacuous: GRPO saw rewards with signal and moved the policy
    assert any(r.get("reward/mean", 0) > 0 for r in want["grpo"])
    assert any(r.get("actor/pg_loss", 0) != 0 for r in want["grpo"])
