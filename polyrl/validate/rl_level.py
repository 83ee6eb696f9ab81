"""The ``rl`` validation level: one rollout and one GRPO policy-gradient step, colocated.

The rollout engine (``polyrl.infer.LLM``) holds the very ``DecoderLM`` the training engine updates. Steps:
sample G completions for each of P builtin-task prompts (temperature 1); score them (the task's exact-match
check, plus 0.1 x the share of the reference answer's characters found in the completion, so that a
random-weights model still has reward variance inside a group); group-normalised advantages
(``algorithms.advantages``); recompute the completion tokens' log-probs with the trainer's forward
(``kernels.token_logprobs``) and compare them with the rollout engine's (the RL "old log-probs"): max abs
diff <= 1e-4 in fp32 (the CPU); in bf16 the numbers are reported, not gated. Then one GRPO step
(``algorithms.losses.policy_loss``: token ratio, clip 0.2, token mean) through ``TrainEngine.step``: finite
loss and gradient norm, no skipped step; and a second rollout after the update.

GRPO's run loop (``polyrl.algorithms.grpo``) is not driven here; the report says whether it exists.
Not here: reward functions with sandboxes (``polyrl.algorithms.rewards``), learning (one step proves nothing).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import time
from typing import Any

from polyrl.validate import model_source
from polyrl.validate.arg_types import int_at_least
from polyrl.validate.result import check, level_result

CLIP_EPS = 0.2
FP32_LOGPROB_TOL = 1e-4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("rl level")
    positive = int_at_least(1)
    group.add_argument("--rl-prompts", type=positive, default=None, help="prompts per rollout (default 8, quick 4)")
    group.add_argument("--rl-group", type=positive, default=4, help="completions per prompt (default 4)")
    group.add_argument(
        "--rl-max-tokens", type=positive, default=None, help="tokens per completion (default 16, quick 8)"
    )


def reward(text: str, example: Any) -> float:
    """Exact-match (1.0) plus 0.1 x the share of the answer's distinct characters present in ``text``."""
    # lazy: polyrl.data and torch load only when the level runs (the validate CLI imports every level for its parser)
    from polyrl.data import check as exact

    answer = str(example.answer)
    overlap = len(set(answer) & set(text)) / max(1, len(set(answer)))
    return float(exact(text, example)) + 0.1 * overlap


def _rollout(llm: Any, prompts: list[Any], args: argparse.Namespace, group: int):
    # lazy: polyrl.infer loads only when the level runs (the validate CLI imports every level for its parser)
    from polyrl.infer import SamplingParams

    max_tokens = args.rl_max_tokens or (8 if args.quick else 16)
    params = SamplingParams(n=group, temperature=1.0, max_tokens=max_tokens, seed=args.seed)
    t0 = time.perf_counter()
    outs = llm.chat([p.messages for p in prompts], params)
    return outs, time.perf_counter() - t0


def _pack(outs: list[Any], adv: list[float], dev: Any):
    """PackedBatch of prompt + completion per sample (loss on the completion), the rollout log-probs and the
    per-target-token advantages, both ``[N]`` in the batch's target order."""
    # lazy: polyrl.data and torch load only when the level runs (the validate CLI imports every level for its parser)
    import torch

    from polyrl.data import TokenizedSeq, pack_sequences

    seqs, old, adv_tok = [], [], []
    k = 0
    for out in outs:
        for c in out.outputs:
            p = list(out.prompt_token_ids)
            seqs.append(TokenizedSeq(p + list(c.token_ids), [0] * len(p) + [1] * len(c.token_ids)))
            old += list(c.logprobs)
            adv_tok += [adv[k]] * len(c.token_ids)
            k += 1
    batch = pack_sequences(seqs).to(dev)
    f32 = dict(dtype=torch.float32, device=dev)
    return batch, torch.tensor(old, **f32), torch.tensor(adv_tok, **f32)


def _trainer_logprobs(model: Any, batch: Any):
    # lazy: torch-based kernels and polyrl.train load only when the level runs (the CLI imports levels for its parser)
    from polyrl import kernels
    from polyrl.train.losses import attention_metadata

    hidden = model(batch.input_ids, batch.position_ids, attention_metadata(batch))
    mask = batch.labels != -100
    lp = kernels.token_logprobs(hidden, model.lm_head_weight, batch.labels.clamp(min=0), temperature=1.0)
    return lp[mask]


def _grpo_loss(old, adv):
    """The engine's loss form over the shared GRPO math: token-ratio clipped loss, summed (token mean after the
    engine divides by the generated-token normaliser)."""
    # lazy: torch loads only when the level runs (the validate CLI imports every level module for its parser)
    import torch

    from polyrl.algorithms.losses import policy_loss

    def loss_fn(model: Any, batch: Any):
        lp = _trainer_logprobs(model, batch)
        ones = torch.ones_like(lp)
        zeros = torch.zeros(lp.shape, dtype=torch.int64, device=lp.device)
        per_token, info = policy_loss(lp, old, adv, ones, zeros, 1, clip_low=CLIP_EPS, clip_high=CLIP_EPS)
        return per_token.sum(), {"clip_fraction": info["clipped"].sum()}

    return loss_fn


