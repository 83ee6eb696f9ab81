#!/usr/bin/env bash
# The multi-GPU measurements of issue 9, for a machine with >= 2 accelerators (H200 x2 or x4).
# Usage: bash tests/distributed/run_multi_gpu.sh [max_gpus]      (from the repository root; or the multi-gpu stage
# of scripts/gpu_stage.sh). Prints one JSON line per SFT scaling run, the pytest and validate results, a 2-GPU SFT
# run through the CLI, and GRPO step times on 1 and 2 GPUs through the CLI. Per-GPU efficiency at N =
# tokens_per_s_per_gpu(N) / tokens_per_s(1); target >= 0.90. Record the numbers in docs/performance.md.
set -u
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
MAX=${1:-$($PY -c "from polyrl.platform import device; print(device.count())")}
tmp=$(mktemp -d)
LOGS=${OUT:-$tmp}/multi-gpu-logs
mkdir -p "$LOGS"
echo "== SFT scaling, qwen3-1.7b shape, 4 x 4096 tokens per GPU per step"
for n in 1 2 4 8; do
  [ "$n" -le "$MAX" ] || break
  timeout 180 $PY -m torch.distributed.run --standalone --nproc-per-node "$n" tests/distributed/scaling.py \
      --shape qwen3-1.7b --seq 4096 --batch 4 --steps 8 --warmup 2 >"$LOGS/scaling-$n.log" 2>&1
  echo "scaling nproc=$n rc=$?"
  grep '^{' "$LOGS/scaling-$n.log" || tail -n 15 "$LOGS/scaling-$n.log"
done
echo "== multi_gpu tests (nccl, FSDP2 bf16 parity / checkpoint / rollout)"
timeout 150 $PY -m pytest tests/distributed -m multi_gpu -q -p no:cacheprovider --tb=short >"$LOGS/pytest.log" 2>&1
grep -E "^(E |FAILED|[0-9]+ (passed|failed))|Error" "$LOGS/pytest.log" | tail -n 25
echo "== polyrl validate collectives level"
timeout 60 $PY -m polyrl.cli.main validate collectives 2>&1 | tail -8
echo "== SFT through the CLI on 2 GPUs (tiny preset, 20 steps)"
$PY -m polyrl.cli.main init-model --preset tiny --out "$tmp/tiny" >/dev/null
timeout 120 $PY -m polyrl.cli.main train --nproc-per-node 2 --model "$tmp/tiny" --data builtin:arithmetic \
    --out "$tmp/sft2" --max-steps 20 --save-every 10 --lr 1e-3 --log-every 5 2>&1 | tail -4
echo "== GRPO through the CLI, qwen3-0.6b shape (random weights), 32 prompts x 8 x 256 new tokens, 1 then 2 GPUs"
$PY -m polyrl.cli.main init-model --preset qwen3-0.6b-shape --out "$tmp/q06" >/dev/null
for n in 1 2; do
  [ "$n" -le "$MAX" ] || break
  timeout 200 $PY -m polyrl.cli.main train --nproc-per-node "$n" --algo grpo --model "$tmp/q06" \
      --data builtin:arithmetic --reward exact_match --n 8 --prompts-per-step 32 --max-new-tokens 256 \
      --micro-batch-tokens 32768 --lr 1e-6 --max-steps 4 --log-every 1 --save-every 0 --out "$tmp/grpo$n" >/dev/null 2>&1
  echo "grpo nproc=$n rc=$?"
  $PY - "$tmp/grpo$n/metrics.jsonl" "$n" <<'PYEOF'
import json, sys
recs = [json.loads(line) for line in open(sys.argv[1])]
keys = ("time_s", "rollout_s", "logprob_s", "train_s", "response_length")
steady = recs[1:] or recs
row = {k: round(sum(r[k] for r in steady) / len(steady), 3) for k in keys if all(k in r for r in steady)}
print(json.dumps({"grpo_gpus": int(sys.argv[2]), "steps_averaged": len(steady), **row}))
PYEOF
done
rm -rf "$tmp"
