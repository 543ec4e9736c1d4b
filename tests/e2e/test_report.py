"""`megatron-rl report` and `megatron-rl inspect` on a quickstart-like run folder.

The run folder is synthesized in the quickstart's shape (tests/rollout_data.py: 60 GRPO steps of
64 prompts x 8 samples in rollouts.zarr, metrics.jsonl with evaluations before and after,
config.yaml). The report page is loaded in headless Chromium, driven over the DevTools
protocol on a pipe (no network, no extra Python package): the page must raise no console
error or exception, show the curves (SVG paths with points), the per-step distribution bands
and at least one rollout row whose text is the stored response, and its screenshot must not be
blank. An SFT run (metrics only) must load cleanly too.

Chromium comes from Debian (`apt-get install -y chromium`); the browser test is skipped, saying
so, only when no chromium binary is installed.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests"))
from helpers import wait_for_setup  # noqa: E402
from rollout_data import write_run  # noqa: E402


def chromium() -> str | None:
    """The browser's path (tools/test.sh installs it beside the first tests: wait for that)."""
    wait_for_setup("chromium")
    return shutil.which("chromium") or shutil.which("chromium-browser")


def cli(capsys, *args) -> str:
    """`megatron-rl ARGS` in this process (the subcommand table of cli.py included)."""
    from megatron_rl.cli import main

    capsys.readouterr()
    assert main(list(args)) == 0, capsys.readouterr().err
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "quickstart" / "grpo"
    write_run(str(run), 60)
    return run


class Browser:
    """Headless Chromium over --remote-debugging-pipe: CDP JSON messages, NUL-terminated, on
    fds 3 (commands in) and 4 (replies and events out)."""

    def __init__(self, binary, profile_dir):
        cmd_r, self._cmd_w = os.pipe()
        self._out_r, out_w = os.pipe()

        def fds():  # in the child, before exec: the pipe ends become fds 3 and 4
            os.dup2(cmd_r, 3)
            os.dup2(out_w, 4)

        self.proc = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--no-default-browser-check", "--disable-extensions", "--hide-scrollbars",
             "--remote-debugging-pipe", f"--user-data-dir={profile_dir}", "about:blank"],
            preexec_fn=fds, pass_fds=(3, 4), stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        os.close(cmd_r)
        os.close(out_w)
        self._buf, self._id, self.events = b"", 0, []

    def _read(self) -> dict:
        while b"\0" not in self._buf:
            chunk = os.read(self._out_r, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method: str, params=None, session=None) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self.events.append(reply)

    def wait_event(self, method: str):
        while True:
            msg = self._read()
            self.events.append(msg)
            if msg.get("method") == method:
                return msg

    def close(self):
        try:
            self.send("Browser.close")
        except RuntimeError:
            pass
        self.proc.wait(timeout=30)


def load(browser: Browser, path: str, png: str) -> dict:
    """Open a page; return its DOM facts and console errors, write its screenshot."""
    target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    s = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    for domain in ("Runtime", "Log", "Page"):
        browser.send(f"{domain}.enable", session=s)
    browser.send("Emulation.setDeviceMetricsOverride",
                 {"width": 1280, "height": 600, "deviceScaleFactor": 1, "mobile": False}, s)
    browser.events.clear()
    browser.send("Page.navigate", {"url": f"file://{path}"}, s)
    browser.wait_event("Page.loadEventFired")
    height = browser.send("Runtime.evaluate", {"returnByValue": True, "expression":
                          "document.documentElement.scrollHeight"}, s)["result"]["value"]
    browser.send("Emulation.setDeviceMetricsOverride",  # the whole page in one screenshot
                 {"width": 1280, "height": min(height, 12000), "deviceScaleFactor": 1,
                  "mobile": False}, s)
    facts = browser.send("Runtime.evaluate", {"returnByValue": True, "expression": """({
        rendered: document.body.getAttribute("data-rendered"),
        title: document.title,
        curvePaths: [...document.querySelectorAll("#curves svg path")]
            .map(p => p.getAttribute("d").split("L").length),
        markers: document.querySelectorAll("#curves svg circle").length,
        bands: document.querySelectorAll("#dist svg polygon").length,
        rows: [...document.querySelectorAll("#rollouts table.samples tbody tr")].map(tr => {
            const r = tr.getBoundingClientRect();
            return {text: tr.children[1].textContent, w: r.width, h: r.height};
        }),
        box: (() => { const r = document.getElementById("rollouts").getBoundingClientRect();
                      return [r.left, r.top + window.scrollY, r.right, r.bottom + window.scrollY];
                    })(),
        external: [...document.querySelectorAll("[src],[href]")]
            .map(e => e.getAttribute("src") || e.getAttribute("href"))
            .filter(u => !u.startsWith("data:")),
    })"""}, s)["result"]["value"]
    shot = browser.send("Page.captureScreenshot", {"format": "png"}, s)["data"]
    import base64

    with open(png, "wb") as f:
        f.write(base64.b64decode(shot))
    errors = []
    for e in browser.events:
        m, p = e.get("method"), e.get("params", {})
        if m == "Runtime.exceptionThrown":
            errors.append(p["exceptionDetails"].get("text", "exception"))
        elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            errors.append(str(p.get("args")))
        elif m == "Log.entryAdded" and p["entry"].get("level") == "error":
            errors.append(p["entry"].get("text"))
    browser.send("Target.closeTarget", {"targetId": target})
    return {**facts, "errors": errors}


