"""Typed configuration for every megatron-rl subsystem (stdlib only: imports without torch).

Dataclasses are the source of truth. YAML recipes in `examples/` map 1:1 onto them and dotted
command-line overrides (`algorithm.clip_ratio_high=0.28`, `data.train_files=[a.parquet]`) are
merged on top by `megatron_rl.cli` (OmegaConf structured configs; unknown keys are rejected with
the nearest valid name). Every field has a docstring under it. Checks live in `__post_init__` and
raise ValueError naming the field.

Sections, in the order of one RL step: model, parallel, data, rollout, reward, algorithm,
optimizer, trainer. `RLConfig` and `SFTConfig` compose them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"config field `{name}`: {msg}")


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class ModelConfig:
    path: str = ""
    """Local folder holding an HF checkpoint (config.json + safetensors [+ tokenizer files]).
    Empty means: build the tiny built-in model described by `tiny` (the embedded default)."""

    tiny: dict = field(
        default_factory=lambda: {
            "architectures": ["Qwen3ForCausalLM"],
            "hidden_size": 128,
            "intermediate_size": 384,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "max_position_embeddings": 512,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
        }
    )
    """HF-style config.json fields of the built-in tiny model used when `path` is empty. Its
    vocabulary size is taken from the tokenizer."""

    dtype: str = "auto"
    """Parameter/compute dtype: fp32 | bf16 | auto (bf16 on GPU, fp32 on CPU)."""

    attention_backend: str = "auto"
    """Core attention: auto (Transformer-Engine if importable, else torch SDPA/flex) | sdpa |
    flex | te | local (Megatron's unfused reference; debugging only)."""

    recompute: str = "none"
    """Activation recomputation: none | selective | full."""

    def __post_init__(self):
        _check(self.dtype in ("fp32", "bf16", "auto"), "model.dtype", f"got {self.dtype!r}")
        _check(
            self.attention_backend in ("auto", "sdpa", "flex", "te", "local"),
            "model.attention_backend",
            f"got {self.attention_backend!r}",
        )
        _check(self.recompute in ("none", "selective", "full"), "model.recompute", self.recompute)


# --------------------------------------------------------------------------------------------
# Parallelism
# --------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """TP degree (must divide attention heads, KV heads and the FFN width)."""

    pipeline_model_parallel_size: int = 1
    """PP degree (must divide the number of layers)."""

    expert_model_parallel_size: int = 1
    """EP degree for MoE models (must divide the number of experts)."""

    context_parallel_size: int = 1
    """CP degree (sequence split for long contexts)."""

    backend: str = "auto"
    """torch.distributed backend: auto (nccl with CUDA, gloo otherwise) | nccl | gloo."""

    seed: int = 1234
    """Seed of Megatron's model-parallel RNG tracker and of torch."""

    def __post_init__(self):
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "expert_model_parallel_size",
            "context_parallel_size",
        ):
            _check(getattr(self, name) >= 1, f"parallel.{name}", "must be >= 1")
        _check(self.backend in ("auto", "nccl", "gloo"), "parallel.backend", self.backend)


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class DataConfig:
    task: str = "synthetic_arithmetic"
    """Prompt source when no files are given: synthetic_arithmetic (built-in) or
    `reasoning_gym:<dataset>` (e.g. reasoning_gym:basic_arithmetic)."""

    train_files: list[str] = field(default_factory=list)
    """Parquet/jsonl prompt files in the verl/DAPO layout (`prompt`, `reward_model.ground_truth`).
    When set, they replace `task`."""

    val_files: list[str] = field(default_factory=list)
    """Held-out prompt files in the same layout (default: a held-out split of `task`)."""

    prompt_key: str = "prompt"
    """Column holding the prompt (chat messages or a string)."""

    train_batch_size: int = 8
    """Prompts per RL step (across all data-parallel ranks)."""

    max_prompt_length: int = 256
    """Prompts longer than this (in tokens) are an error naming the row."""

    num_train_examples: int = 20000
    """Size of the generated training set for synthetic / reasoning-gym tasks."""

    num_val_examples: int = 200
    """Size of the generated held-out set for synthetic / reasoning-gym tasks."""

    task_kwargs: dict = field(default_factory=dict)
    """Extra arguments for the task generator (e.g. digit ranges)."""

    shuffle: bool = True
    """Shuffle the training prompts (by `trainer.seed`, reproducible and resumable)."""

    def __post_init__(self):
        _check(self.train_batch_size >= 1, "data.train_batch_size", "must be >= 1")
        _check(self.max_prompt_length >= 1, "data.max_prompt_length", "must be >= 1")


