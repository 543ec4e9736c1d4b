"""An engine server this run launched (rollout/http.py ServerProcess) dies with the trainer:
a `kill -9` of the process that started it leaves no server behind holding memory."""

import os
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAUNCHER = """
import sys, time
from megatron_rl.rollout.http import ServerProcess, free_port
port = free_port()
srv = ServerProcess([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                    env=None, health_url=f"http://127.0.0.1:{port}/", log_path=sys.argv[1])
srv.start(timeout_s=60)
print(srv.proc.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its reaper is gone too
        return f.read().split()[2] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_server_dies_with_a_killed_launcher(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO)
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path / "srv.log")],
                                env=env, stdout=subprocess.PIPE, text=True)
    server_pid = int(launcher.stdout.readline())
    assert _alive(server_pid)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.time() + 20
    while _alive(server_pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(server_pid), "the server outlived the process that launched it"