def assert_not_blank(png: str, box=None, min_ink: float = 0.02) -> None:
    """Enough non-white pixels, in enough colours (in `box` = [left, top, right, bottom])."""
    import matplotlib.image

    img = matplotlib.image.imread(png)[..., :3]
    if box is not None:
        left, top, right, bottom = (int(v) for v in box)
        img = img[top:bottom, left:right]
    assert img.size, box
    ink = (img < 0.9).any(axis=-1).mean()  # pixels that are not (near) white
    colors = len(np.unique((img * 255).astype(np.uint8).reshape(-1, 3), axis=0))
    assert ink > min_ink and colors > 30, (png, box, ink, colors)


def test_report_page_in_headless_chromium(run_dir, tmp_path, capsys):
    binary = chromium()
    if binary is None:
        pytest.skip("chromium is not installed: apt-get update && apt-get install -y chromium")
    out = cli(capsys, "report", str(run_dir), "--steps", "5", "--groups", "4").strip()
    assert out == str(run_dir / "report.html")
    sft = tmp_path / "quickstart" / "sft"
    sft.mkdir(parents=True)
    rows = [{"step": s, "sft/loss": 3.0 / s, "sft/grad_norm": 1.0} for s in range(1, 101)]
    rows.append({"step": 101, "eval/pass_at_1": 0.0})
    (sft / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cli(capsys, "report", str(sft))
    from megatron_rl.data.store_reader import RolloutReader

    last = RolloutReader(str(run_dir)).read_step(60)
    browser = Browser(binary, tmp_path / "profile")
    try:
        grpo = load(browser, str(run_dir / "report.html"), str(tmp_path / "grpo.png"))
        sft_page = load(browser, str(sft / "report.html"), str(tmp_path / "sft.png"))
    finally:
        browser.close()
    assert grpo["errors"] == [] and sft_page["errors"] == []
    assert grpo["rendered"] == "1" and grpo["title"].startswith("quickstart/grpo")
    assert grpo["external"] == []  # self-contained
    # curves: reward (2 series), length (2), pass@1 (2 points, markers), pg loss: 60 points each
    assert sum(n >= 60 for n in grpo["curvePaths"]) >= 5 and grpo["markers"] >= 2
    assert grpo["bands"] == 4  # reward and length: 10-90 and 25-75 percentile bands
    rows = grpo["rows"]
    assert len(rows) == 4 * 8 and all(r["w"] > 100 and r["h"] > 5 for r in rows)
    assert rows[0]["text"] == last.response_texts[0]  # the last step is shown first
    assert_not_blank(str(tmp_path / "grpo.png"))
    assert_not_blank(str(tmp_path / "grpo.png"), box=grpo["box"], min_ink=0.05)  # the rollouts
    assert sft_page["rendered"] == "1" and max(sft_page["curvePaths"]) >= 100
    assert sft_page["rows"] == []
    assert_not_blank(str(tmp_path / "sft.png"))


def test_inspect_prints_a_step(run_dir, capsys):
    table = cli(capsys, "inspect", str(run_dir)).splitlines()
    assert table[0].split() == ["step", "samples", "prompts", "reward", "length"]
    assert len(table) == 61 and table[-1].split()[:3] == ["60", "512", "64"]
    from megatron_rl.data.store_reader import RolloutReader

    st = RolloutReader(str(run_dir)).read_step(7)
    out = cli(capsys, "inspect", str(run_dir), "--step", "7", "--groups", "2")
    assert out.startswith("step 7: 512 samples, 64 prompts")
    assert out.count("\n== ") == 2 and "(62 more prompts" in out
    first = st.samples[0]
    assert f"== {first.group_id}   ground truth: {json.dumps(first.ground_truth)}" in out
    line = next(x for x in out.splitlines() if x.startswith("   [  0]"))
    assert f"r={first.reward:.4g}" in line and f"adv={st.advantages[0]:+.3f}" in line
    assert f"partition_class={st.extra['partition_class'][0]}" in line
    assert line.endswith(repr(st.response_texts[0]))
    gid = RolloutReader(str(run_dir)).read_step(60).samples[-1].group_id
    one = cli(capsys, "inspect", str(run_dir), "--step", "last", "--group-id", gid)
    assert one.count("\n== ") == 1 and one.count("\n   [") == 8
