"""Reward evaluation: sample ``n`` completions per prompt of any data the trainer reads, score them with a reward
function, and report mean reward, pass@1, unbiased pass@k and mean length.

A sample *passes* when its reward is at least ``threshold`` (1.0 by default: the builtin checkers give 1 for a right
answer). pass@k is the unbiased estimator of Chen et al. (2021): per prompt with ``c`` passing samples of ``n``,
``1 - C(n - c, k) / C(n, k)``, averaged over prompts; reported for k = 1, 2, 4, ... up to ``n`` (and ``n``). Prompts
are chat-templated as the trainer does (``polyrl.data``); rewards run in the trainer's ``RewardSources`` (builtins and
``file.py:fn`` in its isolated ``RewardPool``, judges over HTTP), as ``polyrl train --reward`` takes them.
Generation goes through the rollout engine in chunks (continuous batching within each), so a progress bar moves.
Not here: the model loading (``loading.py``), the CLI (``cli/eval.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from polyrl.algorithms.reward_sources import RewardConfig, RewardSources, check_spec, parse_spec
from polyrl.algorithms.rewards import example_view
from polyrl.algorithms.rewards import resolve as resolve_reward
from polyrl.algorithms.workers import absolute_spec
from polyrl.data.config import DataConfig
from polyrl.data.dataset import chat_tokenizer, encode_prompts, load_prompts
from polyrl.errors import DataError, UserError
from polyrl.infer.llm import LLM
from polyrl.infer.sampling_params import SamplingParams
from polyrl.run.evaluate import pass_at_k, pass_ks

CHUNK_PROMPTS = 256  # prompts per generate() call (the progress bar's step)


@dataclass
class RewardEval:
    data: str
    reward: str
    num_prompts: int
    n: int
    temperature: float
    threshold: float
    mean_reward: float
    pass_at: dict[int, float]
    mean_length: float
    truncated: float  # fraction of samples that hit max_tokens
    reward_failures: int
    passed: list[int] = field(default_factory=list)  # per prompt: how many of its n samples passed
    samples: list[dict[str, Any]] = field(default_factory=list)  # the first few (prompt, completion, reward)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["pass_at"] = {f"pass@{k}": v for k, v in self.pass_at.items()}
        return d

    def rows(self) -> list[tuple[str, str]]:
        """(metric, value) rows for a table."""
        out = [("prompts", str(self.num_prompts)), ("samples per prompt", str(self.n))]
        out.append(("mean reward", f"{self.mean_reward:.4f}"))
        out += [(f"pass@{k}", f"{v:.4f}") for k, v in self.pass_at.items()]
        out += [("mean length (tokens)", f"{self.mean_length:.1f}"), ("truncated", f"{self.truncated:.3f}")]
        if self.reward_failures:
            out.append(("reward failures", str(self.reward_failures)))
        return out


def _temperature(n: int, temperature: float | None) -> float:
    if n < 1:
        raise UserError(f"--n must be >= 1, got {n}")
    temp = (0.0 if n == 1 else 1.0) if temperature is None else temperature
    if temp < 0:
        raise UserError(f"--temperature must be >= 0 (0 = greedy), got {temp}")
    if n > 1 and temp == 0.0:
        raise UserError("--n > 1 with greedy decoding gives n identical samples; set --temperature > 0")
    return temp


def check_reward_eval(
    data: str, reward: str, n: int = 1, temperature: float | None = None, limit: int | None = None
) -> list[Any]:
    """The prompts of ``data``, after checking ``n``, ``temperature`` and the reward spec: every argument error of a
    reward evaluation, raised before a model loads (a misspelt --reward failed only after generating every sample)."""
    _temperature(n, temperature)
    check_spec(reward, RewardConfig())
    for term in parse_spec(reward):  # builtins and file.py:fn load here (a judge is reached when scoring)
        if term.kind == "functions":
            resolve_reward(absolute_spec(term.arg or ""))
    prompts, _ = load_prompts(DataConfig(path=data, limit=limit, shuffle=False), "train")
    return prompts


def reward_eval(
    llm: LLM,
    data: str,
    reward: str,
    n: int = 1,
    temperature: float | None = None,
    max_tokens: int = 256,
    threshold: float = 1.0,
    limit: int | None = None,
    seed: int = 0,
    workers: int = 2,
    timeout: float = 10.0,
    keep_samples: int = 5,
    progress: Any = None,
    prompts: list[Any] | None = None,
) -> RewardEval:
    """Evaluate ``llm`` on the prompts of ``data`` (a trainer data spec) with the reward ``reward``. ``temperature``
    None: greedy for n = 1, else 1.0. ``progress(done, total)`` is called after each chunk. ``prompts``: those of
    ``check_reward_eval`` (the CLI reads them before the model loads), else read here."""
    if llm.tokenizer is None:
        raise UserError("reward evaluation needs a tokenizer (the prompts are chat-templated)")
    temp = _temperature(n, temperature)
    cfg = DataConfig(path=data, limit=limit, shuffle=False)
    if prompts is None:
        prompts = check_reward_eval(data, reward, n, temperature, limit)
    chat = chat_tokenizer(cfg, llm.tokenizer)
    ids, kept = [], []
    budget = llm.max_model_len - max_tokens
    for p, x in zip(prompts, encode_prompts(chat, prompts, data)):
        if 0 < len(x) <= budget:
            ids.append(x)
            kept.append(p)
    if not kept:
        raise DataError(
            f"{data}: no prompt fits the context ({llm.max_model_len} tokens) minus --max-tokens {max_tokens}"
        )
    # one seed per prompt (the same seed everywhere would draw every prompt's samples from the same noise)
    params = [
        SamplingParams(n=n, temperature=temp, max_tokens=max_tokens, seed=seed * 1_000_003 + i) for i in range(len(ids))
    ]
    texts: list[list[str]] = []
    lengths: list[int] = []
    truncated = 0
    for lo in range(0, len(ids), CHUNK_PROMPTS):
        for out in llm.generate(ids[lo : lo + CHUNK_PROMPTS], params[lo : lo + CHUNK_PROMPTS]):
            texts.append([c.text for c in out.outputs])
            lengths += [len(c.token_ids) for c in out.outputs]
            truncated += sum(c.finish_reason == "length" for c in out.outputs)
        if progress is not None:
            progress(min(lo + CHUNK_PROMPTS, len(ids)), len(ids))
    views = [example_view(p) for p in kept]
    with RewardSources(reward, RewardConfig(), workers, timeout) as pool:
        res = pool.score([t for group in texts for t in group], [v for v in views for _ in range(n)])
    rewards = res.rewards
    passed = [sum(r >= threshold for r in rewards[i * n : (i + 1) * n]) for i in range(len(kept))]
    pass_at = {k: sum(pass_at_k(n, c, k) for c in passed) / len(kept) for k in pass_ks(n)}
    samples = [
        {"prompt": kept[i].messages[-1]["content"], "completion": texts[i][0], "reward": rewards[i * n]}
        for i in range(min(keep_samples, len(kept)))
    ]
    return RewardEval(
        data=data,
        reward=reward,
        num_prompts=len(kept),
        n=n,
        temperature=temp,
        threshold=threshold,
        mean_reward=sum(rewards) / len(rewards),
        pass_at=pass_at,
        mean_length=sum(lengths) / len(lengths),
        truncated=truncated / len(lengths),
        reward_failures=res.num_failures,
        passed=passed,
        samples=samples,
    )
