#!/usr/bin/env bash
# The README's test command: set everything up, then run the CPU test suite (lint included).
#   bash tools/test.sh              # everything CI runs
#   bash tools/test.sh -k parity    # extra pytest arguments pass through
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The test extras plus `launch` (NeMo-Run: tests/e2e/test_launch.py launches a real 2-rank job).
export MEGATRON_RL_EXTRAS="${MEGATRON_RL_EXTRAS:-test,launch}"
# Three independent setups run side by side (they share no files): our own virtualenv in this
# shell, which everything needs first, and in the background the two that only two late tests
# need, so pytest starts without waiting for them: the vllm rollout engine's server virtualenv
# (its pins differ from ours; tests/e2e/test_vllm_engine.py drives a real one) and Chromium for
# tests/e2e/test_report.py's headless page check (Debian's package). Each background step
# leaves NAME.log and, once finished, NAME.rc (its exit status) in $MEGATRON_RL_SETUP_STATUS;
# those tests wait for NAME.rc (tests/helpers.py: wait_for_setup) and fail showing the log if
# the step failed. Their logs are printed after pytest.
export MEGATRON_RL_SETUP_STATUS="$(mktemp -d)"
background() {  # NAME COMMAND...
  local name=$1; shift
  ( rc=0; "$@" >"$MEGATRON_RL_SETUP_STATUS/$name.log" 2>&1 || rc=$?
    echo "$rc" >"$MEGATRON_RL_SETUP_STATUS/$name.rc.tmp"
    mv "$MEGATRON_RL_SETUP_STATUS/$name.rc.tmp" "$MEGATRON_RL_SETUP_STATUS/$name.rc" ) &
}
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
background vllm bash "$ROOT/tools/setup_vllm.sh"
background chromium install_chromium
source "$ROOT/tools/setup_env.sh"
cd "$ROOT"
echo "[test] setup of .venv done in ${SECONDS} s (vllm and chromium go on beside pytest)"
echo "[test] ruff"
ruff check megatron_rl tests tools examples
echo "[test] pytest"
# Two pytest workers (pytest-xdist), each taking whole modules (module fixtures run once; xdist
# hands out the modules with most tests first), one torch thread each (tests that start
# processes set their threads themselves). More cores: `-n 4`. OpenMP threads wait passively
# (sleep instead of spinning): with two workers and their child processes the cores are
# oversubscribed, and spinning threads of one process burned the CPU another needed (the
# quickstart test alone: 206 s of CPU spinning vs 129 s passive, for 130 s vs 118 s of wall).
# The wait policy changes no number. (Starting the modules with slow tests first was slower:
# their multi-process runs then all overlapped.)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
RC=0
python -m pytest tests -m "not gpu" -q -ra --durations=25 -n 2 --dist loadfile "$@" \
  || RC=$?
wait  # the background setup steps (finished long before their tests, as a rule)
for name in vllm chromium; do
  echo "[test] background setup $name: exit $(cat "$MEGATRON_RL_SETUP_STATUS/$name.rc")"
  grep -v '^debconf\|^dpkg-preconfigure\|^$' "$MEGATRON_RL_SETUP_STATUS/$name.log" | tail -5 || true
done
VLLM_RC=$(cat "$MEGATRON_RL_SETUP_STATUS/vllm.rc")
if [ "$RC" = 0 ] && [ "$VLLM_RC" != 0 ]; then
  echo "[test] tools/setup_vllm.sh failed (exit $VLLM_RC): the end of its output is above"
  RC=$VLLM_RC
fi
exit "$RC"
