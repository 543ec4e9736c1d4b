#!/usr/bin/env bash
# One device call on the H200: bring the wheels in, build csrc, then run the benchmarks named on
# the command line in order (each one's JSON lines go to $OUT/results.jsonl, its log to $OUT/log).
#   bash tools/bench/h200_session.sh peer_packed peer_padded moe trl
set -uo pipefail
OUT="${OUT:-/tmp/h200_out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
# A warm machine keeps /tmp/site and the built extension between calls: set up only once.
if [ ! -f /tmp/site/.megatron_rl_wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >>"$OUT/log" 2>&1 || { echo "wheel install failed"; exit 1; }
  touch /tmp/site/.megatron_rl_wheels
fi
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
csrc_hash=$(cat setup.py $(find csrc -type f | sort) | sha1sum | cut -c1-16)
if ! ls megatron_rl/_C.cpython-31[2-9]*.so >/dev/null 2>&1 \
    || [ "$(cat /tmp/site/.csrc_hash 2>/dev/null)" != "$csrc_hash" ]; then
  TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 setup.py build_ext --inplace >>"$OUT/log" 2>&1 \
    || { echo "csrc build failed"; tail -30 "$OUT/log"; exit 1; }
  echo "$csrc_hash" >/tmp/site/.csrc_hash
fi
echo "[h200] setup done in $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
run() {  # name, command...
  local name=$1; shift
  local s=$(date +%s)
  echo "[h200] $name: $*" | tee -a "$OUT/log"
  "$@" 2>>"$OUT/log" | tee -a "$OUT/log" | grep '^{' >>"$OUT/results.jsonl"
  # (in the log too: a call cut by its time limit returns $OUT but not its stdout)
  echo "[h200] $name done in $(( $(date +%s) - s )) s (rc ${PIPESTATUS[0]})" | tee -a "$OUT/log"
}
for stage in "$@"; do
  case $stage in
    peer_packed) run "$stage" python3 tools/bench/rl_step.py --peer --layout packed ;;
    peer_padded) run "$stage" python3 tools/bench/rl_step.py --peer --layout padded ;;
    peer_triton) run "$stage" python3 tools/bench/rl_step.py --peer --layout padded --kernels triton ;;
    peer_mb40k) run "$stage" python3 tools/bench/rl_step.py --peer --layout padded --micro-batch-tokens 40960 ;;
    peer_mb40k_tiles) run "$stage" python3 tools/bench/rl_step.py --peer --layout padded --micro-batch-tokens 40960 \
           --decode-tiles 32,2,3,1 ;;
    peer_mb16k) run "$stage" python3 tools/bench/rl_step.py --peer --layout padded --micro-batch-tokens 16384 ;;
    peer_compiled) run "$stage" python3 tools/bench/rl_step.py --peer --layout padded --kernels compiled ;;
    peer_best_tiles)  # the step with attn_tiles' best (shared-prompt) launch, earlier in this call
      t=$(python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1]) if '\"best\": true' in l and '\"shared\": true' in l][-1]; print(','.join(map(str, [*r['tiles'], r['splits']])))" "$OUT/results.jsonl") \
        && run "$stage" python3 tools/bench/rl_step.py --peer --layout padded --decode-tiles "$t" ;;
    peer_unshared) run "$stage" python3 tools/bench/rl_step.py --peer --layout padded --no-share-prompts ;;
    peer_compiled_sampler) run "$stage" python3 tools/bench/rl_step.py --peer --layout padded \
           --compiled-sampler ;;
    peer_profile) run "$stage" python3 tools/bench/rl_step.py --peer --layout padded --steps 8 \
           --profile-step 8 ;;
    peer_nographs) run "$stage" python3 tools/bench/rl_step.py --peer --layout packed --no-keep-graphs ;;
    moe) run "$stage" python3 tools/bench/actor.py --shape 30b-a3b-cut --backend auto --recompute none \
           --experts grouped --experts sequential --steps 4 --warmup 2 ;;
    moe2) run "$stage" python3 tools/bench/actor.py --shape 30b-a3b-cut --num-layers 2 --backend auto \
           --recompute none --experts grouped --experts sequential --steps 4 --warmup 2 ;;
    layouts) run "$stage" python3 tools/bench/actor_layouts.py ;;
    layouts_kernels) run "$stage" python3 tools/bench/actor_layouts.py --kernels compiled --kernels triton ;;
    layouts_kernels_profile) run "$stage" python3 tools/bench/actor_layouts.py --kernels triton --steps 2 \
           --warmup 2 --profile 30 ;;
    gpu_ops) run "$stage" python3 -m pytest -m gpu tests/ops -q -ra -p no:cacheprovider ;;
    gpu_kernels) run "$stage" python3 -m pytest -m gpu tests/unit/test_norm.py tests/unit/test_fused_triton.py \
           -q -ra -p no:cacheprovider ;;
    layouts_profile) run "$stage" python3 tools/bench/actor_layouts.py --steps 2 --warmup 2 --profile 30 ;;
    layouts_small) run "$stage" python3 tools/bench/actor_layouts.py --prompt 16 --median 40 --sigma 0.7 \
           --max-new 400 --steps 3 --warmup 2 --profile 25 ;;
    sync_probe) run "$stage" python3 tools/bench/sync_probe.py ;;
    layouts_paths) run "$stage" python3 tools/bench/actor_layouts.py --output-path fused --output-path module ;;
    rollout64) run "$stage" python3 tools/bench/rollout.py --prompts 64 --prompt-len 96 --new 512 --skip-hf --profile 25 ;;
    rollout_ab) run "$stage" python3 tools/bench/rollout.py --prompts 64 --prompt-len 96 --new 512 --skip-hf \
           --decode-attention triton --decode-attention torch ;;
    gpu_dec) run "$stage" python3 -m pytest -m gpu tests/unit/test_decode_attention.py tests/unit/test_engine.py \
           tests/unit/test_darts_streaming.py tests/unit/test_patches.py tests/unit/test_models_builder.py \
           -q -ra -p no:cacheprovider ;;
    gpu_new) run "$stage" python3 -m pytest -m gpu tests/unit/test_decode_attention.py -q -ra \
           -p no:cacheprovider -k "shared or exp_race or deferred" ;;
    gpu_defer) run "$stage" python3 -m pytest -m gpu tests/unit/test_decode_attention.py -q -ra \
           -p no:cacheprovider ;;
    rollout) run "$stage" python3 tools/bench/rollout.py ;;
    attn_splits) run "$stage" python3 tools/bench/decode_attention_splits.py ;;
    attn_tiles) run "$stage" python3 tools/bench/decode_attention_splits.py --tiles ;;
    decode_gemm) run "$stage" python3 tools/bench/decode_gemm.py ;;
    rollout_splits) run "$stage" python3 tools/bench/rollout.py --prompts 64 --prompt-len 96 --new 512 --skip-hf \
           --decode-attention triton --attention-splits 1 --attention-splits 2 --attention-splits 4 ;;
    gpu_outlp) run "$stage" python3 -m pytest -m gpu tests/unit/test_output_logprobs.py -q -ra -p no:cacheprovider ;;
    layouts_uniform) run "$stage" python3 tools/bench/actor_layouts.py --uniform ;;
    actor) run "$stage" python3 tools/bench/actor.py --shape 1.7b --backend auto --recompute none ;;
    trl) run "$stage" python3 tools/bench/trl_grpo_peer.py --steps 7 ;;
    trl5) run "$stage" python3 tools/bench/trl_grpo_peer.py --steps 5 ;;
    darts) run "$stage" python3 tools/bench/darts.py --out /tmp/darts --stack-dump-s 120 ;;
    darts_short) run "$stage" python3 tools/bench/darts.py --out /tmp/darts --stack-dump-s 60 \
           --sft-steps 60 --steps 4 --arms grpo_s0,darts_s0 ;;
    darts4) run "$stage" python3 tools/bench/darts.py --out /tmp/darts --stack-dump-s 120 \
           --sft-steps 60 --steps 10 --mini-batches 2 ;;
    darts4_mb1) run "$stage" python3 tools/bench/darts.py --out /tmp/darts1 --stack-dump-s 120 \
           --sft-steps 60 --steps 10 --mini-batches 1 --arms grpo_s0,grpo_s1,darts_nostream_s0 ;;
    darts_tail) run "$stage" python3 tools/bench/darts.py --out /tmp/darts_tail --stack-dump-s 120 \
           --sft-steps 60 --steps 10 --mini-batches 1 --max-new 1024 --filler-sigma 1.5 \
           --micro-batch-tokens 16384 \
           --arms grpo_s0,grpo_s1,darts_nostream_s0 ;;
    darts_tail_mb2) run "$stage" python3 tools/bench/darts.py --out /tmp/darts_mb2 --stack-dump-s 120 \
           --sft-steps 60 --steps 10 --mini-batches 2 --max-new 1024 --filler-sigma 1.5 \
           --micro-batch-tokens 16384 --arms grpo_s0,darts_s0,darts_nostream_s0 ;;
    weight_sync) run "$stage" python3 tools/bench/weight_sync.py ;;
    dllm_rl) run "$stage" python3 tools/bench/dllm_rl.py --device cuda ;;
    gpu_resume) run "$stage" python3 -m pytest -m gpu tests/e2e/test_kill_resume.py -q -ra -p no:cacheprovider ;;
    gpu_attn) run "$stage" python3 -m pytest -m gpu tests/unit/test_models_attention.py -q -ra -p no:cacheprovider ;;
    gpu_tests) run "$stage" python3 -m pytest -m gpu tests -q -ra -p no:cacheprovider ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
echo "[h200] total $(( $(date +%s) - t0 )) s"