def run_level(args: argparse.Namespace) -> dict[str, Any]:
    # lazy: torch loads only when the level runs (the validate CLI imports every level module for its parser)
    import torch

    from polyrl.algorithms.advantages import group_advantages
    from polyrl.data import DataConfig, load_prompts
    from polyrl.infer import LLM, RolloutConfig
    from polyrl.platform import device
    from polyrl.train import OptimConfig, PrecisionConfig, ScheduleConfig, StepConfig, TrainEngine

    n_prompts = args.rl_prompts or (4 if args.quick else 8)
    group = args.rl_group
    model, tokenizer, _ = model_source.load(args)
    dev = device.torch_device()
    engine = TrainEngine(
        model, OptimConfig(lr=1e-4), ScheduleConfig(decay="constant"), PrecisionConfig(), StepConfig(seed=args.seed), 1
    )
    dtype = next(model.parameters()).dtype
    llm = LLM(model, tokenizer, RolloutConfig(num_blocks=256, max_num_seqs=64, max_graph_batch_size=16))
    prompts, _ = load_prompts(DataConfig(path=args.task, seed=args.seed))
    prompts = prompts[:n_prompts]

    outs, rollout_s = _rollout(llm, prompts, args, group)
    rewards = [reward(c.text, p) for out, p in zip(outs, prompts) for c in out.outputs]
    adv = group_advantages(rewards, [i // group for i in range(len(rewards))])
    batch, old, adv_tok = _pack(outs, adv, dev)
    with torch.no_grad():
        fresh = _trainer_logprobs(model, batch)
    diff = (fresh - old).abs()
    max_diff, mean_diff = float(diff.max().item()), float(diff.mean().item())
    fp32 = dtype == torch.float32
    gen_tokens = int(old.numel())

    stats = engine.step([batch], _grpo_loss(old, adv_tok), normalizer=float(gen_tokens))
    llm.reset_prefix_cache()
    outs2, _ = _rollout(llm, prompts[:1], args, group)

    expected = n_prompts * group
    grpo_available = importlib.util.find_spec("polyrl.algorithms.grpo") is not None
    checks = [
        check("rewards computed for every sample", len(rewards) == expected, len(rewards), str(expected)),
        check(
            "rollout vs trainer log-prob max abs diff",
            max_diff <= FP32_LOGPROB_TOL if fp32 else None,
            max_diff,
            f"<= {FP32_LOGPROB_TOL:g} (fp32)" if fp32 else "reported (bf16)",
            f"mean {mean_diff:.2e} over {gen_tokens} tokens, {str(dtype).replace('torch.', '')}",
        ),
        check("policy loss finite", math.isfinite(stats.loss), stats.loss),
        check("gradient norm finite and step applied", math.isfinite(stats.grad_norm) and not stats.skipped,
              stats.grad_norm),
        check("rollout after the update", all(len(c.token_ids) > 0 for o in outs2 for c in o.outputs),
              sum(len(c.token_ids) for o in outs2 for c in o.outputs), "> 0 tokens per sample"),
    ]  # fmt: skip
    metrics = {
        "model": model_source.describe(args),
        "compute_dtype": str(dtype).replace("torch.", ""),
        "prompts": n_prompts,
        "group_size": group,
        "generated_tokens": gen_tokens,
        "rollout_tokens_per_s": gen_tokens / rollout_s if rollout_s > 0 else None,
        "reward_mean": sum(rewards) / len(rewards),
        "exact_match": sum(r >= 1.0 for r in rewards) / len(rewards),
        "groups_with_reward_variance": sum(len(set(rewards[i : i + group])) > 1 for i in range(0, len(rewards), group)),
        "logprob_max_abs_diff": max_diff,
        "logprob_mean_abs_diff": mean_diff,
        "loss": stats.loss,
        "grad_norm": stats.grad_norm,
        "step_time_s": stats.time_s,
        "algorithm": "GRPO loss (token-ratio clip 0.2, group-normalised advantages, token mean)",
        "clip_fraction": stats.metrics.get("clip_fraction"),
    }
    notes = [
        "The step drives GRPO's loss math (polyrl.algorithms.losses.policy_loss, advantages.group_advantages) "
        "through TrainEngine.step; "
        + ("the GRPO run loop (polyrl.algorithms.grpo) is not exercised here."
           if grpo_available else "GRPO's run loop was not available (polyrl.algorithms.grpo not built).")
    ]  # fmt: skip
    return level_result("rl", checks, metrics, notes)
