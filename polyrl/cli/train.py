"""``polyrl train``: post-train a model with a registered algorithm.

Two ways to say what to run, combinable::
    polyrl train --algo sft --model DIR --data SPEC --out DIR [--max-steps N | --epochs E] [--lr ...] ...
    polyrl train --config run.toml [flags] [--set optim.lr=1e-4 --set data.max_seq_len=1024 ...]

Precedence: the config file, then the named flags, then ``--set`` (dotted keys of the TOML tables, values
parsed as TOML literals), each overriding the one before. Every flag maps onto one config key (listed in
``FLAG_KEYS``), so a run written with flags is the same as the saved ``<out>/run_config.json``.
The whole config is validated before any model is loaded; errors exit 2 with one sentence.
``--nproc-per-node N`` re-launches the same command through ``torch.distributed.run`` (torchrun, standalone
rendezvous on this node) so N ranks train one FSDP2-sharded model; multi-node runs use torchrun directly
(docs/distributed.md).
This module parses and reports; it never branches on algorithm names (``polyrl.algorithms.get`` does).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import polyrl.agents  # noqa: F401 - registers the [agent] table (--env / --agent) with the run config
from polyrl import algorithms
from polyrl.data import builtin
from polyrl.errors import ConfigError
from polyrl.infer import fp8_weights
from polyrl.models.lora import parse_lora_spec
from polyrl.platform import device
from polyrl.run import run as run_training
from polyrl.run.config import load_file, parse_set, resolve
from polyrl.run.placement import check_torchrun_placement
from polyrl.train.config import COMPUTE_DTYPE_ALIASES
from polyrl.train.parallel import launched
from polyrl.train.precision import check_fp8_supported

# argparse dest -> config key. A flag left out of the command line leaves the key alone.
FLAG_KEYS: dict[str, str] = {
    "algo": "algo",
    "model": "model",
    "data": "data.path",
    "out": "out",
    "seed": "seed",
    "max_steps": "train.max_steps",
    "epochs": "train.epochs",
    "eval_every": "train.eval_every",
    "eval_data": "train.eval_data",
    "eval_before_train": "train.eval_before_train",
    "keep_best": "train.keep_best",
    "log_every": "train.log_every",
    "report_to": "train.report_to",
    "lr": "optim.lr",
    "weight_decay": "optim.weight_decay",
    "grad_clip": "optim.grad_clip",
    "optim": "optim.name",
    "optim_offload": "optim.offload",
    "warmup_steps": "schedule.warmup_steps",
    "warmup_ratio": "schedule.warmup_ratio",
    "lr_decay": "schedule.decay",
    "tokens_per_step": "engine.step_tokens",
    "micro_batch_tokens": "engine.micro_batch_tokens",
    "activation_checkpointing": "engine.activation_checkpointing",
    "checkpoint_layers": "engine.checkpoint_layers",
    "compile": "engine.compile",
    "deterministic": "engine.deterministic",
    "dtype": "precision.compute_dtype",
    "precision": "precision.linear",
    "fp8_scaling": "precision.fp8_scaling",
    "max_seq_len": "data.max_seq_len",
    "format": "data.format",
    "loss_on": "data.loss_on",
    "skip_bad_rows": "data.skip_bad_rows",
    "save_every": "checkpoint.every_n_steps",
    "keep_last": "checkpoint.keep_last_k",
    "resume": "resume",
    # agentic RL: the [agent] table (polyrl.agents.AgentConfig)
    "env": "agent.env",
    "agent": "agent.agent",
    "max_turns": "agent.max_turns",
    "max_episode_tokens": "agent.max_episode_tokens",
    "env_workers": "agent.env_workers",
    "env_timeout": "agent.env_timeout",
    "reward_model": "reward.model",
}

DTYPE_ALIASES = COMPUTE_DTYPE_ALIASES

# argparse dest -> key in the algorithm's own table (``[grpo]``, ``[gspo]``, ``[ppo]``): online RL settings.
RL_FLAG_KEYS: dict[str, str] = {
    "reward": "reward",
    "samples_per_prompt": "samples_per_prompt",
    "prompts_per_step": "prompts_per_step",
    "max_new_tokens": "max_new_tokens",
    "temperature": "temperature",
    "kl_coef": "kl_coef",
    "reward_workers": "reward_workers",
    "reward_timeout": "reward_timeout",
    "ppo_epochs": "ppo_epochs",
    "mini_batches": "mini_batches",
    "loss_agg": "loss_agg",
    "clip_low": "clip_low",
    "clip_high": "clip_high",
    "old_logprobs": "old_logprobs",
    "tis_cap": "tis_cap",
    "filter_groups": "filter_groups",
    "teacher": "teacher",
    "teacher_url": "teacher_url",
    "teacher_coef": "teacher_coef",
    "eval_n": "eval_n",
    "max_staleness": "max_staleness",
    "async_producer": "async_producer",
    "rollout_workers": "rollout_workers",
    "rollout_worker_restarts": "rollout_worker_restarts",
    "rollout_worker_timeout": "rollout_worker_timeout_s",
    "rollout_balance": "rollout_balance",
    "partial_rollouts": "partial_rollouts",
    "rollout_devices": "rollout_devices",
    "train_devices": "train_devices",
    "weight_sync_dtype": "weight_sync_dtype",
    "weight_sync_bucket_mb": "weight_sync_bucket_mb",
    "rollout_precision": "rollout_precision",
    "rollout_kv_dtype": "rollout_kv_dtype",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "Precedence: --config file < flags < --set. Example: polyrl train --algo sft --model runs/tiny "
        "--data builtin:arithmetic --out runs/sft --max-steps 100 --set optim.betas=[0.9,0.99]"
    )
    g = parser.add_argument_group("run")
    g.add_argument("--config", metavar="FILE", help="run config (.toml, or a saved run_config.json)")
    g.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override any key, e.g. optim.lr=1e-4"
    )
    g.add_argument("--algo", metavar="NAME", help=f"algorithm: {', '.join(algorithms.names())} (default sft)")
    g.add_argument("--model", metavar="DIR", help="Hugging Face model folder to start from")
    g.add_argument("--data", metavar="SPEC", help="dataset: file, datasets name/folder, or builtin:NAME")
    g.add_argument("--out", metavar="DIR", help="run directory (checkpoints, metrics, final model)")
    g.add_argument("--seed", type=int, help="seed of data order and engine (default 0)")
    g.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        metavar="latest|PATH",
        help="continue from the latest or a given checkpoint",
    )
    g = parser.add_argument_group("length and evaluation")
    g.add_argument("--max-steps", type=int, help="optimizer steps (wins over --epochs)")
    g.add_argument("--epochs", type=float, help="passes over the data (default 1)")
    g.add_argument(
        "--eval-every",
        type=int,
        help="evaluate every N steps and at the end, on --eval-data (RL: its prompts) or the held-out part: "
        "sft/dpo/rm the held-out loss (eval_loss); grpo/gspo/ppo/distill greedy completions of the eval prompts "
        "scored by the reward (eval_reward, eval_accuracy; --eval-n K adds eval_pass@k); agentic runs (--env) "
        "greedy episodes (eval_reward, eval_tool_call_rate)",
    )
    g.add_argument(
        "--eval-data",
        metavar="SPEC",
        help="held-out data for --eval-every: sft/dpo/rm score its eval loss, RL runs its prompts (default: the "
        "data.holdout part of --data, or a builtin set's test split)",
    )
    g.add_argument(
        "--eval-before-train",
        action="store_true",
        default=None,
        help="with --eval-every: also evaluate the initial model, logged as step 0 (not repeated on resume)",
    )
    g.add_argument(
        "--keep-best",
        metavar="METRIC",
        help="with --eval-every: keep the model of the best-evaluated step as OUT/best (+ best.json); METRIC as "
        "logged, e.g. eval_loss, eval_reward, eval_pass@1, optionally min:/max: (default: min if it names a loss)",
    )
    g.add_argument("--log-every", type=int, help="print a progress line every N steps when not on a terminal")
    g.add_argument(
        "--report-to",
        metavar="LIST",
        help="experiment trackers: a comma list of tensorboard, wandb, mlflow, or none (default auto: tensorboard "
        "when installed)",
    )
    g = parser.add_argument_group("optimizer")
    g.add_argument("--lr", type=float, help="peak learning rate (default 1e-5)")
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--grad-clip", type=float, help="max global grad norm (0 disables)")
    g.add_argument(
        "--optim",
        choices=["adamw", "adamw8bit"],
        help="optim.name: adamw (fp32 moments) or adamw8bit (blockwise 8-bit moments, docs/optim8.md)",
    )
    g.add_argument(
        "--optim-offload",
        choices=["none", "cpu"],
        help="optim.offload: cpu keeps master weights and moments in host memory and updates there",
    )
    g.add_argument("--warmup-steps", type=int)
    g.add_argument("--warmup-ratio", type=float)
    g.add_argument("--lr-decay", choices=["cosine", "linear", "constant"])
    g = parser.add_argument_group("batching and engine")
    g.add_argument("--tokens-per-step", type=int, help="tokens per optimizer step (gradient accumulation)")
    g.add_argument("--micro-batch-tokens", type=int, help="tokens per forward/backward (packing budget)")
    g.add_argument("--max-seq-len", type=int, help="longest sequence; longer rows are truncated (data.truncation)")
    g.add_argument("--dtype", choices=["auto", "bf16", "fp32", "fp16", *DTYPE_ALIASES], help="compute dtype")
    g.add_argument(
        "--precision",
        choices=["default", "fp8"],
        help="fp8: the decoder's linear layers run forward and backward GEMMs in FP8 (needs an FP8 GPU: "
        "`polyrl env`; docs/fp8.md); default: in the compute dtype",
    )
    g.add_argument(
        "--fp8-scaling", choices=["tensorwise", "rowwise"], help="with --precision fp8: the forward GEMM's scaling"
    )
    g.add_argument("--activation-checkpointing", action="store_true", default=None)
    g.add_argument(
        "--checkpoint-layers", type=int, help="with --activation-checkpointing: recompute only the first N layers"
    )
    g.add_argument("--compile", action="store_true", default=None, help="torch.compile the decoder layers")
    g.add_argument("--deterministic", action="store_true", default=None, help="deterministic kernels")
    g = parser.add_argument_group("data")
    g.add_argument("--format", help="data format (default auto)")
    g.add_argument("--loss-on", choices=["assistant", "last_assistant", "all"])
    g.add_argument("--skip-bad-rows", action="store_true", default=None, help="skip and count bad rows")
    g = parser.add_argument_group("distributed")
    g.add_argument(
        "--nproc-per-node",
        type=int,
        metavar="N",
        help="train on N processes of this node (one per device; re-launches through torchrun, FSDP2)",
    )
    g = parser.add_argument_group("RL (online algorithms: grpo, gspo, ppo; keys of the [<algo>] table)")
    g.add_argument(
        "--reward",
        metavar="SPEC",
        help="builtin reward (exact_match, numeric, code_exec, ...), file.py:function, judge:URL (an LLM judge), model "
        "(the --reward-model), or a weighted sum such as exact_match+0.5*judge:http://localhost:8000/v1",
    )
    g.add_argument(
        "--reward-model",
        metavar="DIR",
        help="sequence-classification reward model folder (reward.model); the reward when --reward is not given",
    )
    g.add_argument("--n", "--samples-per-prompt", dest="samples_per_prompt", type=int, help="completions per prompt")
    g.add_argument("--prompts-per-step", type=int, help="prompts per RL step")
    g.add_argument("--max-new-tokens", type=int, help="longest completion")
    g.add_argument("--temperature", type=float, help="rollout sampling temperature")
    g.add_argument("--kl-coef", type=float, help="KL penalty to the initial weights (0: off, no reference model)")
    g.add_argument("--reward-workers", type=int, help="reward worker processes (0: in this process)")
    g.add_argument("--reward-timeout", type=float, help="seconds per reward call before it counts as failed")
    g.add_argument("--ppo-epochs", type=int, help="passes over each rollout batch")
    g.add_argument("--mini-batches", type=int, help="optimizer steps per pass")
    g.add_argument("--loss-agg", choices=["token-mean", "seq-mean-token-mean", "constant"])
    g.add_argument("--clip-low", type=float, help="ratio clip below 1")
    g.add_argument("--clip-high", type=float, help="ratio clip above 1 (DAPO clip-higher: 0.28)")
    g.add_argument("--old-logprobs", choices=["rollout", "recompute"], help="source of the ratio's old log-probs")
    g.add_argument("--tis-cap", type=float, help="truncated importance sampling cap (with --old-logprobs recompute)")
    g.add_argument("--filter-groups", action="store_true", default=None, help="drop groups whose rewards all agree")
    g.add_argument(
        "--eval-n", type=int, help="RL and agentic runs: sampled completions per eval prompt (eval_pass@k, eval_length)"
    )
    g.add_argument(
        "--teacher",
        metavar="DIR",
        help="on-policy distillation: a frozen teacher (same tokenizer as --model) scores the sampled tokens; "
        "--algo distill trains on its per-token reverse KL alone, grpo/gspo/ppo add it to the reward's advantage",
    )
    g.add_argument(
        "--teacher-url",
        metavar="URL",
        help="the teacher behind an OpenAI-compatible server returning prompt log-probs (polyrl serve, vLLM)",
    )
    g.add_argument(
        "--teacher-coef", type=float, help="weight of the teacher's per-token reverse-KL advantage (default 1.0)"
    )
    g.add_argument(
        "--max-staleness",
        type=int,
        metavar="K",
        help="asynchronous RL: generate rollouts K steps ahead of training, train no sample older than K policy "
        "versions, with the decoupled off-policy loss (0: synchronous, the default)",
    )
    g.add_argument(
        "--async-producer",
        choices=["inline", "thread", "process"],
        help="async rollouts in the trainer's thread on the shared weights (inline), in a background thread on "
        "a copy of the weights, overlapping training (thread), or in --rollout-workers processes fed over gloo "
        "(process)",
    )
    g.add_argument(
        "--rollout-workers", type=int, metavar="N", help="rollout worker processes (--async-producer process)"
    )
    g.add_argument(
        "--rollout-worker-restarts",
        type=int,
        metavar="N",
        help="restarts of a rollout worker that dies, at most (default 3; 0: drop it at once); it rejoins with the "
        "current weights, and the trainer's engine covers its prompts meanwhile",
    )
    g.add_argument(
        "--rollout-worker-timeout",
        type=float,
        metavar="S",
        help="seconds a rollout worker's reply (and, over gloo, each bucket of a weight push) is waited for at most "
        "(default: no deadline); a worker that misses it (hung) is killed and handled as one that died: the "
        "trainer's engine generates its prompts, it restarts",
    )
    g.add_argument(
        "--rollout-balance",
        choices=["work", "count"],
        help="how a batch's prompts are split over the rollout workers: work (default: estimated work in "
        "proportion to each worker's measured speed) or count (prompt i to worker i mod W)",
    )
    g.add_argument(
        "--partial-rollouts",
        action="store_true",
        default=None,
        help="async RL (--async-producer thread or process): a weight update lands between decode steps of the "
        "rollouts in flight (in the producer thread's engine or each rollout worker's; agentic runs, --env or "
        "--agent: between engine steps of the episodes in flight), which go on with the new weights; every token "
        "records its policy version",
    )
    g.add_argument(
        "--rollout-devices",
        metavar="DEVS",
        help="placement: one rollout replica (worker process) per listed device, e.g. cuda:1,cuda:2 (cpu may repeat: "
        "cpu,cpu); needs --max-staleness >= 1 --async-producer process (default: colocated)",
    )
    g.add_argument("--train-devices", metavar="DEV", help="placement: the trainer's device, e.g. cuda:0")
    g.add_argument(
        "--weight-sync-dtype",
        choices=["auto", "bf16", "fp32"],
        help="wire dtype of the trainer -> rollout weight sync (auto: the rollout's dtype)",
    )
    g.add_argument(
        "--weight-sync-bucket-mb", type=float, metavar="MB", help="weight sync broadcast bucket size (default 256)"
    )
    g.add_argument(
        "--rollout-precision",
        choices=["model", "fp8"],
        help="weights the rollout samples with: the trained ones (model, default) or FP8 copies requantised after "
        "every step (fp8: needs an FP8 GEMM; docs/fp8-rollout.md)",
    )
    g.add_argument(
        "--rollout-kv-dtype",
        choices=["model", "fp8"],
        help="the rollout engine's KV cache: the model's dtype (default) or FP8 e4m3 (fp8: half the KV bytes per "
        "decode step, twice the cached tokens; docs/fp8-rollout.md)",
    )
    g = parser.add_argument_group("LoRA (the [lora] table; output and checkpoints are PEFT adapter folders)")
    g.add_argument(
        "--lora",
        nargs="?",
        const="",
        metavar="SPEC",
        help="train a LoRA adapter on a frozen base, e.g. --lora r=16,alpha=32,dropout=0,targets=q,k,v,o,gate,up,down "
        "(MoE models: add experts for the routed experts, PEFT's target_parameters)",
    )
    g.add_argument("--qlora", action="store_true", default=None, help="LoRA on a 4-bit NF4 base (implies --lora)")
    g.add_argument(
        "--base",
        metavar="DIR",
        help="the base model folder of the adapter folder given as --model, instead of the base_model_name_or_path "
        "in its adapter_config.json (lora.base)",
    )
    g = parser.add_argument_group("agentic RL (episodes against an environment; keys of the [agent] table)")
    g.add_argument(
        "--env",
        metavar="SPEC",
        help="environment: calculator, guessing, path/to/file.py:Class, or gymnasium:ID (a Gymnasium text env)",
    )
    g.add_argument(
        "--agent", metavar="FILE.py:FN", help="proxy mode: fn(base_url, example) -> reward runs an openai-client agent"
    )
    g.add_argument("--max-turns", type=int, help="assistant turns per episode (--max-new-tokens is per turn)")
    g.add_argument("--max-episode-tokens", type=int, help="tokens per episode, opening prompt included")
    g.add_argument("--env-workers", type=int, help="environment worker processes (0: in this process)")
    g.add_argument("--env-timeout", type=float, help="seconds per environment call before it counts as failed")
    g = parser.add_argument_group("checkpoints")
    g.add_argument("--save-every", type=int, help="checkpoint every N steps (default 0: only at the end)")
    g.add_argument("--keep-last", type=int, help="keep the newest K checkpoints (default 2; 0: all)")


def overrides_from_args(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """Flags that were given, as (config key, value), then the ``--set`` items."""

    out = []
    for dest, key in FLAG_KEYS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if dest == "dtype":
            value = DTYPE_ALIASES.get(value, value)
        out.append((key, value))
    rl = [(key, getattr(args, dest, None)) for dest, key in RL_FLAG_KEYS.items()]
    rl = [(key, value) for key, value in rl if value is not None]
    if getattr(args, "reward_model", None) is not None and getattr(args, "reward", None) is None:
        rl.append(("reward", "model"))  # --reward-model alone: the reward model is the reward
    if rl:
        table = _algo_name(args)
        out.extend((f"{table}.{key}", value) for key, value in rl)
    out += _lora_overrides(args)
    return out + parse_set(args.set)


def _lora_overrides(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """``--lora SPEC`` sets the whole ``[lora]`` table; ``--qlora`` sets ``lora.quantize_base = "nf4"``; ``--base
    DIR`` sets ``lora.base`` (after ``--lora``, which would replace it)."""

    out: list[tuple[str, Any]] = []
    if getattr(args, "lora", None) is not None:
        out.append(("lora", parse_lora_spec(args.lora)))
    if getattr(args, "qlora", None):
        out.append(("lora.quantize_base", "nf4"))
    if getattr(args, "base", None) is not None:
        out.append(("lora.base", args.base))
    return out


def _algo_name(args: argparse.Namespace) -> str:
    """The algorithm whose table the RL flags set: --algo, else the config file's ``algo``, else sft."""
    if getattr(args, "algo", None):
        return args.algo
    if getattr(args, "config", None):
        algo = load_file(args.config).get("algo")
        if isinstance(algo, str):
            return algo
    return "sft"


