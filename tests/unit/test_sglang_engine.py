"""The `sglang` engine against a local server that speaks SGLang's documented HTTP API
(tests/unit/sglang_mock.py): request fields as SGLang defines them, samples and log-probs from
its responses, abort, sleep/wake (memory release/resume), weight push over the distributed
transport (a real gloo broadcast the mock receives; bit-identical to the HF export) and the
disk transport, retries and the outage error, launch-mode command lines. The real-server test
is marked `sglang` (needs SGLang and a GPU: the Docker image).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from unit.sglang_mock import MockSGLang

from megatron_rl.config import RLConfig, SGLangConfig
from megatron_rl.rollout import sglang as sg
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.http import EngineServerError, JsonClient


class _PS:  # a one-rank ParallelState stand-in for the pure-HTTP tests
    rank, tp_size, pp_size, cp_size = 0, 1, 1, 1


def _engine(urls, **kw):
    clients = [sg.SGLangClient(u, timeout_s=10, max_retries=2, retry_backoff_s=0.01)
               for u in urls]
    return sg.SGLangEngine(clients, _PS(), **kw)


def _sp(**kw):
    return SamplingParams(**{"temperature": 0.7, "max_new_tokens": 8, "stop_token_ids": [2],
                             "seed": 3, **kw})


def test_generate_fields_samples_and_logprobs():
    with MockSGLang() as a, MockSGLang() as b:
        a.weight_version = b.weight_version = "4"
        engine = _engine([a.url, b.url])
        prompts = [[1, 5, 6], [1, 7]]
        samples = engine.generate(prompts, 3, _sp())
        assert len(samples) == 6 and len({s.sample_id for s in samples}) == 6
        reqs = [body for path, body in a.requests + b.requests if path == "/generate"]
        assert len(reqs) == 6 and {r["rid"] for r in reqs} == {s.sample_id for s in samples}
        for r in reqs:  # the mock rejects fields SGLang does not define; check the values
            assert r["return_logprob"] is True and r["logprob_start_len"] == -1
            sp = r["sampling_params"]
            assert sp["n"] == 1 and sp["temperature"] == 0.7 and sp["max_new_tokens"] == 8
            assert sp["stop_token_ids"] == [2] and sp["top_p"] == 1.0 and sp["top_k"] == -1
        for i, s in enumerate(samples):
            assert s.prompt_ids == prompts[i // 3] and s.policy_version == 4
            assert s.finish_reason == ("stop" if s.response_ids[-1] == 2 else "length")
            seq = s.prompt_ids + s.response_ids
            ref = [a.logprobs(seq[j - 1], 0.7)[seq[j]] for j in range(len(s.prompt_ids),
                                                                        len(seq))]
            assert torch.allclose(s.response_logprobs, torch.stack(ref), atol=1e-6)
        # per-sample seeds from the call's seed: the same call gives the same samples
        again = engine.generate(prompts, 3, _sp())
        assert [s.response_ids for s in again] == [s.response_ids for s in samples]


def test_abort_returns_partial_samples():
    with MockSGLang(token_delay_s=0.02) as m:
        engine = _engine([m.url])
        box = {}
        t = threading.Thread(target=lambda: box.update(
            s=engine.generate([[1, 5]], 4, _sp(max_new_tokens=200, stop_token_ids=[]))))
        t.start()
        deadline = time.time() + 10
        while len(engine.in_flight) < 4 and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        engine.abort(list(engine.in_flight))
        t.join(timeout=30)
        assert {s.finish_reason for s in box["s"]} == {"abort"}
        assert all(0 < len(s.response_ids) < 200 for s in box["s"])
        assert [b["rid"] for p, b in m.requests if p == "/abort_request"]


def test_sleep_wake_tags_and_generate_wakes_a_sleeping_engine():
    with MockSGLang() as m:
        engine = _engine([m.url], release_tags=("weights", "kv_cache"))
        engine.sleep()
        assert m.released == {"weights", "kv_cache"}
        engine.wake()
        assert not m.released
        assert len(engine.generate([[1]], 1, _sp())) == 1
        engine.sleep()
        assert len(engine.generate([[1]], 1, _sp())) == 1  # resumes first (the mock refuses
        assert not m.released                              # to generate while released)
        calls = [(p, b) for p, b in m.requests if "memory" in p]
        assert calls == 2 * [("/release_memory_occupation", {"tags": ["weights", "kv_cache"]}),
                             ("/resume_memory_occupation", {"tags": ["weights", "kv_cache"]})]


def test_retries_then_success_and_4xx_fails_at_once():
    with MockSGLang() as m:
        engine = _engine([m.url])
        m.fail_next = [503, 502]
        assert len(engine.generate([[1]], 1, _sp())) == 1
        assert sum(p == "/generate" for p, _ in m.requests) == 3
        m.fail_next = [400]
        with pytest.raises(EngineServerError, match="HTTP 400"):
            engine.generate([[1]], 1, _sp())


def test_outage_error_names_the_url():
    from megatron_rl.rollout.http import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    client = JsonClient(url, timeout_s=1, max_retries=2, retry_backoff_s=0.01)
    with pytest.raises(EngineServerError, match=f"{url}/generate: no answer after 3 attempt"):
        client.post("/generate", {})


def test_launch_command_lines():
    sc = SGLangConfig(tp=2, mem_fraction_static=0.55, base_port=31000,
                      dllm_algorithm="LowConfidence", extra_args=["--log-level", "warning"])
    cmds = sg.launch_commands(sc, "/ckpt/hf", num_gpus=8, dtype="bfloat16", seed=5)
    assert len(cmds) == 4
    for i, cmd in enumerate(cmds):
        assert cmd[1:3] == ["-m", "sglang.launch_server"]
        flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
        assert flags["--model-path"] == "/ckpt/hf" and flags["--tp-size"] == "2"
        assert flags["--port"] == str(31000 + i) and flags["--base-gpu-id"] == str(2 * i)
        assert flags["--mem-fraction-static"] == "0.55" and flags["--dtype"] == "bfloat16"
        assert "--enable-memory-saver" in cmd
        assert cmd[cmd.index("--dllm-algorithm") + 1] == "LowConfidence"
        assert cmd[-2:] == ["--log-level", "warning"]
    with pytest.raises(ValueError, match="rollout.sglang.tp"):
        sg.launch_commands(SGLangConfig(tp=3), "/m", num_gpus=8, dtype="bfloat16", seed=0)


def test_check_available():
    cfg = RLConfig()
    cfg.rollout.sglang.urls = ["localhost:30000"]
    with pytest.raises(ValueError, match="not an http"):
        sg.check_available(cfg.rollout)
    cfg.rollout.sglang.urls = ["http://localhost:30000"]
    sg.check_available(cfg.rollout)
    if not torch.cuda.is_available():
        cfg.rollout.sglang.urls = []
        with pytest.raises(ValueError, match="there is none|sglang` package"):
            sg.check_available(cfg.rollout)


@pytest.fixture(scope="module")
def tiny(single_rank):
    from megatron_rl.actor.loading import build_module, resolve_model
    from megatron_rl.config import ModelConfig

    src = resolve_model(ModelConfig(dtype="fp32"))
    torch.manual_seed(1)
    module, _ = build_module(src, single_rank, ModelConfig(dtype="fp32"))
    return module, src, single_rank


def test_distributed_push_is_the_hf_state_dict(tiny):
    from megatron_rl.models.weights import iter_hf_tensors
    from megatron_rl.rollout.http import free_port
    from megatron_rl.rollout.weight_sync import SGLangDistributedTransport

    module, src, ps = tiny
    with MockSGLang() as m:
        clients = [sg.SGLangClient(m.url, timeout_s=30, max_retries=0, retry_backoff_s=0)]
        tr = SGLangDistributedTransport(clients, ps, src.hf_config, 200_000, engine_tp=1,
                                        master_address="127.0.0.1", master_port=free_port(),
                                        backend="gloo")
        engine = sg.SGLangEngine(clients, ps, transport=tr, release_tags=("weights", "kv_cache"))
        engine.sleep()
        engine.push_weights(module, 7)  # resumes the weights first (the update writes there)
        assert m.released == {"kv_cache"} and m.weight_version == "7"
        ref = dict(iter_hf_tensors(module, ps, src.hf_config))
        assert m.received.keys() == ref.keys()
        for k, v in ref.items():
            assert m.received[k].dtype == v.dtype and torch.equal(m.received[k], v), k
        updates = [b for p, b in m.requests if p == "/update_weights_from_distributed"]
        assert len(updates) > 1  # bucketed
        assert all(u["weight_version"] == "7" for u in updates)
        engine.wake()
        assert engine.generate([[1, 4]], 1, _sp())[0].policy_version == 7
        engine.close()
        assert [p for p, _ in m.requests].count("/destroy_weights_update_group") == 1


def test_disk_push(tiny, tmp_path):
    from safetensors.torch import load_file

    from megatron_rl.models.weights import iter_hf_tensors
    from megatron_rl.rollout.weight_sync import SGLangDiskTransport

    module, src, ps = tiny
    with MockSGLang() as m:
        clients = [sg.SGLangClient(m.url, timeout_s=30, max_retries=0, retry_backoff_s=0)]
        engine = sg.SGLangEngine(clients, ps, transport=SGLangDiskTransport(
            clients, ps, src, str(tmp_path / "sync")))
        engine.push_weights(module, 2)
        (body,) = [b for p, b in m.requests if p == "/update_weights_from_disk"]
        assert body == {"model_path": str(tmp_path / "sync"), "flush_cache": True,
                        "abort_all_requests": False, "weight_version": "2"}
        on_disk = load_file(str(tmp_path / "sync" / "model.safetensors"))
        for k, v in iter_hf_tensors(module, ps, src.hf_config):
            assert torch.equal(on_disk[k], v)
        assert engine.policy_version == 2


@pytest.mark.gpu
@pytest.mark.sglang
def test_real_sglang_server(tmp_path):
    """Launch a real SGLang server on the tiny model (GPU + sglang: the Docker image)."""
    pytest.importorskip("sglang")
    if not torch.cuda.is_available():
        pytest.skip("SGLang needs a GPU")
    from megatron_rl.actor.loading import build_module, resolve_model
    from megatron_rl.config import ParallelConfig
    from megatron_rl.parallel import init_parallel
    from megatron_rl.rollout import EngineContext

    ps = init_parallel(ParallelConfig())
    cfg = RLConfig()
    cfg.rollout.engine = "sglang"
    cfg.rollout.sglang.weight_transport = "disk"
    cfg.trainer.output_dir = str(tmp_path)
    sg.check_available(cfg.rollout)
    src = resolve_model(cfg.model)
    module, _ = build_module(src, ps, cfg.model)
    engine = sg.build(EngineContext(cfg=cfg, module=module, ps=ps, tokenizer=src.tokenizer,
                                    src=src, seed=0))
    try:
        samples = engine.generate([[1, 20, 21]], 2, _sp(temperature=1.0))
        assert len(samples) == 2 and all(s.policy_version == 0 for s in samples)
        engine.sleep()
        engine.push_weights(module, 1)
        engine.wake()
        assert all(s.policy_version == 1 for s in engine.generate([[1, 20]], 1, _sp()))
    finally:
        engine.close()
