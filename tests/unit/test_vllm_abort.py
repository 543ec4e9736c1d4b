"""The vllm engine's abort, against a fake server client: a request whose HTTP call is under
way but that the server has not admitted yet ignores an abort (vLLM drops unknown ids), so the
engine must re-send it until the request has left; a request not yet sent is never sent."""
import threading
import time
from types import SimpleNamespace

from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.vllm import VLLMEngine


class _SlowAdmitClient:
    """Admits each request 0.3 s after it arrives; aborts of unadmitted ids are dropped."""

    url = "http://fake"

    def __init__(self):
        self.lock = threading.Lock()
        self.admitted: dict[str, threading.Event] = {}
        self.aborted: set[str] = set()
        self.sent: list[str] = []
        self.abort_calls = 0

    def generate(self, rid, token_ids, body):
        with self.lock:
            self.sent.append(rid)
        time.sleep(0.3)
        ev = threading.Event()
        with self.lock:
            self.admitted[rid] = ev
        if not ev.wait(timeout=10):
            n = body["max_tokens"]
            return {"finish_reason": "length", "token_ids": [5] * n,
                    "logprobs": {"content": [{"logprob": -0.5}] * n}}
        return {"finish_reason": "abort", "token_ids": [5, 6],
                "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.7}]}}

    def abort(self, rids):
        with self.lock:
            self.abort_calls += 1
            for r in rids:
                if r in self.admitted:
                    self.admitted[r].set()


def test_abort_reaches_requests_admitted_after_it_and_skips_unsent_ones():
    client = _SlowAdmitClient()
    ps = SimpleNamespace(rank=0, tp_size=1, pp_size=1, cp_size=1)
    engine = VLLMEngine(client, ps, max_concurrency=2)
    box = {}
    sampling = SamplingParams(temperature=1.0, max_new_tokens=100, stop_token_ids=[], seed=1)
    t = threading.Thread(target=lambda: box.setdefault("s", engine.generate([[1, 2]], 4,
                                                                              sampling)))
    t.start()
    deadline = time.time() + 5
    while len(engine.in_flight) < 2 and time.time() < deadline:
        time.sleep(0.005)
    first = sorted(engine.in_flight)
    assert len(first) == 2
    # abort the two in flight (not yet admitted) and the two not yet sent
    all_ids = first + [f"{first[0].rsplit('-', 1)[0]}-{i}" for i in (2, 3)]
    engine.abort(all_ids)
    assert not engine.in_flight
    t.join(timeout=10)
    samples = box["s"]
    assert [s.finish_reason for s in samples] == ["abort"] * 4
    assert [len(s.response_ids) for s in samples] == [2, 2, 0, 0]
    assert client.sent == first  # the aborted, unsent two never reached the server
    assert client.abort_calls >= 2  # the first abort came before the server admitted them
    assert not engine._aborted  # forgotten once generate returned