# --------------------------------------------------------------------------------------------
# Rollout
# --------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class RolloutConfig:
    engine: str = "local"
    """Rollout engine: local (built-in, on the actor's own weights) | sglang (cluster) | vllm."""

    n: int = 8
    """Responses per prompt (the group size G)."""

    max_new_tokens: int = 64
    """Maximum response length in tokens."""

    temperature: float = 1.0
    """Sampling temperature (0 means greedy)."""

    top_p: float = 1.0
    """Nucleus sampling threshold."""

    top_k: int = -1
    """Top-k sampling (-1 disables it)."""

    stop: list[str] = field(default_factory=list)
    """Extra stop strings (EOS always stops)."""

    max_batch_size: int = 256
    """Most sequences decoded at once by the built-in engine (continuous batching refills it)."""

    val_temperature: float = 0.0
    """Temperature used for evaluation (0 = greedy pass@1)."""

    darts: bool = False
    """DARTS rollout shaping (docs/algorithms.md B.3-B.5): a redundant pool of samples per prompt,
    n kept by finishing order (the shortest and the `darts_long_end` longest), tail pruning;
    built-in engine only."""

    darts_redundancy: float = 1.25
    """Average pool size per prompt as a multiple of n (r-bar / M, B.4.3)."""

    darts_max_redundancy: float = 2.0
    """Largest pool of one prompt as a multiple of n (M_up / M)."""

    darts_long_end: int = 1
    """L_max: most of the last finishers (longest responses) kept per prompt."""

    darts_length_ema: float = 0.3
    """EMA weight alpha of a prompt's length spread across visits (B.4.1)."""

    def __post_init__(self):
        _check(self.engine in ("local", "sglang", "vllm"), "rollout.engine", self.engine)
        _check(self.n >= 1, "rollout.n", "must be >= 1")
        _check(self.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1")
        _check(self.temperature >= 0, "rollout.temperature", "must be >= 0")
        _check(0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
        _check(1.0 <= self.darts_redundancy <= self.darts_max_redundancy,
               "rollout.darts_redundancy", "must be in [1, rollout.darts_max_redundancy]")
        _check(self.darts_long_end >= 0, "rollout.darts_long_end", "must be >= 0")
        _check(0 < self.darts_length_ema <= 1, "rollout.darts_length_ema", "must be in (0, 1]")
        _check(not self.darts or self.engine == "local", "rollout.darts",
               "needs rollout.engine=local (the built-in engine)")


# --------------------------------------------------------------------------------------------
# Reward
# --------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class RewardConfig:
    name: str = "auto"
    """Reward function: auto (the task's own scorer) | math | exact_match | reasoning_gym |
    `package.module:function` (a user function, see megatron_rl.rewards)."""

    correct_reward: float = 1.0
    """Reward of a correct response."""

    incorrect_reward: float = 0.0
    """Reward of an incorrect response (DAPO uses -1)."""

    overlong_buffer_len: int = 0
    """DAPO overlong shaping buffer L_buf in tokens (0 disables it)."""

    overlong_penalty_factor: float = 1.0
    """DAPO overlong shaping factor lambda."""

    num_workers: int = 8
    """Threads scoring responses in parallel (math-verify is run off the main thread)."""

    diversity: str = "none"
    """DARLING diversity fusion (docs/algorithms.md A.5): none | multiplicative (r = q * Div', the
    DARLING rule) | additive (r = q + diversity_weight * Div')."""

    diversity_equivalence: str = "ngram_jaccard"
    """Pairwise equivalence predicate partitioning a group: text (normalized equality) |
    ngram_jaccard (DARLING's short-answer rule, else word n-gram Jaccard >= threshold) |
    `package.module:function` (a batched predicate, see megatron_rl.rewards.diversity)."""

    diversity_threshold: float = 0.5
    """Jaccard similarity at or above which two responses are the same class."""

    diversity_ngram: int = 2
    """Word n-gram size of the ngram_jaccard predicate."""

    diversity_floor: float = 0.1
    """Lower bound of the diversity score Div' (DARLING uses 0.1)."""

    diversity_weight: float = 1.0
    """Weight of Div' in the additive fusion (ignored by multiplicative)."""

    def __post_init__(self):
        _check(
            self.diversity in ("none", "multiplicative", "additive"),
            "reward.diversity",
            self.diversity,
        )
        _check(self.num_workers >= 1, "reward.num_workers", "must be >= 1")
        _check(self.overlong_buffer_len >= 0, "reward.overlong_buffer_len", "must be >= 0")
        _check(0 <= self.diversity_threshold <= 1, "reward.diversity_threshold", "must be in [0, 1]")
        _check(self.diversity_ngram >= 1, "reward.diversity_ngram", "must be >= 1")


# --------------------------------------------------------------------------------------------
# Algorithm
# --------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator: grpo | drgrpo | rloo (docs/algorithms.md notation)."""

    norm_adv_by_std: bool = True
    """Divide GRPO advantages by the group std (False = Dr.GRPO / DARLING mean-only)."""

    clip_ratio_low: float = 0.2
    """PPO epsilon_low."""

    clip_ratio_high: float = 0.2
    """PPO epsilon_high (DAPO clip-higher uses 0.28)."""

    clip_ratio_c: float = 3.0
    """Dual-clip constant c for negative advantages (<= 1 disables dual clip)."""

    loss_agg_mode: str = "token-mean"
    """Loss aggregation: token-mean | seq-mean-token-sum | seq-mean-token-mean |
    seq-mean-token-sum-norm (Dr.GRPO)."""

    kl_coef: float = 0.0
    """Coefficient of the KL-to-reference loss (0 disables the reference model)."""

    kl_estimator: str = "k3"
    """KL estimator: k1 | k3."""

    entropy_coef: float = 0.0
    """Entropy bonus coefficient (the entropy is always reported as a metric)."""

    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal and over-sample to refill."""

    max_resample_rounds: int = 4
    """Most extra generation rounds dynamic sampling may run to refill one batch."""

    def __post_init__(self):
        _check(
            self.adv_estimator in ("grpo", "drgrpo", "rloo"),
            "algorithm.adv_estimator",
            self.adv_estimator,
        )
        _check(
            self.loss_agg_mode
            in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
            "algorithm.loss_agg_mode",
            self.loss_agg_mode,
        )
        _check(self.kl_estimator in ("k1", "k3"), "algorithm.kl_estimator", self.kl_estimator)


# --------------------------------------------------------------------------------------------
# Optimizer
# --------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class OptimizerConfig:
    lr: float = 1e-6
    """Peak learning rate."""

    min_lr: float = 0.0
    """Learning rate at the end of the decay."""

    lr_warmup_steps: int = 0
    """Linear warmup in optimizer steps."""

    lr_decay_style: str = "constant"
    """constant | linear | cosine (over trainer.total_steps x optimizer steps per RL step)."""

    weight_decay: float = 0.0
    """AdamW weight decay."""

    adam_beta1: float = 0.9
    """AdamW beta1."""

    adam_beta2: float = 0.999
    """AdamW beta2."""

    adam_eps: float = 1e-8
    """AdamW epsilon."""

    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables it)."""

    use_distributed_optimizer: bool = False
    """Megatron's distributed (ZeRO-1) optimizer; recommended on GPU."""

    def __post_init__(self):
        _check(self.lr >= 0, "optimizer.lr", "must be >= 0")
        _check(
            self.lr_decay_style in ("constant", "linear", "cosine"),
            "optimizer.lr_decay_style",
            self.lr_decay_style,
        )


# --------------------------------------------------------------------------------------------
# Trainer (the loop)
# --------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class TrainerConfig:
    total_steps: int = 100
    """RL steps (one rollout each)."""

    mini_batches_per_step: int = 1
    """Optimizer steps per rollout (the rollout batch is split into this many mini-batches)."""

    epochs_per_step: int = 1
    """Passes over each rollout batch."""

    micro_batch_tokens: int = 8192
    """Token budget of one forward/backward micro-batch (packed)."""

    seed: int = 1
    """Seed of data order and sampling."""

    output_dir: str = "runs/default"
    """Folder for the resolved config, metrics, checkpoints and plots."""

    save_interval: int = 0
    """Save a checkpoint every this many steps (0: only at the end)."""

    eval_interval: int = 0
    """Evaluate on the held-out set every this many steps (0: only before and after)."""

    num_eval_examples: int = 200
    """Held-out prompts used per evaluation."""

    resume: bool = True
    """Resume from the newest checkpoint in output_dir when one exists."""

    init_from: str = ""
    """Start from this checkpoint folder (HF layout or a megatron-rl checkpoint), e.g. the SFT
    output; overrides model.path for the weights."""

    tensorboard: bool = True
    """Also write metrics to TensorBoard (they always go to metrics.jsonl)."""

    progress_bar: bool = True
    """Show a progress bar with step, reward, response length and tokens/s."""

    def __post_init__(self):
        _check(self.total_steps >= 0, "trainer.total_steps", "must be >= 0")
        _check(self.mini_batches_per_step >= 1, "trainer.mini_batches_per_step", "must be >= 1")
        _check(self.micro_batch_tokens >= 1, "trainer.micro_batch_tokens", "must be >= 1")


# --------------------------------------------------------------------------------------------
# SFT
# --------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class SFTOptions:
    epochs: float = 1.0
    """Passes over the SFT data (fractional allowed)."""

    batch_size: int = 32
    """Examples per optimizer step (across data-parallel ranks)."""

    loss: str = "auto"
    """auto (the model family picks: causal LM, masked diffusion or block diffusion)."""

    diffusion_eps: float = 1e-3
    """Diffusion LMs: floor of the mask ratio, p = (1 - eps) t + eps (docs/algorithms.md C.0.3)."""

    diffusion_pad_eos: int = 0
    """Diffusion LMs: pad every response with EOS to at least this many tokens, trained on like
    any response token (LLaDA SFT); 0 disables it."""

    diffusion_mask_impl: str = "kernel"
    """Block diffusion: the C.2 attention mask as the kernel-built BlockMask (kernel) or built
    from the dense [L, L] mask (dense; for comparison only)."""

    diffusion_sampler: dict = field(default_factory=dict)
    """Diffusion LMs: overrides of the held-out sampler (rollout.diffusion.DiffusionSampling
    fields, e.g. {block_size: 8, steps_per_block: 8, threshold: 0.9}); defaults by family."""

    lora_rank: int = 0
    """LoRA adapter rank on the tensor-parallel linears (megatron_rl.lora); 0 trains all weights.
    The adapters are merged into the weights before the HF export."""

    lora_alpha: float = 16.0
    """LoRA scale numerator: the adapter output is multiplied by lora_alpha / lora_rank."""

    lora_targets: list[str] = field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    )
    """Megatron linear names that get adapters (MoE expert linears are never adapted)."""


# --------------------------------------------------------------------------------------------
# Top level
# --------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class RLConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Model parallelism."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Rewards."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages and the policy loss."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and LR schedule."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The loop: steps, batching, logging, checkpoints."""


@dataclass(kw_only=True)
class SFTConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to fine-tune."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Model parallelism."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt/response data (files with `prompt` and `response`, or a task's reference answers)."""
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-3))
    """Optimizer and LR schedule."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Batching, logging, checkpoints (total_steps is derived from sft.epochs when 0)."""
    sft: SFTOptions = field(default_factory=SFTOptions)
    """SFT-specific options."""


def to_dict(cfg) -> dict:
    """Plain nested dict of a config (for YAML dumps and logging)."""
    return dataclasses.asdict(cfg)
