"""polyrl.bench: benchmarks that run polyrl and named baselines in ONE process and print ratios.

Register a benchmark by adding a row; its module has ``add_arguments(parser)`` and ``run(args)``.
Shared measurement helpers (copy bandwidth, matmul peak, event timing) live in ``bench/common.py``.
"""

BENCHES: dict[str, tuple[str, str]] = {
    "kernels": ("polyrl.bench.kernels", "each kernel vs torch eager, torch.compile and Liger at real shapes"),
    "sft": ("polyrl.bench.sft", "SFT step throughput vs HF transformers (+Liger)"),
    "rollout": ("polyrl.bench.rollout", "generation throughput vs HF generate"),
    "grpo": ("polyrl.bench.grpo", "GRPO step time split vs TRL GRPOTrainer"),
    "eval": ("polyrl.bench.eval", "lm-eval log-likelihood scoring: polyrl in-process / serve vs the hf backend"),
    "agent": ("polyrl.bench.agent", "multi-turn episodes vs single-turn rollout at the same token count"),
    "weight-sync": (
        "polyrl.bench.weight_sync",
        "trainer -> rollout weight sync: in-process copy, NCCL bucketed broadcast",
    ),
}
