"""Quality reward for open-ended prompts from a reward-model server (DARLING's quality term).

    reward:
      name: examples/llama31_8b_darling/reward.py:quality

The server is yours (any reward model behind HTTP): `POST $MEGATRON_RL_REWARD_URL` with
`{"prompts": [...], "responses": [...]}` answers `{"scores": [float, ...]}`, one score per
response. A group reward (megatron_rl.rewards.group_reward): the G responses of one prompt go in
one request. Timeouts are retried with backoff; then the error names the URL. An unset URL is
an error at the first call, never a silent zero reward.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request

from megatron_rl.rewards import group_reward

TIMEOUT_S, RETRIES, BACKOFF_S = 60.0, 3, 2.0


@group_reward
def quality(responses, ground_truths, *, prompts, samples):
    url = os.environ.get("MEGATRON_RL_REWARD_URL", "")
    if not url:
        raise ValueError("examples/llama31_8b_darling/reward.py: set MEGATRON_RL_REWARD_URL to "
                         "the reward-model server (POST {prompts, responses} -> {scores})")
    body = json.dumps({"prompts": list(prompts), "responses": list(responses)}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    for attempt in range(RETRIES + 1):
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as r:
                scores = json.loads(r.read())["scores"]
            break
        except (urllib.error.URLError, TimeoutError) as e:
            if attempt == RETRIES:
                raise RuntimeError(f"reward server {url}: {e} after {RETRIES + 1} attempts") from e
            time.sleep(BACKOFF_S * 2**attempt)
    if len(scores) != len(responses):
        raise ValueError(f"reward server {url}: {len(scores)} scores for {len(responses)} responses")
    return [float(s) for s in scores]