def unused_settings(cfg: Any) -> list[str]:
    """Settings of the RL table that this run ignores, each as a sentence saying what turns them on: async producer
    settings in a synchronous run (max_staleness 0), rollout workers and their settings (restarts, reply deadline,
    balance, weight sync wire) without the process producer, partial_swap_step without partial rollouts, a teacher
    weight without a teacher. The run goes on (printed as warnings); partial_rollouts and rollout_devices, which
    would change what is built, are errors of the table itself."""
    a, name = cfg.algo_config, cfg.algo
    if not hasattr(a, "max_staleness"):
        return []
    out = []
    if a.max_staleness == 0 and a.async_producer != "inline":
        out.append(
            f'{name}.async_producer = "{a.async_producer}" takes effect only in asynchronous RL, and max_staleness is '
            "0 (synchronous): add --max-staleness K (K >= 1) to generate ahead of training"
        )
    if a.rollout_workers > 1 and (a.max_staleness == 0 or a.async_producer != "process"):
        out.append(
            f"{name}.rollout_workers = {a.rollout_workers} is used only by the process producer: add --max-staleness 1 "
            "--async-producer process"
        )
    if a.max_staleness == 0 or a.async_producer != "process":  # the rollout worker processes' own settings
        for key, value in _worker_settings(a):
            out.append(
                f"{name}.{key} = {value} is used only by the process producer (rollout worker processes): add "
                "--max-staleness 1 --async-producer process, or drop it"
            )
    if a.partial_swap_step != 0 and not a.partial_rollouts:
        out.append(
            f"{name}.partial_swap_step = {a.partial_swap_step} places the weight swap of partial rollouts: add "
            "--partial-rollouts"
        )
    if a.teacher_coef != 1.0 and not a.has_teacher:
        out.append(
            f"{name}.teacher_coef = {a.teacher_coef:g} has no teacher to weigh: add --teacher DIR (or --teacher-url)"
        )
    return out


