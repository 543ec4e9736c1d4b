#!/usr/bin/env bash
# The README's test command: set everything up, then run the CPU test suite (lint included).
#   bash tools/test.sh              # everything CI runs
#   bash tools/test.sh -k parity    # extra pytest arguments pass through
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The test extras plus `launch` (NeMo-Run: tests/e2e/test_launch.py launches a real 2-rank job).
export MEGATRON_RL_EXTRAS="${MEGATRON_RL_EXTRAS:-test,launch}"
# Three independent setups run side by side (they share no files): the vllm rollout engine's
# server virtualenv (its pins differ from ours; tests/e2e/test_vllm_engine.py drives a real one),
# Chromium for tests/e2e/test_report.py's headless page check (Debian's package), and our own
# virtualenv in this shell. The two background jobs' output is printed once they finish.
LOGS="$(mktemp -d)"
bash "$ROOT/tools/setup_vllm.sh" >"$LOGS/vllm" 2>&1 &
VLLM_PID=$!
install_chromium() {
  if command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then
    return 0
  fi
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "[test] installing chromium (apt) for the report page test"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium \
        >/dev/null; } || echo "[test] chromium could not be installed: the browser test will be skipped"
  else
    echo "[test] no chromium and no root apt-get: the report browser test will be skipped"
  fi
}
install_chromium >"$LOGS/chromium" 2>&1 &
CHROMIUM_PID=$!
source "$ROOT/tools/setup_env.sh"
cd "$ROOT"
VLLM_RC=0
wait "$VLLM_PID" || VLLM_RC=$?
cat "$LOGS/vllm"
if [ "$VLLM_RC" != 0 ]; then
  echo "[test] tools/setup_vllm.sh failed (exit $VLLM_RC): its output is above"
  exit "$VLLM_RC"
fi
wait "$CHROMIUM_PID" || true  # (it never fails the run: the browser test skips without it)
grep -v '^debconf\|^dpkg-preconfigure\|^$' "$LOGS/chromium" || true
echo "[test] setup done in ${SECONDS} s"
echo "[test] ruff"
ruff check megatron_rl tests tools examples
echo "[test] pytest"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python -m pytest tests -m "not gpu" -q -ra --durations=25 "$@"
