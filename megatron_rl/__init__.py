"""megatron-rl: RL post-training for LLMs and diffusion LLMs on Megatron-Core.

Importing the package loads no torch, megatron or sglang; import the submodules you need. It
installs one import hook (`megatron_rl/deferred_compile.py`): Megatron-Core's import-time
`torch.compile` decorations are built on first call, so `import megatron.core` skips importing
TorchDynamo and Inductor (~6 s of it on a CPU core).
"""

from megatron_rl import deferred_compile as _deferred_compile

__version__ = "0.1.0"
_deferred_compile.install()