# the settings of the rollout worker processes (polyrl.run.rollout_workers, the weight sync to them): the process
# producer is the only reader of each
WORKER_SETTINGS = (
    "rollout_worker_timeout_s",
    "rollout_worker_restarts",
    "rollout_balance",
    "weight_sync_dtype",
    "weight_sync_bucket_mb",
)


def _worker_settings(a: Any) -> list[tuple[str, str]]:
    """The ``WORKER_SETTINGS`` of the algorithm config ``a`` that differ from their defaults, as ``(key, value)``.
    The defaults are read from ``a``'s own dataclass (``OnlineConfig`` or the algorithm's subclass), never copied
    here, so a changed default is not reported as a setting the user made."""
    defaults = {f.name: f.default for f in dataclasses.fields(a) if f.name in WORKER_SETTINGS}
    out = []
    for key in WORKER_SETTINGS:
        value = getattr(a, key)
        if value != defaults[key]:
            out.append((key, f'"{value}"' if isinstance(value, str) else f"{value:g}"))
    return out


PAIR_ALGOS = ("dpo", "rm")  # trained on preference pairs (chosen / rejected)


def check_pair_data(algo: str, specs: dict[str, str | None]) -> None:
    """A preference algorithm on a builtin task's plain rows (``builtin:arithmetic``) is refused naming the task's
    pair set (``builtin:arithmetic-pref``): every row would be bad, and the data error's "--skip-bad-rows" would skip
    them all. ``specs``: flag -> data spec."""
    if algo not in PAIR_ALGOS:
        return
    for key, spec in specs.items():
        if not isinstance(spec, str) or not spec.startswith("builtin:"):
            continue
        name, _, _ = builtin.parse_spec(spec)
        if name in builtin.TASKS:
            pair_spec = spec.replace(f"builtin:{name}", f"builtin:{name}-pref", 1)
            raise ConfigError(
                f"--algo {algo} trains on preference pairs (chosen / rejected), and {key} {spec!r} holds plain "
                f"rows; use its pair set {pair_spec!r}"
            )


