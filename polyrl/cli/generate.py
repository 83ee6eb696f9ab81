"""``polyrl generate --model DIR --prompt TEXT [--chat] [--max-tokens N] [--temperature T] [--n N] [--seed S]``.

Loads a checkpoint into the rollout engine (``polyrl.infer.LLM``) and prints each completion. A thin
wrapper: argument parsing and printing only.
"""

from __future__ import annotations

import argparse
import sys
import time

from polyrl.cli.model_arg import refuse_adapter, require_tokenizer
from polyrl.infer import LLM, RolloutConfig, SamplingParams
from polyrl.platform.device import parse_device


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF checkpoint folder (config.json, safetensors, tokenizer)")
    parser.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for several prompts)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    parser.add_argument("--system", default=None, help="system message for --chat")
    parser.add_argument("--max-tokens", type=int, default=128, help="maximum generated tokens (default 128)")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    parser.add_argument("--device", default=None, help="torch device (default: the accelerator, else cpu)")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV-cache blocks (default: from free memory)")
    parser.add_argument("--logprobs", action="store_true", help="print the per-token log-probs too")


def run(args: argparse.Namespace) -> int:
    refuse_adapter(args.model, "generate")
    require_tokenizer(args.model)
    if args.device is not None:
        parse_device(args.device)
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=args.stop,
    )
    config = RolloutConfig(num_blocks=args.num_blocks)
    start = time.perf_counter()
    llm = LLM.from_pretrained(args.model, config, dtype=args.dtype, device=args.device)
    loaded = time.perf_counter()
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system else []
        outs = llm.chat([system + [{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        outs = llm.generate(list(args.prompt), params)
    done = time.perf_counter()
    tokens = 0
    for i, out in enumerate(outs):
        print(f"=== prompt {i} ({out.num_prompt_tokens} tokens): {args.prompt[i]!r}")
        for c in out.outputs:
            tokens += len(c.token_ids)
            head = f"--- sample {c.index}" if len(out.outputs) > 1 else "---"
            print(f"{head} [{len(c.token_ids)} tokens, finish={c.finish_reason}]")
            print(c.text)
            if args.logprobs:
                print("logprobs:", " ".join(f"{t}:{lp:.3f}" for t, lp in zip(c.token_ids, c.logprobs)))
    print(
        f"# loaded in {loaded - start:.1f}s; generated {tokens} tokens in {done - loaded:.2f}s "
        f"({tokens / max(done - loaded, 1e-9):.1f} tok/s)",
        file=sys.stderr,
    )
    return 0
