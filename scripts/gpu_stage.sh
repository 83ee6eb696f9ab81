#!/usr/bin/env bash
# Run named measurement stages on a GPU machine, each under its own time limit, logging to $OUT.
# Usage: OUT=dir scripts/gpu_stage.sh STAGE [STAGE ...]   (stages: see the case below)
# Wheels in .whl/ (liger-kernel, trl, fastapi, ...) are installed into /tmp/site when present.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
fi
[ -d /tmp/site ] && export PYTHONPATH="$PYTHONPATH:/tmp/site"
PR="python3 -m polyrl.cli.main"

stage() {  # name, limit seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $(( $(date +%s) - t0 ))s"
  tail -n "${TAIL:-25}" "$OUT/$name.log"
}

for s in "$@"; do
  case "$s" in
    env) stage env 60 bash -c "$PR env --json --deep > $OUT/h200_env.json; $PR check --deep; $PR env" ;;
    ops) stage ops 120 $PR validate ops --json "$OUT/ops.json" --md "$OUT/ops.md" --show failures ;;
    bench-kernels) stage bench-kernels 130 $PR bench kernels --baselines eager,liger --json "$OUT/bench_kernels.json" ;;
    parity) stage parity 150 python3 -m polyrl.bench.model_parity ;;
    bench-sft) stage bench-sft 200 $PR bench sft --shape qwen3-0.6b --seq 4096 --batch 8 --warmup 2 --steps 5 --baselines hf,hf-liger --json "$OUT/bench_sft.json" ;;
    bench-rollout) stage bench-rollout 150 $PR bench rollout --shape qwen3-0.6b --batch 256 --prompt-len 128 --gen-len 256 --baselines hf --compare-sync --json "$OUT/bench_rollout.json" ;;
    bench-rollout-4k) stage bench-rollout-4k 150 $PR bench rollout --shape qwen3-0.6b --batch 64 --prompt-len 4032 --gen-len 128 --baselines none --skip-batch1 --compare-sync --json "$OUT/bench_rollout_4k.json" ;;
    bench-grpo) stage bench-grpo 220 $PR bench grpo --shape qwen3-0.6b --prompts 64 --n 8 --gen-len 512 --warmup 1 --steps 2 --kv both --baselines none --json "$OUT/bench_grpo_ours.json" ;;
    # LoRA / QLoRA at the 1.7b and 8b shapes vs HF + peft (+ Liger): the issue-17 table (8b QLoRA must stay < 24 GiB)
    bench-sft-lora) stage bench-sft-lora 590 bash -c "for s in qwen3-1.7b qwen3-8b; do for m in '--lora r=16,alpha=32' --qlora; do $PR bench sft --shape \$s --seq 4096 --batch 2 --steps 5 --warmup 2 \$m --activation-checkpointing --baselines hf,hf-liger; done; done" ;;
    # Where LoRA/QLoRA step time goes at 1.7b: ours (fused lora_linear), ours with the reference composition, and
    # the baselines, each with a kernel profile (issue 17)
    profile-lora) TAIL=400 stage profile-lora 590 bash -c "A='--shape qwen3-1.7b --seq 4096 --batch 2 --steps 3 --warmup 1 --activation-checkpointing --profile 30'; \
      $PR bench sft \$A --lora r=16,alpha=32 --baselines hf-liger --profile-baselines; \
      POLYRL_KERNELS=lora_linear:reference $PR bench sft \$A --lora r=16,alpha=32 --baselines none; \
      $PR bench sft \$A --qlora --baselines hf --profile-baselines" ;;
    # cProfile of one LoRA training step at 1.7b with its wall and kernel time: is the host the bound? (issue 17)
    host-profile-lora) stage host-profile-lora 200 python3 scripts/train_host_profile.py --shape qwen3-1.7b --seq 4096 \
      --batch 2 --lora r=16,alpha=32 --activation-checkpointing --top 40 ;;
    # The LoRA/QLoRA iteration loop at 1.7b (ours vs HF + peft (+ Liger), ours with --compile), the 8b LoRA memory
    # against HF + peft + Liger, and the host profile (issue 17)
    lora-iter) TAIL=0 stage lora-iter 560 bash -c "A='--seq 4096 --batch 2 --steps 5 --warmup 2 --activation-checkpointing'; \
      $PR bench sft --shape qwen3-1.7b \$A --lora r=16,alpha=32 --baselines hf,hf-liger; \
      $PR bench sft --shape qwen3-1.7b \$A --qlora --baselines hf; \
      $PR bench sft --shape qwen3-8b \$A --lora r=16,alpha=32 --baselines hf-liger; \
      $PR bench sft --shape qwen3-1.7b \$A --lora r=16,alpha=32 --compile --baselines none; \
      python3 scripts/train_host_profile.py --shape qwen3-1.7b --seq 4096 --batch 2 --lora r=16,alpha=32 \
        --activation-checkpointing --top 25" ;;
    # The training step replayed as a CUDA graph (engine.cuda_graphs) against the same engine eager, with the GPU tests
    # of the engine first: LoRA / QLoRA at 1.7b (host-bound) and full SFT at 0.6b (issues 15, 17)
    graph-iter) TAIL=80 stage graph-iter 560 bash -c "python3 -m pytest -q -m gpu -p no:cacheprovider -x \
        tests/train/test_graphed_step.py tests/train/test_engine.py 2>&1 | tail -25; \
      A='--seq 4096 --batch 2 --steps 5 --warmup 2 --activation-checkpointing --cuda-graphs both'; \
      $PR bench sft --shape qwen3-1.7b \$A --lora r=16,alpha=32 --baselines hf-liger; \
      $PR bench sft --shape qwen3-1.7b \$A --qlora --baselines hf; \
      $PR bench sft --shape qwen3-0.6b --seq 4096 --batch 8 --warmup 2 --steps 5 --cuda-graphs both \
        --baselines hf-liger --numerics bf16" ;;
    # Peak memory and speed of the graphed step against eager, ours only: full SFT at 0.6b, LoRA at 1.7b
    graph-mem) stage graph-mem 150 bash -c "$PR bench sft --shape qwen3-0.6b --seq 4096 --batch 8 --warmup 2 --steps 3 \
      --cuda-graphs both --baselines none; $PR bench sft --shape qwen3-1.7b --seq 4096 --batch 2 --warmup 2 --steps 3 \
      --lora r=16,alpha=32 --activation-checkpointing --cuda-graphs both --baselines none" ;;
    # The 8b rows of the issue-17 table with the step graphed and eager in the same run
    bench-sft-lora-8b) stage bench-sft-lora-8b 380 bash -c "for m in '--lora r=16,alpha=32' --qlora; do $PR bench sft \
      --shape qwen3-8b --seq 4096 --batch 2 --steps 5 --warmup 2 \$m --activation-checkpointing --cuda-graphs both \
      --baselines hf,hf-liger; done" ;;
    # Candidate lora_linear impl (adapter product first, base GEMM accumulating onto it) against the default, same
    # run, 1.7b and 8b LoRA, ours only (issue 17); promote it in kernels/lora_linear/__init__.py if it wins
    lora-adapter-first) stage lora-adapter-first 400 bash -c "for s in qwen3-1.7b qwen3-8b; do for k in fused \
      fused_adapter_first; do POLYRL_KERNELS=lora_linear:\$k $PR bench sft --shape \$s --seq 4096 --batch 2 --steps 5 \
      --warmup 2 --lora r=16,alpha=32 --activation-checkpointing --baselines none; done; done" ;;
    # The same A/B at 8b QLoRA only (the issue-17 row closest to its target), ours only
    lora-adapter-first-8b) stage lora-adapter-first-8b 300 bash -c "for k in fused fused_adapter_first; do \
      POLYRL_KERNELS=lora_linear:\$k $PR bench sft --shape qwen3-8b --seq 4096 --batch 2 --steps 4 --warmup 2 --qlora \
      --activation-checkpointing --baselines none; done" ;;
    # Where a rollout's device time goes (kernel kinds per decode step, idle gaps between kernels): B512, B256 and
    # batch 1 (issue 14's profile of what is left)
    rollout-profile) TAIL=120 stage rollout-profile 240 bash -c "python3 scripts/rollout_device_profile.py --batch 512 \
      --prompt-len 64 --gen-len 256; python3 scripts/rollout_device_profile.py --batch 256 --prompt-len 128 \
      --gen-len 256; python3 scripts/rollout_device_profile.py --batch 1 --prompt-len 128 --gen-len 128" ;;
    # Issue 28: where the qwen3-8b B256 decode step goes with bf16 and with FP8 weights + FP8 KV (bench-rollout-fp8kv:
    # 9.09 -> 8.41 ms per graph replay, 34% of the FP8 bytes' roofline)
    rollout-profile-fp8) TAIL=90 stage rollout-profile-fp8 240 bash -c "A='--shape qwen3-8b --batch 256 --prompt-len 128 \
      --gen-len 256 --top 12'; python3 scripts/rollout_device_profile.py \$A; \
      python3 scripts/rollout_device_profile.py \$A --weight-precision fp8 --kv-dtype fp8_e4m3" ;;
    # The decode-path kernels of issue 14 against cuBLAS / the one-program sampler, as graph replays
    bench-kernels-decode) stage bench-kernels-decode 120 $PR bench kernels --ops skinny_linear,sampling,paged_attention \
      --baselines eager --json "$OUT/bench_kernels_decode.json" ;;
    # The engine's GPU tests only (graphs, launch graphs, kernels of the decode path): a quick gate before benches
    gpu-tests-infer) TAIL=30 stage gpu-tests-infer 300 python3 -m pytest -m gpu -q -rfE -x -p no:cacheprovider \
      tests/infer tests/kernels/test_skinny_linear.py tests/kernels/test_sampling.py tests/kernels/test_paged_attention.py ;;
    # bench rollout B256 with HF, synchronous steps, and the engine without launch graphs / skinny projections
    bench-rollout-parts) stage bench-rollout-parts 300 $PR bench rollout --shape qwen3-0.6b --batch 256 --prompt-len 128 \
      --gen-len 256 --baselines hf --compare-sync --compare-parts --json "$OUT/bench_rollout.json" ;;
    # The GRPO step (KV cache and graphs kept) against TRL at 64 completions per forward/backward, same run
    bench-grpo-trl64) stage bench-grpo-trl64 420 $PR bench grpo --shape qwen3-0.6b --prompts 64 --n 8 --gen-len 512 \
      --warmup 1 --steps 2 --kv keep --trl-configs fast --json "$OUT/bench_grpo_trl64.json" ;;
    # Paged-attention decode launch settings at the engine's shapes (block_n x warps x stages x splits), for the
    # heuristics in kernels/paged_attention/triton.py (issue 14: 78% of copy bandwidth at 256-token contexts)
    # Issue 34's generation phase (256 prompts of ~102 tokens, 32 new tokens): the decode step's kernels, and the paged
    # decode kernel's launch settings at that context
    rollout-profile-evalgen) TAIL=60 stage rollout-profile-evalgen 200 python3 scripts/rollout_device_profile.py \
      --batch 256 --prompt-len 102 --gen-len 32 --top 20 ;;
    paged-sweep-eval) TAIL=20 stage paged-sweep-eval 200 python3 scripts/paged_attention_sweep.py --shapes ctx116 ;;
    # The tenth session's kernels on the device (heads-packed paged decode, qk_norm_rope_cache, the greedy sampler, the
    # FP8 quantiser), then the paged decode sweep: every bf16 shape, and the qwen3-8b heads over an FP8 cache
    tenth-kernels) TAIL=70 stage tenth-kernels 420 bash -c "python3 -m pytest -q -m 'gpu or not gpu' -rfE -p no:cacheprovider \
        tests/kernels/test_paged_attention_decode.py tests/kernels/test_paged_attention.py \
        tests/kernels/test_paged_attention_fp8.py tests/kernels/test_qk_norm_rope.py tests/kernels/test_sampling.py \
        tests/kernels/test_fp8_act_quant.py 2>&1 | tail -4; python3 -m pytest -q -m gpu -rfE -p no:cacheprovider \
        tests/infer/test_gpu.py tests/infer/test_fp8_weights.py tests/infer/test_fp8_kv.py 2>&1 | tail -4; \
      python3 scripts/paged_attention_sweep.py; python3 scripts/paged_attention_sweep.py --kv-dtype fp8 --shapes 8b" ;;
    paged-sweep) TAIL=40 stage paged-sweep 300 python3 scripts/paged_attention_sweep.py ;;
    paged-sweep-fp8) TAIL=40 stage paged-sweep-fp8 300 python3 scripts/paged_attention_sweep.py --kv-dtype fp8 ;;
    # The decode-path candidates (DecoderOptions.group_projections, parallel_projections, fused_qk_norm_rope): their
    # GPU tests, then bench rollout B256 and B512 with --compare-parts (interleaved on/off medians of every part, batch
    # 1 included); the winners are the defaults in polyrl/models/decoder.py (issue 14)
    decode-candidates) TAIL=60 stage decode-candidates 420 bash -c "python3 -m pytest -m gpu -q -x -p no:cacheprovider \
      tests/kernels/test_skinny_linear.py tests/kernels/test_qk_norm_rope.py 2>&1 | tail -3; \
      $PR bench rollout --shape qwen3-0.6b --batch 256 --prompt-len 128 --gen-len 256 --baselines none --compare-parts \
      --logprob-seqs 1 | grep -E 'decode|A/B|\\('; $PR bench rollout --shape qwen3-0.6b --batch 512 --prompt-len 64 \
      --gen-len 256 --baselines none --skip-batch1 --compare-parts --logprob-seqs 1 | grep -E 'decode|A/B'" ;;
    # DecoderOptions.skip_frozen_down_recompute: its GPU tests, then the 8b LoRA / QLoRA step with the option off and
    # on (bench sft --decoder-options), back to back in one call (the 8b rows are device-bound and repeat within 1%)
    # (issue 17)
    frozen-down) TAIL=40 stage frozen-down 560 bash -c "python3 -m pytest -m gpu -q -x -p no:cacheprovider \
        tests/models/test_skip_frozen_down.py tests/train/test_graphed_step.py -k 'frozen_down or lora_variants' 2>&1 | tail -3; \
      A='--shape qwen3-8b --seq 4096 --batch 2 --steps 4 --warmup 2 --activation-checkpointing --baselines none'; \
      for m in '--lora r=16,alpha=32' --qlora; do for skip in off on; do echo \"# skip_frozen_down_recompute=\$skip \$m\"; \
        $PR bench sft \$A \$m --decoder-options skip_frozen_down_recompute=\$skip | grep -E '^polyrl|ratio'; done; done" ;;
    # data.fixed_shapes on chat-like batches: packed + eager vs padded + eager vs padded + graphed, 1.7b LoRA and
    # 0.6b full, with its GPU test first (issues 15, 17)
    fixed-shapes) TAIL=30 stage fixed-shapes 400 bash -c "python3 -m pytest -m gpu -q -x -p no:cacheprovider \
        tests/train/test_graphed_step.py -k fixed_shape 2>&1 | tail -3; \
      python3 scripts/fixed_shapes_ab.py --shape qwen3-1.7b --budget 8192 --batches 12; \
      python3 scripts/fixed_shapes_ab.py --shape qwen3-0.6b --budget 16384 --batches 12 --lora ''" ;;
    # RMSNorm backward launch settings at the 0.6b SFT shapes (issue 15: 14 ms for 113 launches, ~2x bandwidth time)
    rmsnorm-sweep) TAIL=40 stage rmsnorm-sweep 300 python3 scripts/rmsnorm_sweep.py ;;
    # Where the GRPO training phase goes (issue 14/15: 3.11 s against 1.13 s at peak FLOP/s): one more update on the
    # last step's batches under the profiler, top kernels and framework ops
    profile-grpo-train) TAIL=80 stage profile-grpo-train 200 $PR bench grpo --shape qwen3-0.6b --prompts 64 --n 8 \
      --gen-len 512 --warmup 1 --steps 1 --kv keep --baselines none --profile 30 ;;
    # Issue 15's table in one call: the norm kernels' GPU tests, then 0.6b (with a one-step profile) and 1.7b full SFT
    # against HF + Liger pure bf16, the fastest baseline
    sft-table) TAIL=70 stage sft-table 420 bash -c "python3 -m pytest -m gpu -q -x -p no:cacheprovider \
        tests/kernels/test_rmsnorm.py 2>&1 | tail -2; \
      $PR bench sft --shape qwen3-0.6b --seq 4096 --batch 8 --warmup 2 --steps 5 --baselines hf-liger --numerics bf16 \
        --profile 25; \
      $PR bench sft --shape qwen3-1.7b --seq 4096 --batch 8 --warmup 2 --steps 4 --baselines hf-liger --numerics bf16" ;;
    # 8b QLoRA with only the first N layers checkpointed (engine.checkpoint_layers), ours only: speed and peak memory
    # against the memory HF + peft (bnb NF4) needs (22.9 GiB, run27) (issue 17)
    qlora-ckpt-layers) TAIL=30 stage qlora-ckpt-layers 300 bash -c "for n in 36 28 24; do echo \"# checkpoint_layers \$n\"; \
      $PR bench sft --shape qwen3-8b --seq 4096 --batch 2 --steps 4 --warmup 2 --qlora --activation-checkpointing \
        --checkpoint-layers \$n --baselines none | grep -E '^polyrl'; done" ;;
    # Issue 17's table in one call: LoRA against HF + peft + Liger, QLoRA against HF + peft (bnb NF4), 1.7b and 8b, all
    # layers checkpointed; then 8b QLoRA with the first 24 of 36 layers checkpointed (fits under hf-qlora's memory)
    lora-table) TAIL=40 stage lora-table 500 bash -c "A='--seq 4096 --batch 2 --steps 5 --warmup 2 \
        --activation-checkpointing'; R='^(bench|polyrl|hf)'; for s in qwen3-1.7b qwen3-8b; do \
        $PR bench sft --shape \$s \$A --lora r=16,alpha=32 --baselines hf-liger | grep -E \"\$R\"; \
        $PR bench sft --shape \$s \$A --qlora --baselines hf | grep -E \"\$R\"; done; \
      $PR bench sft --shape qwen3-8b \$A --qlora --checkpoint-layers 24 --baselines none | grep -E \"\$R\"" ;;
    # The GRPO step with the KV cache and graphs kept across steps (the default on the H200) only: the row of the
    # issue-14 table when there is no time for --kv both
    bench-grpo-keep) stage bench-grpo-keep 150 $PR bench grpo --shape qwen3-0.6b --prompts 64 --n 8 --gen-len 512 \
      --warmup 1 --steps 2 --kv keep --baselines none --json "$OUT/bench_grpo_keep.json" ;;
    # trainer -> rollout weight sync (issue 27): in-process copy on one GPU, NCCL bucketed broadcast cuda:0 -> cuda:1 when
    # 2+ GPUs (targets: qwen3-0.6b <= 0.2 s, qwen3-8b <= 1.5 s); first the gpu / multi_gpu tests of weight sync and placements
    bench-weight-sync) TAIL=40 stage bench-weight-sync 500 bash -c "python3 -m pytest -q -p no:cacheprovider -m 'gpu or multi_gpu' tests/run/test_weight_sync.py tests/run/test_placement.py 2>&1 | tail -8; $PR bench weight-sync --shape qwen3-0.6b,qwen3-8b --dtype bf16 --json $OUT/bench_weight_sync.json" ;;
    bench-agent) stage bench-agent 150 $PR bench agent --shape qwen3-0.6b --episodes 256 --turns 4 --turn-tokens 128 --json "$OUT/bench_agent.json" ;;
    validate) stage validate 220 $PR validate --preset tiny --levels platform,ops,sft,rl,serve --out "$OUT/validate" ;;
    # The GRPO step (KV kept) against TRL 1.16's fast setting (one generate of 64 x 8, 64 completions per fwd/bwd, no
    # forced minimum length; bench/grpo_trl.py), same run; needs trl + datasets in .whl/ (issue 27)
    bench-grpo-trl) stage bench-grpo-trl 590 $PR bench grpo --shape qwen3-0.6b --prompts 64 --n 8 --gen-len 512 \
      --warmup 1 --steps 2 --kv keep --trl-configs fast --json "$OUT/bench_grpo_trl.json" ;;
    # The other TRL settings: fast without gradient checkpointing, and the old row (16 per fwd/bwd, forced length)
    bench-grpo-trl-more) stage bench-grpo-trl-more 590 $PR bench grpo --shape qwen3-0.6b --prompts 64 --n 8 \
      --gen-len 512 --warmup 1 --steps 2 --kv keep --trl-configs fast-nogc,old --json "$OUT/bench_grpo_trl_more.json" ;;
    # TRL's fast setting without gradient checkpointing alone, next to ours (issue 27's fair-baseline row)
    bench-grpo-trl-nogc) TAIL=40 stage bench-grpo-trl-nogc 480 $PR bench grpo --shape qwen3-0.6b --prompts 64 --n 8 \
      --gen-len 512 --warmup 1 --steps 2 --kv keep --trl-configs fast-nogc --json "$OUT/bench_grpo_trl_nogc.json" ;;
    # Asynchronous RL (issue 27): the real GRPO run at 64 x 8 x 512 for max-staleness 0 (sync), 1, 2, colocated on one
    # GPU with the thread producer: steady step time, ratio to sync, GPU busy (NVML), split, staleness
    bench-grpo-async) TAIL=30 stage bench-grpo-async 590 $PR bench grpo --shape qwen3-0.6b --prompts 64 --n 8 \
      --gen-len 512 --warmup 1 --steps 4 --kv keep --async 0,1,2 --baselines none --json "$OUT/bench_grpo_async.json" ;;
    # The GRPO training phase alone (issue 27): synthetic 64 x 8 x (64 + 512) rollouts, the SFT engine step on the same
    # packs next to the GRPO loss before (eager, nonzero per pack) and now (graph-safe, one CUDA graph replayed):
    # tokens/s, MFU, idle device time; about a minute
    bench-grpo-train) TAIL=30 stage bench-grpo-train 150 $PR bench grpo --train-phase --shape qwen3-0.6b --prompts 64 \
      --n 8 --prompt-len 64 --gen-len 512 --warmup 2 --steps 2 --json "$OUT/bench_grpo_train.json" ;;
    bench-grpo-train-profile) TAIL=120 stage bench-grpo-train-profile 200 $PR bench grpo --train-phase \
      --shape qwen3-0.6b --prompts 64 --n 8 --prompt-len 64 --gen-len 512 --warmup 2 --steps 1 --profile 20 \
      --json "$OUT/bench_grpo_train_profile.json" ;;
    # 2+ GPUs: sync and K = 1 colocated, then K = 1 with the rollout worker on cuda:1 and the trainer on cuda:0
    bench-grpo-async-2gpu) TAIL=30 stage bench-grpo-async-2gpu 590 $PR bench grpo --shape qwen3-0.6b --prompts 64 \
      --n 8 --gen-len 512 --warmup 1 --steps 3 --kv keep --async 1 --baselines none \
      --json "$OUT/bench_grpo_async_2gpu.json" ;;
    # The same with the K > 0 rollouts on a device stream of their own (bench flag --rollout-stream; the run loop
    # generates on the default stream): does one GPU overlap rollout and training kernels then?
    bench-grpo-async-stream) TAIL=30 stage bench-grpo-async-stream 590 $PR bench grpo --shape qwen3-0.6b --prompts 64 \
      --n 8 --gen-len 512 --warmup 1 --steps 4 --kv keep --async 0,1,2 --rollout-stream on --baselines none \
      --json "$OUT/bench_grpo_async_stream.json" ;;
    # Reward per sample, sync vs async K=1,2, on the demo's arithmetic task (small preset, demo SFT then 60 GRPO steps)
    grpo-async-curve) TAIL=30 stage grpo-async-curve 300 $PR bench grpo --shape small --task arithmetic \
      --curve-samples 15360 --curve-sft-steps 125 --async 0,1,2 --curve-out "$OUT/grpo_async_curve" \
      --json "$OUT/grpo_async_curve_all.json" ;;
    bench-rollout-512) stage bench-rollout-512 150 $PR bench rollout --shape qwen3-0.6b --batch 512 --prompt-len 64 --gen-len 512 --baselines none --compare-sync --json "$OUT/bench_rollout_512.json" ;;
    # MoE (issue 32): full SFT at qwen3-30b-a3b-L8 vs transformers' grouped_mm (+ Liger) and its per-expert loop, then
    # polyrl with pure-bf16 weights and moments (the HF rows' numerics); rollout vs HF generate
    bench-sft-moe) stage bench-sft-moe 300 bash -c "A='--shape qwen3-30b-a3b-L8 --seq 4096 --batch 4 --warmup 2 --steps 4'; \
      $PR bench sft \$A --baselines hf,hf-liger,hf-eager-experts --numerics bf16 --json $OUT/bench_sft_moe.json; \
      $PR bench sft \$A --baselines none --master-dtype none --json $OUT/bench_sft_moe_bf16.json" ;;
    bench-sft-moe-same) stage bench-sft-moe-same 300 $PR bench sft --shape qwen3-30b-a3b-L8 --seq 4096 --batch 4 --warmup 2 --steps 4 --baselines hf,hf-liger --numerics bf16 --master-dtype none --json "$OUT/bench_sft_moe_same.json" ;;  # issue 32: ours (bf16 weights + moments) and the grouped_mm + Liger row in one run
    # issue 32 after the experts' backward stopped saving y and act: ours and the grouped_mm + Liger row in one run
    # (peak memory: the target is <= Liger's), then the experts kernel alone (fwd + bwd vs torch._grouped_mm)
    bench-sft-moe-mem) TAIL=40 stage bench-sft-moe-mem 300 bash -c "$PR bench sft --shape qwen3-30b-a3b-L8 --seq 4096 \
      --batch 4 --warmup 2 --steps 4 --baselines hf-liger --numerics bf16 --master-dtype none \
      --json $OUT/bench_sft_moe_mem.json; $PR bench kernels --ops moe_experts --json $OUT/bench_kernels_moe.json" ;;
    bench-sft-moe-liger) stage bench-sft-moe-liger 150 $PR bench sft --shape qwen3-30b-a3b-L8 --seq 4096 --batch 4 --warmup 2 --steps 4 --no-ours --baselines hf-liger --numerics bf16 --json "$OUT/bench_sft_moe_liger.json" ;;
    bench-rollout-moe) stage bench-rollout-moe 150 $PR bench rollout --shape qwen3-30b-a3b-L8 --batch 256 --prompt-len 128 --gen-len 256 --baselines hf --skip-batch1 --json "$OUT/bench_rollout_moe.json" ;;
    # Full-depth qwen3-30b-a3b (48 layers, bf16 weights ~61 GB): rollout B256 128 / 256 (decode roofline printed),
    # then LoRA SFT on attention and routed experts, 1 x 4096, checkpointed (issue 32 asks for both rows)
    moe-full-depth) TAIL=40 stage moe-full-depth 420 bash -c "$PR bench rollout --shape qwen3-30b-a3b --batch 256 \
        --prompt-len 128 --gen-len 256 --baselines none --skip-batch1 --json $OUT/bench_rollout_moe_full.json \
        | grep -vE 'it/s|^W'; $PR bench sft --shape qwen3-30b-a3b --seq 4096 --batch 1 --warmup 1 --steps 3 \
        --lora r=16,alpha=32,targets=q,k,v,o,experts --activation-checkpointing --baselines none \
        --json $OUT/bench_sft_lora_moe_full.json" ;;
    # the fused MoE LoRA op (moe_experts_lora: no W', no base wgrad): its GPU test, the kernel against the materialised
    # path, then LoRA SFT on the L8 shape with each implementation (POLYRL_KERNELS picks triton), same call
    moe-lora-fused) TAIL=60 stage moe-lora-fused 480 bash -c "python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/kernels/test_moe_experts_lora.py; $PR bench kernels --ops moe_experts_lora; A='--shape qwen3-30b-a3b-L8 --seq 4096 --batch 4 --warmup 2 --steps 4 --baselines none --lora r=16,alpha=32,targets=q,k,v,o,experts'; POLYRL_KERNELS=moe_experts_lora:materialized $PR bench sft \$A --json $OUT/bench_sft_moe_lora_materialized.json; $PR bench sft \$A --json $OUT/bench_sft_moe_lora_fused.json" ;;
    # the MoE GPU tests (LoRA / QLoRA on routed experts through the fused moe_experts_lora default)
    moe-gpu-tests) TAIL=30 stage moe-gpu-tests 300 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
      tests/models/test_moe_lora.py tests/models/test_moe_qlora.py tests/models/test_moe_gpu.py tests/kernels/test_moe.py \
      tests/kernels/test_moe_experts_lora.py ;;
    # every grouped GEMM of the experts op alone, tile candidates, the flat wgrad kernel's rows (issue 32)
    moe-tile-sweep) TAIL=120 stage moe-tile-sweep 330 env OUT=$OUT python3 scripts/moe_tile_sweep.py 240 ;;
    moe-qlora) TAIL=60 stage moe-qlora 420 bash -c "python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/models/test_moe_qlora.py; A='--shape qwen3-30b-a3b-L4 --seq 4096 --batch 2 --warmup 2 --steps 4 --baselines none'; L='r=16,alpha=32,targets=q,k,v,o,experts'; for m in '' --qlora; do $PR bench sft \$A --lora \$L \$m --activation-checkpointing; done; $PR bench sft \$A --lora \$L --qlora" ;;
    # constrained decoding (issue 35): the same batch free and under a JSON schema, cost printed
    bench-rollout-structured) stage bench-rollout-structured 150 $PR bench rollout --shape qwen3-0.6b --batch 256 --prompt-len 128 --gen-len 256 --baselines none --skip-batch1 --response-format json_schema --json "$OUT/bench_rollout_structured.json" ;;
    # ... with the guided host-time breakdown and a grammar-lanes A/B (1, 4, 16 lexers), after the guided GPU tests
    # the same bench without the tests (the GPU suite runs them): one lexer lane vs 16 (issue 35's remaining cost)
    bench-rollout-structured-lanes) TAIL=50 stage bench-rollout-structured-lanes 200 $PR bench rollout --shape qwen3-0.6b --batch 256 --prompt-len 128 --gen-len 256 --baselines none --skip-batch1 --response-format json_schema --grammar-lanes 1,16 --json "$OUT/bench_rollout_structured_lanes.json" ;;
    bench-rollout-structured-ab) TAIL=60 stage bench-rollout-structured-ab 300 bash -c "python3 -m pytest -q -m 'gpu or not gpu' tests/infer/test_structured.py tests/infer/test_structured_overlap.py; $PR bench rollout --shape qwen3-0.6b --batch 256 --prompt-len 128 --gen-len 256 --baselines none --skip-batch1 --response-format json_schema --grammar-lanes 1,4,16 --json $OUT/bench_rollout_structured_ab.json" ;;
    # FP8 rollout (issue 28): qwen3-8b shape B256, the model's bf16 and FP8 projection weights in one run (target: FP8
    # >= 1.4x bf16 tokens/s), greedy agreement over the first 64 tokens of 32 prompts; then the FP8 GPU tests
    bench-rollout-fp8) stage bench-rollout-fp8 480 $PR bench rollout --shape qwen3-8b --batch 256 --prompt-len 128 --gen-len 256 --baselines none --skip-batch1 --logprob-seqs 4 --precision fp8 --json "$OUT/bench_rollout_fp8.json" ;;
    bench-rollout-fp8kv) stage bench-rollout-fp8kv 150 $PR bench rollout --shape qwen3-8b --batch 256 --prompt-len 128 --gen-len 256 --baselines none --skip-batch1 --logprob-seqs 4 --precision fp8-kv --agree-seqs 16 --json "$OUT/bench_rollout_fp8kv.json" ;;
    # issue 28: the FP8 + FP8-KV engine with q/k/v and gate/up fused into one FP8 GEMM each, against the unfused one and
    # the bf16 engine, same run
    bench-rollout-fp8kv-fused) stage bench-rollout-fp8kv-fused 300 $PR bench rollout --shape qwen3-8b --batch 256 \
      --prompt-len 128 --gen-len 256 --baselines none --skip-batch1 --logprob-seqs 4 --precision fp8-kv-fused \
      --agree-seqs 16 --json "$OUT/bench_rollout_fp8kv_fused.json" ;;
    fp8kv-tests) stage fp8kv-tests 150 python3 -m pytest -q -rfE -m 'gpu or not gpu' tests/infer/test_fp8_kv.py tests/kernels/test_paged_attention_fp8.py --durations 5 ;;
    fp8-rollout-tests) stage fp8-rollout-tests 300 python3 -m pytest -q -m 'gpu or not gpu' tests/infer/test_fp8_weights.py tests/kernels/test_fp8_act_quant.py ;;
    # evaluation (issue 34): lm-eval's hf backend vs the in-process engine vs local-completions against polyrl serve
    bench-eval) TAIL=40 stage bench-eval 480 $PR bench eval --shape qwen3-0.6b --docs 2000 --serve --json "$OUT/bench_eval.json" ;;
    # issue 34's generation and prompt log-prob targets: the prompt log-prob GPU tests (k = 0/1/2, bf16 and fp32), then
    # the bench with both generation rows repeated (repeat_s, repeat_speedup; polyrl's engine steps: first / slowest)
    # and the prefill overhead with prefix caching off (the LM-head floor printed beside it); 500 documents, no serve
    bench-eval-gen) TAIL=40 stage bench-eval-gen 420 bash -c "python3 -m pytest -q -m 'gpu or not gpu' -p no:cacheprovider tests/infer/test_prompt_logprobs_gpu.py tests/kernels/test_token_logprobs.py -k 'prompt_logprobs or row_kernel_as' 2>&1 | tail -3; \
      $PR bench eval --shape qwen3-0.6b --docs 500 --hf-batch-sizes 256 --gen-docs 256 --json $OUT/bench_eval_gen.json" ;;
    # Fused q/k/v + gate/up projections (RolloutConfig.fuse_projections, polyrl/infer/fused_projections.py; issue 34's
    # generation target, rollout decode): the GPU + CPU tests, then bench rollout B256 unfused vs fused on one engine
    # (interleaved medians: output tokens/s, decode step ms, graph replay ms), then bench eval generation without hf
    # rows unfused (the A/B's other side) and with hf bs=256 fused, 200 docs, 256 generations; ~5 min
    # the ninth session's last call (~250 s): GPU tests of the merged scoring sharing and fused projections, then issue
    # 34's rows with the fused projections in the in-process engine (the serve row's own engine stays unfused)
    ninth-final) TAIL=45 stage ninth-final-tests 70 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
        tests/infer/test_fused_projections.py tests/infer/test_score_prompts_sharing.py tests/eval/test_scoring.py \
        tests/server/test_gpu.py; \
      TAIL=40 stage ninth-final-eval 175 $PR bench eval --shape qwen3-0.6b --docs 2000 --serve --hf-batch-sizes 256 \
        --gen-docs 256 --fuse-projections --json "$OUT/bench_eval_final.json" ;;
    bench-fused-proj) TAIL=60 stage bench-fused-proj 590 bash -c "python3 -m pytest -q -m 'gpu or not gpu' -p no:cacheprovider \
        tests/infer/test_fused_projections.py 2>&1 | tail -3; \
      $PR bench rollout --shape qwen3-0.6b --batch 256 --prompt-len 128 --gen-len 256 --baselines none --skip-batch1 \
        --fuse-projections --json $OUT/bench_rollout_fused_proj.json 2>&1 | grep -E '^#|decode|A/B|fused|Error'; \
      $PR bench eval --shape qwen3-0.6b --docs 200 --hf-batch-sizes '' --gen-docs 256 --json $OUT/bench_eval_unfused.json \
        2>&1 | grep -E 'polyrl|Error'; \
      $PR bench eval --shape qwen3-0.6b --docs 200 --hf-batch-sizes 256 --gen-docs 256 --fuse-projections \
        --json $OUT/bench_eval_fused_proj.json" ;;
    # the generation rows' time split only (issue 34): hf's model.generate calls and tokens against polyrl's engine
    # call (synchronous prompt steps, decode launches, host stop checks), both warmed up on the phase's shapes, plus
    # cProfile + torch profiler of a polyrl generation repeat in $OUT/eval-gen-profile; ~2 min
    bench-eval-gen-split) TAIL=30 stage bench-eval-gen-split 300 $PR bench eval --shape qwen3-0.6b --docs 200 --hf-batch-sizes 256 --gen-docs 256 --profile $OUT/eval-gen-profile --json $OUT/bench_eval_gen_split.json ;;
    # the scorer's GPU test, then where the in-process log-likelihood phase goes on the device: no hf rows, cProfile +
    # torch profiler in $OUT/eval-profile (issue 34)
    # lm-eval local-completions against polyrl serve (thread mode: one process) sampled by py-spy across its threads:
    # is the engine thread's scoring or the event loop's JSON the bound, and how much is waiting for the GIL (issue 34)
    serve-profile) TAIL=70 stage serve-profile 300 bash -c "/tmp/site/bin/py-spy record -r 100 --threads --gil -f raw \
        -o $OUT/serve_gil.raw -- python3 -m polyrl.cli.main bench eval --shape qwen3-0.6b --docs 2000 --serve \
        --serve-mode thread --hf-batch-sizes '' --gen-docs 0 2>&1 | grep -v 'it/s]' | tail -12; \
        python3 scripts/pyspy_summary.py $OUT/serve_gil.raw --top 30" ;;
    # prompt log-probs at the 8b shape, where the LM head is ~9% of the body's FLOPs (issue 34's 15% bound): the random
    # 8b checkpoint takes ~2 min to build, so few documents and no hf rows
    # issue 34's three same-run rows at once: log-likelihood (2000 docs) in-process and through `polyrl serve`, and the
    # generation phase (256 x 32 tokens) with its split (prefill, decode launches, host stop checks)
    bench-eval-all) TAIL=45 stage bench-eval-all 420 $PR bench eval --shape qwen3-0.6b --docs 2000 --serve \
      --hf-batch-sizes 256 --gen-docs 256 --profile $OUT/eval-all-profile --json $OUT/bench_eval_all.json ;;
    # Issue 34 after the tenth session's decode work (heads-packed paged decode, greedy sampler, q/k norm + KV write in
    # one kernel): the in-process eval rows unfused without hf, then fused projections against the same-run hf rows
    tenth-eval) TAIL=40 stage tenth-eval 330 bash -c "$PR bench eval --shape qwen3-0.6b --docs 2000 --hf-batch-sizes '' \
        --gen-docs 256 --json $OUT/bench_eval_unfused.json 2>&1 | grep -E '^\||polyrl|Error'; \
      $PR bench eval --shape qwen3-0.6b --docs 2000 --hf-batch-sizes 256 --gen-docs 256 --fuse-projections \
        --json $OUT/bench_eval_fused.json" ;;
    # Issue 34 after prompt steps are queued ahead (eleventh session): fused projections against the same-run hf rows
    eleventh-eval) TAIL=30 stage eleventh-eval 330 $PR bench eval --shape qwen3-0.6b --docs 2000 --hf-batch-sizes 256 \
      --gen-docs 256 --fuse-projections --json "$OUT/bench_eval_eleventh.json" ;;
    # Issue 34's generation ratio against hf's spread between calls: every backend's phase run 3 more times, the
    # fastest repeat of each side compared (bench eval --repeats)
    twelfth-eval) TAIL=30 stage twelfth-eval 420 $PR bench eval --shape qwen3-0.6b --docs 2000 --hf-batch-sizes 256 \
      --gen-docs 256 --fuse-projections --repeats 3 --json "$OUT/bench_eval_twelfth.json" ;;
    bench-eval-8b) TAIL=12 stage bench-eval-8b 420 $PR bench eval --shape qwen3-8b --docs 200 --hf-batch-sizes '' \
      --gen-docs 0 --json "$OUT/bench_eval_8b.json" ;;
    bench-eval-profile) TAIL=60 stage bench-eval-profile 300 bash -c "python3 -m pytest -q -m gpu -p no:cacheprovider tests/eval/test_scoring.py 2>&1 | tail -3; \
      $PR bench eval --shape qwen3-0.6b --docs 2000 --hf-batch-sizes '' --gen-docs 256 --profile $OUT/eval-profile --json $OUT/bench_eval_profile.json" ;;
    # 8-bit AdamW moments and optimizer offload (issue 28, docs/optim8.md): their GPU tests, then qwen3-8b full SFT,
    # activation checkpointing, 1 x 4096: ours adamw (fp32 masters; expected oom) and the bitsandbytes AdamW8bit /
    # torch AdamW HF baselines (pure bf16), adamw8bit with fp32 masters and pure bf16, and adamw + offload cpu. Peak
    # memory and tokens/s per row; the 8-bit + offload row (the 40 GiB target) is the next stage.
    bench-sft-optim8) TAIL=120 stage bench-sft-optim8 590 bash -c "python3 -m pytest -m gpu -q -x -p no:cacheprovider \
        tests/kernels/test_adamw8bit.py tests/train/test_optim8.py 2>&1 | tail -5; \
      A='--shape qwen3-8b --seq 4096 --batch 1 --activation-checkpointing --steps 3 --warmup 1'; \
      timeout 200 $PR bench sft \$A --baselines hf,hf-bnb8bit --numerics bf16 --json $OUT/optim8_adamw.json; \
      timeout 70 $PR bench sft \$A --baselines none --optim adamw8bit --json $OUT/optim8_8bit.json; \
      timeout 70 $PR bench sft \$A --baselines none --optim adamw8bit --master-dtype none --json $OUT/optim8_8bit_bf16.json; \
      timeout 150 $PR bench sft --shape qwen3-8b --seq 4096 --batch 1 --activation-checkpointing --steps 2 --warmup 1 \
        --baselines none --optim-offload cpu --json $OUT/optim8_offload.json" ;;
    bench-sft-optim8-offload) TAIL=30 stage bench-sft-optim8-offload 300 $PR bench sft --shape qwen3-8b --seq 4096 --batch 1 \
      --activation-checkpointing --steps 3 --warmup 1 --baselines none --optim adamw8bit --optim-offload cpu \
      --json "$OUT/optim8_8bit_offload.json" ;;
    # FP8 training (issue 28) checks first: its GPU tests (Triton casts and _scaled_mm vs the references, train steps vs
    # bf16 with a CUDA-graph capture), the ops sweep at real shapes, the kernels bench (cast bandwidth, FP8 vs bf16 linear)
    fp8-check) TAIL=60 stage fp8-check 400 bash -c "python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
      tests/kernels/test_fp8.py tests/train/test_fp8_train.py tests/train/test_fp8_linear_caches.py; $PR validate ops --ops fp8_quantize,fp8_scaled_mm \
      --sizes tiny,small,large --show failures; $PR bench kernels --ops fp8 --baselines eager,compile" ;;
    # FP8 training speed (issue 28, kernel work): ours bf16 vs FP8 at 1.7b (the headline), then the FP8 kernel rows (fused
    # cast + transpose vs torch.compile, fp8_linear fused / unfused / fast-grad vs bf16, gate+up pair)
    fp8-train-speed) TAIL=70 stage fp8-train-speed 150 bash -c "$PR bench sft --shape qwen3-1.7b --seq 4096 --batch 4 \
      --warmup 2 --steps 4 --precision both --baselines none --json $OUT/bench_sft_fp8_speed.json; \
      $PR bench kernels --ops fp8 --baselines compile --json $OUT/bench_kernels_fp8.json" ;;
    # FP8 training's delayed gradient cast (issue 28): its GPU tests (the one-pass cast vs the reference over calls and
    # graph replays; graphed FP8 steps vs eager vs current scaling), then FP8 vs HF + Liger bf16 at 1.7b, same run
    fp8-grad-check) TAIL=30 stage fp8-grad-check 150 bash -c "python3 -m pytest -m gpu -q -rfE -p no:cacheprovider       tests/kernels/test_fp8.py tests/train/test_fp8_train.py -k 'delayed or gpu_fp8_train';       $PR bench sft --shape qwen3-1.7b --seq 4096 --batch 4 --warmup 2 --steps 5 --precision fp8 --baselines hf-liger       --numerics bf16 --json $OUT/bench_sft_fp8_grad.json" ;;
    # FP8 training (issue 28): ours bf16 and FP8 vs HF + Liger bf16 and torchao float8 (eager and compiled), same run;
    # then 8b full SFT with checkpointing (pure-bf16 weights and moments, what fits one H200, as the HF bf16 rows)
    bench-sft-fp8) TAIL=40 stage bench-sft-fp8 560 $PR bench sft --shape qwen3-1.7b --seq 4096 --batch 4 --warmup 2 \
      --steps 5 --precision both --baselines hf-liger,torchao-fp8 --numerics bf16 --json "$OUT/bench_sft_fp8.json" ;;
    bench-sft-fp8-8b) TAIL=40 stage bench-sft-fp8-8b 590 $PR bench sft --shape qwen3-8b --seq 4096 --batch 2 --warmup 2 \
      --steps 4 --activation-checkpointing --master-dtype none --precision both --baselines hf-liger,torchao-fp8 \
      --numerics bf16 --json "$OUT/bench_sft_fp8_8b.json" ;;
    # The same 8b rows with polyrl recomputing only the first 18 of 36 layers (engine.checkpoint_layers; HF's gradient
    # checkpointing is all layers or none, and none does not fit), then polyrl FP8 with no recompute (issue 28)
    bench-sft-fp8-8b-partial) TAIL=30 stage bench-sft-fp8-8b-partial 400 bash -c "A='--shape qwen3-8b --seq 4096 \
        --batch 2 --warmup 2 --steps 4 --master-dtype none'; $PR bench sft \$A --activation-checkpointing \
        --checkpoint-layers 18 --precision both --baselines hf-liger --numerics bf16 --json $OUT/bench_sft_fp8_8b_ckpt18.json; \
      $PR bench sft \$A --precision fp8 --baselines none --json $OUT/bench_sft_fp8_8b_nockpt.json" ;;
    # 1.7b FP8 against HF + Liger bf16 alone (issue 28's 1.25x row without the torchao rows)
    bench-sft-fp8-17b) TAIL=20 stage bench-sft-fp8-17b 200 $PR bench sft --shape qwen3-1.7b --seq 4096 --batch 4 \
      --warmup 2 --steps 5 --precision both --baselines hf-liger --numerics bf16 --json "$OUT/bench_sft_fp8_17b.json" ;;
    # 8b LoRA with FP8 base GEMMs vs bf16 base and HF + peft + Liger (issue 28 target: >= 1.5x HF + peft + Liger)
    bench-sft-lora-fp8-8b) TAIL=40 stage bench-sft-lora-fp8-8b 590 $PR bench sft --shape qwen3-8b --seq 4096 --batch 2 \
      --warmup 2 --steps 5 --lora r=16,alpha=32 --activation-checkpointing --precision both --baselines hf-liger \
      --json "$OUT/bench_sft_lora_fp8_8b.json" ;;
    # FP8 numerics evidence (issue 28): 300 SFT steps of the 0.6b shape in bf16 and FP8, one PNG, final-loss diff
    fp8-loss-curves) TAIL=10 stage fp8-loss-curves 590 python3 scripts/fp8_loss_curves.py --preset qwen3-0.6b-shape \
      --steps 300 --data "builtin:arithmetic?n=12000" --out "$OUT/fp8_loss_curves" ;;
    # FP8 numerics above the seed noise (issue 28): 3 seeds x (bf16, FP8), 300 steps of the 0.6b shape on builtin:markov
    # (text from a fixed random Markov chain over 494 words: a smooth descent toward a known floor), held-out loss of
    # the final model (1000 @test rows) every 25 steps, paired FP8 - bf16 per seed. Sized for ~8.5 min: 8192 tokens
    # a step (~0.07-0.08 s at 0.6b: 300 steps ~25 s) + 12 evals of ~21 forward micro-batches (~6 s) + per-run setup
    # ~20 s (20k rows tokenised, load, graph capture; unlike the 12-03 runs no final checkpoint, ~8 GB of masters
    # and moments, nor model is written) = ~50 s a run, 6 runs ~300 s, + 3 random inits ~30 s, data ~10 s, cold
    # kernel compiles ~40 s: ~380 s. --budget-s 450 starts no seed that would end past 450 s (estimated from the
    # slowest seed so far: a slow machine gives 2 seeds, not a killed third); the JSON is rewritten after every run.
    # 20000 rows x ~174 tokens = ~425 micro-batches of 8192: no row repeats in 300 steps.
    fp8-loss-seeds) TAIL=20 stage fp8-loss-seeds 510 python3 scripts/fp8_loss_curves.py --preset qwen3-0.6b-shape \
      --steps 300 --seeds 0,1,2 --micro-batch-tokens 8192 --data "builtin:markov?n=20000" --eval-rows 1000 \
      --eval-every 25 --budget-s 450 --out "$OUT/fp8_loss_seeds" ;;
    # The seeds protocol without the early loss spikes of fp8-loss-seeds (both precisions spiked to ~10-14 nats at
    # steps 30-35 after a 10-step warm-up to 3e-4, and the per-seed fp8 - bf16 gaps of +2.1 / -2.4 / -0.6% were set
    # there and carried to the end): a 60-step warm-up to 2e-4, up to four seeds (those that fit 360 s)
    fp8-loss-seeds-stable) TAIL=20 stage fp8-loss-seeds-stable 420 python3 scripts/fp8_loss_curves.py \
      --preset qwen3-0.6b-shape --steps 300 --seeds 0,1,2,3 --lr 2e-4 --warmup-steps 60 --micro-batch-tokens 8192 \
      --data "builtin:markov?n=20000" --eval-rows 1000 --eval-every 25 --budget-s 360 --out "$OUT/fp8_loss_stable" ;;
    # Where an SFT run's wall time goes outside the timed step (the fp8-loss-curves run showed ~1.4 s of wall per step
    # against 0.16-0.19 s of step time): the CLI's SFT loop under cProfile, 40 steps of the 0.6b shape, top 30
    fp8-loss-variants) TAIL=12 stage fp8-loss-variants 560 python3 scripts/fp8_loss_curves.py --preset qwen3-0.6b-shape \
      --steps 300 --data "builtin:arithmetic?n=12000" --out "$OUT/fp8_loss_variants" \
      --variants bf16,fp8,fp8-grad-bf16,fp8-grad-e4m3,fp8-rowwise,bf16-seed1 --reuse compat/raw/h200-2026-12-03/fp8_loss_curves_call3.json ;;
    sft-host-profile) TAIL=45 stage sft-host-profile 200 bash -c "$PR init-model --preset qwen3-0.6b-shape --out /tmp/m06 >/dev/null && \
      python3 -m cProfile -o $OUT/sft_loop.prof -m polyrl.cli.main train --algo sft --model /tmp/m06 --out /tmp/sftp \
        --data 'builtin:arithmetic?n=4000' --max-steps 40 --micro-batch-tokens 16384 --max-seq-len 1024 \
        --save-every 0 >/dev/null 2>&1; python3 -c \"import pstats; pstats.Stats('$OUT/sft_loop.prof').sort_stats('cumulative').print_stats(30)\" | tail -40; tail -3 /tmp/sftp/metrics.jsonl | cut -c1-200" ;;
    multi-gpu) TAIL=60 stage multi-gpu 590 bash tests/distributed/run_multi_gpu.sh ;;
    # The whole single-GPU marked suite in one go (issue 13: < 8 min on a cold Triton cache); slowest tests listed.
    # pytest-xdist (on the device image) runs test files in GPU_TEST_WORKERS processes sharing the one GPU: the suite's
    # time is mostly compiles (Triton, inductor) and host work, which overlap; no test asserts a timing. Each worker
    # sizes its engines' KV caches from its share of the GPU's memory (POLYRL_DEVICE_MEMORY_SHARE). Expandable
    # segments: a worker's allocator returns freed memory to the device between tests (2026-12-04: without them each
    # worker kept its running peak reserved, and another worker's test ran out of memory).
    # Workers: 3 on a card of >= 120 GiB (H200), else 1 (GPU_TEST_WORKERS overrides): on an 80 GB H100 a worker kept
    # 53 GiB reserved with nothing allocated after test_token_logprobs' memory test, and 3 workers gave 7 OOM
    # failures, 2 workers 3 (each passed alone; 2026-12-06, docs/performance.md "Nineteenth session")
    gpu-tests) TAIL=60 stage gpu-tests 590 bash -c "MIB=\$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits \
        2>/dev/null | head -1); D=1; [ \"\${MIB:-0}\" -ge 122880 ] && D=3; W=\${GPU_TEST_WORKERS:-\$D}; X=''; \
      python3 -c 'import xdist' 2>/dev/null && [ \"\$W\" -gt 1 ] && X=\"-n \$W --dist loadfile\" \
        && export POLYRL_DEVICE_MEMORY_SHARE=\$(python3 -c \"print(round(0.85 / \$W, 3))\"); \
      POLYRL_TESTS_FAILURE_LOG=$OUT/gpu-test-failures.log POLYRL_TESTS_MEMORY_LOG=$OUT/gpu-test-memory.log \
      PYTORCH_CUDA_ALLOC_CONF=\${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
      python3 -m pytest -m 'gpu and not multi_gpu' -q -rfE --timeout=300 --durations=25 -p no:cacheprovider \$X tests" ;;
    # Programmatic Dependent Launch A/B (POLYRL_PDL, polyrl/kernels/pdl.py; experimental, off by default): the GPU test
    # (the decode-step kernels captured in a CUDA graph with PDL on give the bits of PDL off), then bench rollout B256
    # and bench eval's generation rows (200 docs, 256 generations, fused projections, no hf rows) without and with it;
    # ~4-5 min (limits: 90 + 170 + 150 s)
    pdl-ab) TAIL=20 stage pdl-ab-tests 90 python3 -m pytest -q -rfE -m 'gpu or not gpu' -p no:cacheprovider \
        tests/kernels/test_pdl.py; \
      TAIL=30 stage pdl-ab-rollout 170 bash -c "for v in 0 1; do echo \"## POLYRL_PDL=\$v\"; \
        ( [ \$v = 1 ] && export POLYRL_PDL=1 || unset POLYRL_PDL; timeout 84 $PR bench rollout --shape qwen3-0.6b \
          --batch 256 --prompt-len 128 --gen-len 256 --baselines none --skip-batch1 --json $OUT/bench_rollout_pdl\$v.json \
          2>&1 | grep -E '^#|tokens/s|decode step|graph replay|Error' ); done"; \
      TAIL=30 stage pdl-ab-eval 150 bash -c "for v in 0 1; do echo \"## POLYRL_PDL=\$v\"; \
        ( [ \$v = 1 ] && export POLYRL_PDL=1 || unset POLYRL_PDL; timeout 74 $PR bench eval --shape qwen3-0.6b \
          --docs 200 --hf-batch-sizes '' --gen-docs 256 --fuse-projections --json $OUT/bench_eval_pdl\$v.json \
          2>&1 | grep -E 'polyrl|Error' ); done" ;;
    # Issue 34's generation ratio at lm-eval's default generation length (max_gen_toks 256) next to the bench's
    # 32 new tokens, same call, fused projections as the claimed rows, hf at batch 256 (few log-likelihood docs)
    eval-gen-long) TAIL=30 stage eval-gen-long 330 bash -c "for g in 32 256; do echo \"## --gen-tokens \$g\"; \
        $PR bench eval --shape qwen3-0.6b --docs 8 --hf-batch-sizes 256 --gen-docs 256 --gen-tokens \$g \
          --fuse-projections --repeats 2 --json $OUT/bench_eval_gen\$g.json 2>&1 | grep -E 'generate|Error'; done" ;;
    # The MoE TMA variant end to end (issue 32): SFT at qwen3-30b-a3b-L8 4 x 4096 with polyrl.kernels.moe.triton.TMA
    # off, then on, same call
    moe-tma-sft) TAIL=30 stage moe-tma-sft 330 bash -c "for t in False True; do echo \"## TMA=\$t\"; \
        python3 -c \"import sys, polyrl.kernels.moe.triton as k; k.TMA = \$t; from polyrl.cli.main import main; \
sys.exit(main(['bench', 'sft', '--shape', 'qwen3-30b-a3b-L8', '--seq', '4096', '--batch', '4', '--warmup', '2', \
'--steps', '4', '--baselines', 'none', '--master-dtype', 'none']))\" 2>&1 | grep -E 'tokens/s|^polyrl|Error'; done" ;;
    partial-rollouts) TAIL=30 stage partial-rollouts 300 python3 -m pytest -m gpu -q -rfE -x -p no:cacheprovider tests/run/test_partial_rollouts.py ;;  # issue 27: weight swaps between launches, graphs
    *) echo "unknown stage $s" ;;
  esac
done
