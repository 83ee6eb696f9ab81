"""``polyrl bench agent``: multi-turn episode rollout (``polyrl.agents.rollout``) vs single-turn rollout of the same
number of generated tokens, in one run on one engine.

Random weights of a preset shape, polyrl's BPE tokenizer (ChatML template), ``--episodes`` episodes of ``--turns``
assistant turns of exactly ``--turn-tokens`` tokens each (EOS ignored, so every turn is cut at its budget and closed
with a masked eos), each turn answered by a synthetic environment (``EchoEnv``: a ``tool`` message of
``--obs-words`` words, never done) until ``--turns``. The baseline generates ``turns x turn-tokens`` tokens for each
episode's opening prompt in one request. Prints episodes/s, policy (generated) tokens/s of both and their ratio
(the issue's target: >= 0.70), the prefix-cache hit rate of the episode run (each turn's prompt is the whole
conversation so far) and the time spent outside the engine (environment + bookkeeping).
This module measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from polyrl.agents.env import Environment, EnvStep
from polyrl.agents.pool import EnvPool
from polyrl.agents.render import ChatRenderer
from polyrl.agents.rollout import EpisodeLimits, episode_metrics, run_episodes
from polyrl.bench.rollout import _model
from polyrl.infer import LLM, RolloutConfig, SamplingParams
from polyrl.models.tokenizer import build_tokenizer
from polyrl.platform import device


class EchoEnv(Environment):
    """A tool environment that answers every turn with ``metadata.obs`` words and never ends an episode."""

    def reset(self, example: dict) -> list[dict]:
        self.words = int(example["metadata"]["obs"])
        return [{"role": "system", "content": "Call tools."}, {"role": "user", "content": example["prompt"]}]

    def step(self, message: dict) -> EnvStep:
        return EnvStep([{"role": "tool", "content": " ".join(["result"] * self.words)}], 0.0, False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="qwen3-0.6b", help="model preset (with or without the -shape suffix)")
    parser.add_argument("--episodes", type=int, default=256)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=128, help="generated tokens per assistant turn")
    parser.add_argument("--prompt-words", type=int, default=64, help="words of the opening user message")
    parser.add_argument("--obs-words", type=int, default=16, help="words of each tool observation")
    parser.add_argument("--env-workers", type=int, default=0, help="environment processes (0: in this process)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)
    parser.add_argument("--device", default=None, help="default: the accelerator, else cpu")
    parser.add_argument("--no-graphs", action="store_true", help="disable CUDA graphs (eager decode)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")


def _sync(dev: torch.device) -> None:
    if dev.type != "cpu":
        device.synchronize()


def run(args: argparse.Namespace) -> int:
    dev = device.parse_device(args.device) if args.device else device.torch_device()
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if dev.type != "cpu" else torch.float32)
    model = _model(args.shape, dtype, dev)
    vocab = model.config.vocab_size
    tok = build_tokenizer(vocab, trained_vocab=min(4096, vocab), seed=0)
    renderer = ChatRenderer(tok)
    rng = random.Random(0)
    words = ["apple", "river", "seven", "blue", "count", "house", "tool", "number", "road", "green"]
    examples = [
        {"prompt": " ".join(rng.choices(words, k=args.prompt_words)), "metadata": {"obs": args.obs_words}}
        for _ in range(args.episodes)
    ]
    opening = max(len(renderer.prompt_ids(EchoEnv().reset(e))) for e in examples[:8])
    probe = EchoEnv()
    probe.reset(examples[0])
    obs = len(renderer.observation_ids(probe.step({}).messages))
    budget = opening + args.turns * (args.turn_tokens + obs + 1) + 64
    llm = LLM(
        model,
        tok,
        RolloutConfig(
            max_num_seqs=args.episodes,
            max_num_batched_tokens=max(8192, args.episodes),
            max_model_len=budget + 1,
            cuda_graphs=False if args.no_graphs else None,
        ),
    )
    res: dict[str, float | str] = {"shape": args.shape, "device": device.name() if dev.type != "cpu" else "cpu"}
    print(
        f"# {args.shape} on {res['device']}: {model.num_parameters() / 1e6:.0f}M params, {dtype}; {args.episodes} "
        f"episodes x {args.turns} turns x {args.turn_tokens} tokens, opening prompt ~{opening} tokens, "
        f"observation {obs} tokens; KV cache {llm.kv.num_blocks} blocks, "
        f"CUDA graphs {'on' if llm.runner.use_graphs else 'off'}"
    )
    sampling = SamplingParams(temperature=1.0, ignore_eos=True)
    limits = EpisodeLimits(max_turns=args.turns, max_new_tokens=args.turn_tokens, max_episode_tokens=budget)
    single = SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=args.turns * args.turn_tokens)
    seeds = list(range(args.episodes))
    with EnvPool("polyrl.bench.agent:EchoEnv", workers=args.env_workers, timeout=60.0) as pool:
        warm = EpisodeLimits(max_turns=2, max_new_tokens=4, max_episode_tokens=budget)
        run_episodes(llm, pool, renderer, examples, 1, sampling, seeds, warm)  # compile, graph capture, workers
        llm.generate([renderer.prompt_ids(EchoEnv().reset(e)) for e in examples], single.clone(max_tokens=4))
        llm.reset_prefix_cache()
        engine_s = _engine_timer(llm)
        _sync(dev)
        t0 = time.perf_counter()
        eps = run_episodes(llm, pool, renderer, examples, 1, sampling, seeds, limits)
        _sync(dev)
        t_agent = time.perf_counter() - t0
        stats = llm.stats()
        res["prefix_cache_hit_rate"] = stats["prefix_cache_hit_rate"]
        res["engine_step_s"] = engine_s()
    generated = sum(sum(e.mask) for e in eps)
    m = episode_metrics(eps)
    res["turns_mean"], res["episode_tokens_mean"] = m["episode/turns"], m["episode/length"]
    res["episodes_per_s"] = len(eps) / t_agent
    res["agent_tok_s"] = generated / t_agent
    res["outside_engine_fraction"] = max(0.0, 1.0 - float(res["engine_step_s"]) / t_agent)
    llm.reset_prefix_cache()
    prompts = [e.prompt_ids for e in eps]
    _sync(dev)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, [single.clone(seed=s) for s in seeds])
    _sync(dev)
    t_single = time.perf_counter() - t0
    res["single_turn_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / t_single
    res["single_turn_sequences_per_s"] = len(outs) / t_single
    res["ratio_agent_vs_single"] = res["agent_tok_s"] / res["single_turn_tok_s"]
    res["generated_tokens"] = generated
    _print(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


def _engine_timer(llm):
    """Wraps ``llm.step`` to sum its wall time; returns a function that unwraps it and gives the total."""
    step, total = llm.step, [0.0]

    def timed(ahead=False):
        t = time.perf_counter()
        try:
            return step(ahead)
        finally:
            total[0] += time.perf_counter() - t

    llm.step = timed

    def done() -> float:
        del llm.step
        return total[0]

    return done


def _print(res: dict) -> None:
    rows = [
        ("episodes/s", "episodes_per_s", "{:,.2f}"),
        ("episode rollout generated tokens/s", "agent_tok_s", "{:,.0f}"),
        ("single-turn rollout tokens/s", "single_turn_tok_s", "{:,.0f}"),
        ("ratio episodes / single-turn", "ratio_agent_vs_single", "{:.0%}"),
        ("prefix-cache hit rate (episodes)", "prefix_cache_hit_rate", "{:.0%}"),
        ("time outside engine steps", "outside_engine_fraction", "{:.1%}"),
        ("turns per episode", "turns_mean", "{:.2f}"),
        ("tokens per episode", "episode_tokens_mean", "{:,.0f}"),
    ]
    for label, key, fmt in rows:
        if key in res:
            print(f"{label:<36} {fmt.format(res[key])}")
