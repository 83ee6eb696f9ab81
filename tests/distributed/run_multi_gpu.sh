#!/usr/bin/env bash
# The multi-GPU measurements of issue 9, for a machine with >= 2 accelerators (H200 x2 or x4).
# Usage: bash tests/distributed/run_multi_gpu.sh [max_gpus]      (from the repository root)
# Prints one JSON line per scaling run, then the pytest and validate results. Record them in
# docs/performance.md. Per-GPU efficiency at N = tokens_per_s_per_gpu(N) / tokens_per_s(1); target >= 0.90.
set -u
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python
MAX=${1:-$($PY -c "from polyrl.platform import device; print(device.count())")}
echo "== SFT scaling, qwen3-1.7b shape, 4 x 4096 tokens per GPU per step"
for n in 1 2 4 8; do
  [ "$n" -le "$MAX" ] || break
  $PY -m torch.distributed.run --standalone --nproc-per-node "$n" tests/distributed/scaling.py \
      --shape qwen3-1.7b --seq 4096 --batch 4 --steps 8 --warmup 2 2>&1 | grep '^{'
done
echo "== multi_gpu tests (nccl, FSDP2 bf16 parity / checkpoint / rollout)"
$PY -m pytest tests/distributed -m multi_gpu -q
echo "== polyrl validate collectives level"
$PY -m polyrl.cli.main validate collectives
echo "== SFT through the CLI on 2 GPUs (tiny preset, 20 steps)"
tmp=$(mktemp -d)
$PY -m polyrl.cli.main init-model --preset tiny --out "$tmp/tiny" >/dev/null
$PY -m polyrl.cli.main train --nproc-per-node 2 --model "$tmp/tiny" --data builtin:arithmetic --out "$tmp/sft2" \
    --max-steps 20 --save-every 10 --lr 1e-3 --log-every 5