def run(args: argparse.Namespace) -> int:
    cfg = resolve(args.config, overrides_from_args(args))
    check_pair_data(cfg.algo, {"--data": cfg.data.path, "--eval-data": cfg.train.eval_data})
    if os.environ.get("RANK", "0") == "0":  # once, not per torchrun rank
        for line in unused_settings(cfg):
            print(f"warning: {line}", file=sys.stderr)
    if cfg.precision.linear == "fp8":  # refused before any model loads (the engine checks again, for fit())
        check_fp8_supported(device.device_type())
    if getattr(cfg.algo_config, "rollout_precision", "model") == "fp8":  # the same for the rollout's FP8 weights
        fp8_weights.check_machine()
    if getattr(args, "nproc_per_node", None) is not None:
        if not launched():
            a = cfg.algo_config
            if hasattr(a, "rollout_devices"):  # refused once here, not by every rank after the launch
                check_torchrun_placement(a.rollout_devices, a.train_devices, cfg.algo, args.nproc_per_node)
            return relaunch(args, args.nproc_per_node, out=cfg.out)
    summary = run_training(cfg)
    return 0 if summary.get("status", "finished") == "finished" else 1


# ---- --nproc-per-node: the same command under torchrun --------------------------------------------
_FLAGS_ONLY = {
    "activation_checkpointing",
    "compile",
    "deterministic",
    "skip_bad_rows",
    "filter_groups",
    "partial_rollouts",
}


