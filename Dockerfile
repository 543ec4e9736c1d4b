# syntax=docker/dockerfile:1.7
# megatron-rl cluster image: NGC PyTorch base + the GPU stack pinned together with the project.
#
#   docker build -t megatron-rl:0.1.0 .
#   docker build --build-arg SGLANG_VERSION=... --build-arg TORCH_VERSION=... -t megatron-rl:dev .
#
# What is pinned and why (docs/launch.md has the full matrix; tests/unit/test_dockerfile.py checks
# these against setup.py, megatron-core's own metadata and the SGLang version the engine targets):
# - SGLang wheels pin one exact torch (sglang 0.5.23: torch==2.14.1, sglang-kernel 0.4.10,
#   flashinfer 0.7.2, transformers 5.19.0). NGC's torch is a pre-release build (2.10.0a0+... in
#   25.12) that satisfies no `torch==` pin, so the NGC torch stack is replaced by the torch SGLang
#   pins, and everything compiled against torch (Transformer-Engine's torch extension, apex,
#   flash-attn, megatron-rl's csrc) is rebuilt here against it. The base still provides CUDA 13.1,
#   cuDNN, NCCL, nvcc and the compilers.
# - Transformer-Engine: newest release inside megatron-core 0.16.1's declared range (>=2.9,<2.12).
# - NVIDIA apex from its git repository at a fixed commit. Never `pip install apex`: the PyPI
#   package of that name is an unrelated project.
# - megatron-core 0.16.1 and nemo-run 0.11.1: the project's own pins (setup.py).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.12-py3
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.14.1
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG SGLANG_VERSION=0.5.23
ARG TE_VERSION=2.11.0
ARG APEX_COMMIT=6424da3b4faa6c8f062da4a48c424fff3f02d42d
ARG FLASH_ATTN_VERSION=2.8.3.post2
ARG MEGATRON_CORE_VERSION=0.16.1
ARG NEMO_RUN_VERSION=0.11.1
ARG TORCH_CUDA_ARCH_LIST="9.0"
ARG MAX_JOBS=16

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    MAX_JOBS=${MAX_JOBS}

# 1. Remove NGC's torch stack and every package compiled against it, and NGC's pip constraints
#    file (it pins exactly those packages to the NGC builds).
RUN pip uninstall -y torch torchvision torchaudio pytorch-triton triton torch-tensorrt \
        transformer_engine transformer-engine transformer_engine_torch transformer_engine_cu12 \
        transformer_engine_cu13 apex flash_attn flash-attn megatron-core pytorch-quantization \
        || true \
    && rm -f /etc/pip/constraint.txt
ENV PIP_CONSTRAINT=

# 2. torch as SGLang pins it, then SGLang (its sglang-kernel / flashinfer wheels match that torch).
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
    && pip install "sglang==${SGLANG_VERSION}" "torch==${TORCH_VERSION}" \
    && python -c "import torch; assert torch.__version__.split('+')[0] == '${TORCH_VERSION}', torch.__version__"

# 3. Transformer-Engine: prebuilt core library + its torch extension built against this torch.
RUN NVTE_FRAMEWORK=pytorch pip install --no-build-isolation \
        "transformer_engine[pytorch,core_cu13]==${TE_VERSION}" "torch==${TORCH_VERSION}"

# 4. NVIDIA apex from source (fused Adam / norms; megatron-core uses them when importable).
RUN git clone https://github.com/NVIDIA/apex.git /tmp/apex \
    && cd /tmp/apex && git checkout "${APEX_COMMIT}" \
    && APEX_CPP_EXT=1 APEX_CUDA_EXT=1 APEX_PARALLEL_BUILD="${MAX_JOBS}" \
       pip install -v --no-build-isolation . \
    && cd / && rm -rf /tmp/apex

# 5. flash-attn (needed by megatron-core's dynamic inference engine and TE's flash backend).
RUN pip install --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}" "torch==${TORCH_VERSION}"

# 6. The project: megatron-core at the pinned version, then megatron-rl (csrc built with CUDA)
#    with the NeMo-Run launch extra, so run.Partial tasks can run inside the container.
COPY . /opt/megatron-rl
WORKDIR /opt/megatron-rl
RUN pip install "megatron-core==${MEGATRON_CORE_VERSION}" "torch==${TORCH_VERSION}" \
    && pip install --no-build-isolation -e ".[launch]" "torch==${TORCH_VERSION}" \
        "megatron-core==${MEGATRON_CORE_VERSION}" "nemo-run==${NEMO_RUN_VERSION}"

# 7. Fail the build, not the first job, if any piece is missing or was replaced on the way.
RUN python - <<EOF
import importlib.metadata as md
import torch, transformer_engine.pytorch, apex, flash_attn, sglang, megatron.core, nemo_run
import megatron_rl._C
want = {"torch": "${TORCH_VERSION}", "sglang": "${SGLANG_VERSION}",
        "megatron-core": "${MEGATRON_CORE_VERSION}", "nemo-run": "${NEMO_RUN_VERSION}",
        "flash-attn": "${FLASH_ATTN_VERSION}", "transformer-engine": "${TE_VERSION}"}
for name, version in want.items():
    got = md.version(name).split("+")[0]
    assert got == version, f"{name}: image has {got}, Dockerfile pins {version}"
assert torch.version.cuda, "torch in the image has no CUDA"
print("megatron-rl image OK:", want)
EOF

ENV PYTHONUNBUFFERED=1
CMD ["megatron-rl", "--help"]
