"""megatron-rl: RL post-training for LLMs and diffusion LLMs on Megatron-Core.

Importing the package loads no torch, megatron or sglang; import the submodules you need.
"""

__version__ = "0.1.0"
