#!/usr/bin/env bash
# The README's main command: set everything up, then run the embedded default end to end on CPU:
#   1. SFT the tiny built-in model on the synthetic arithmetic task (warm start),
#   2. GRPO from that checkpoint with the built-in engine,
#   3. held-out pass@1 before (the SFT checkpoint) and after RL, printed as one JSON line.
# Extra `key=value` arguments are passed to the GRPO run (e.g. trainer.total_steps=20).
set -euo pipefail
START=$(date +%s)
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/tools/setup_env.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}" HF_HUB_OFFLINE=1 PYTHONWARNINGS=ignore
OUT="${QUICKSTART_DIR:-runs/quickstart}"
echo "[quickstart] SFT warm start -> $OUT/sft"
megatron-rl sft --config examples/quickstart/sft.yaml trainer.output_dir="$OUT/sft" \
  trainer.progress_bar=false ${QUICKSTART_SFT_ARGS:-}
echo "[quickstart] GRPO -> $OUT/grpo"
megatron-rl train --config examples/quickstart/grpo.yaml trainer.init_from="$OUT/sft/final" \
  trainer.output_dir="$OUT/grpo" "$@" | tail -n 1 > "$OUT/grpo_result.json"
megatron-rl plot "$OUT/grpo" >/dev/null
python - "$OUT/grpo_result.json" "$START" <<'PY'
import json, sys, time
r = json.load(open(sys.argv[1]))
print(json.dumps({"pass_at_1_before": r["pass_at_1_before"], "pass_at_1_after": r["pass_at_1_after"],
                  "seconds": round(time.time() - int(sys.argv[2]), 1)}))
PY
