#!/usr/bin/env bash
# The README's test command: set everything up, then run the CPU test suite (lint included).
#   bash tools/test.sh              # everything CI runs
#   bash tools/test.sh -k parity    # extra pytest arguments pass through
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/tools/setup_env.sh"
cd "$ROOT"
# The vllm rollout engine's server runs from a virtualenv of its own (its pins differ from ours);
# tests/e2e/test_vllm_engine.py drives a real one.
bash "$ROOT/tools/setup_vllm.sh"
echo "[test] ruff"
ruff check megatron_rl tests tools examples
echo "[test] pytest"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python -m pytest tests -m "not gpu" -q -ra --durations=25 "$@"