def relaunch_argv(args: argparse.Namespace) -> list[str]:
    """The ``polyrl train`` arguments that reproduce ``args`` (without ``--nproc-per-node``)."""
    argv: list[str] = ["--config", args.config] if args.config else []
    for dest in (*FLAG_KEYS, *RL_FLAG_KEYS):
        value = getattr(args, dest, None)
        if value is None:
            continue
        flag = "--" + dest.replace("_", "-")
        argv += [flag] if dest in _FLAGS_ONLY else [flag, str(value)]
    if getattr(args, "lora", None) is not None:
        argv.append(f"--lora={args.lora}")  # "--lora=" for the bare flag (all defaults)
    if getattr(args, "qlora", None):
        argv.append("--qlora")
    if getattr(args, "base", None) is not None:
        argv += ["--base", args.base]
    for item in args.set:
        argv += ["--set", item]
    return argv


FORWARDED = (signal.SIGTERM, signal.SIGINT)  # what the --nproc-per-node launcher passes on to torchrun
# torchrun's grace between the SIGTERM it passes on to the ranks and its SIGKILL (its own default: 30 s, too short for
# a step and a checkpoint of a large model). The scheduler's own grace (Slurm's KillWait, Kubernetes'
# terminationGracePeriodSeconds) still bounds it. A value set in the environment is kept. torchrun reads it from
# torch 2.12 on; before, its 30 s apply.
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
DEFAULT_SHUTDOWN_TIMEOUT_S = 600


def torchrun_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the launcher starts torchrun in: this one, with torchrun's shutdown grace raised to
    ``DEFAULT_SHUTDOWN_TIMEOUT_S`` unless the user set it (set to an empty string counts as unset: torchrun would
    fail to parse it)."""
    env = dict(os.environ if environ is None else environ)
    if not env.get(SHUTDOWN_TIMEOUT_ENV, "").strip():
        env[SHUTDOWN_TIMEOUT_ENV] = str(DEFAULT_SHUTDOWN_TIMEOUT_S)
    return env


def finished_since(out: str | os.PathLike[str] | None, t0: float) -> bool:
    """Whether the run in ``out`` wrote its summary at ``t0`` (``time.time()``) or later, as finished."""
    if out is None:
        return False
    path = os.path.join(out, "summary.json")
    try:
        if os.stat(path).st_mtime < t0:
            return False
        with open(path) as f:
            return json.load(f).get("status") == "finished"
    except (OSError, ValueError, AttributeError):
        return False


def relaunch(args: argparse.Namespace, nproc: int, out: str | os.PathLike[str] | None = None) -> int:
    """Run this training command on ``nproc`` local ranks through ``python -m torch.distributed.run``. ``out``: the
    run's folder, where a run that a forwarded SIGTERM let finish left its summary (the exit code is then 0)."""

    if nproc < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {nproc}")
    if device.is_accelerator() and nproc > device.count():
        raise ConfigError(
            f"--nproc-per-node {nproc} but this node shows {device.count()} {device.device_type()} device(s); "
            f"use at most {device.count()}"
        )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", "polyrl.cli.main", "train", *relaunch_argv(args)]
    print("launching: " + " ".join(cmd), flush=True)
    # a SIGTERM (preemption) or SIGINT sent to this launcher goes on to torchrun, which passes it to every rank (a
    # SIGTERM: each saves the step in progress and stops, polyrl/run/stop_signal.py); without this torchrun would
    # be left running on its own. Installed before torchrun starts: a signal that comes while it starts is passed
    # on once it has. The exit code is then the signal's, 128 + its number, as in one process (torchrun exits 1),
    # or 0 when the ranks finished the run all the same (signalled during its last step or its finish).
    child: list[subprocess.Popen[bytes]] = []
    received: list[int] = []

    def forward(signum: int, frame: object) -> None:
        received.append(signum)
        if child:
            child[0].send_signal(signum)

    main_thread = threading.current_thread() is threading.main_thread()  # else no handler can be installed
    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED} if main_thread else {}
    t0 = time.time() - 1.0  # before the launch (a coarse file clock: a second of margin, still before any step)
    try:
        child.append(subprocess.Popen(cmd, env=torchrun_env()))
        if received:  # came while it started
            child[0].send_signal(received[0])
        code = child[0].wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code != 0 and received:
        # a signalled torchrun exits 1 even when its ranks, signalled while finishing, completed the run (exit 0
        # each, polyrl/run/stop_signal.py): their summary says which
        return 0 if finished_since(out, t0) else 128 + received[0]
    return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention
