"""``polyrl serve --model DIR [--host 127.0.0.1] [--port 8000] [...]``: the OpenAI-compatible server.

Loads the checkpoint into the rollout engine and serves it with ``polyrl.server.run_server`` until Ctrl-C /
SIGTERM (in-flight requests finish first). ``--lora NAME=DIR`` (repeatable) adds PEFT adapters on the base that a
request selects with ``"model": NAME``. ``--quantize fp8`` serves FP8 projection weights
(``RolloutConfig.weight_precision``), ``--kv-cache-dtype fp8`` an FP8 KV cache (``RolloutConfig.kv_cache_dtype``;
both in docs/fp8-rollout.md). A thin wrapper: argument parsing only.
"""

from __future__ import annotations

import argparse
import os

from polyrl.cli.model_arg import refuse_adapter, require_tokenizer
from polyrl.errors import UserError
from polyrl.infer import RolloutConfig
from polyrl.models.lora import is_adapter_dir
from polyrl.platform import envvars
from polyrl.platform.device import parse_device
from polyrl.server import ServeConfig, run_server
from polyrl.server.config import DEFAULT_MAX_TOKENS, MAX_REQUEST_BYTES
from polyrl.server.launch import load_llm


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF checkpoint folder (config.json, safetensors, tokenizer)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    parser.add_argument("--served-model-name", default=None, help="the `model` name clients use (default: --model)")
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (or POLYRL_API_KEY)")
    parser.add_argument("--max-queue", type=int, default=None, help="requests allowed to wait; more get 429")
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=MAX_REQUEST_BYTES,
        help=f"largest request body accepted; larger is 413 (default {MAX_REQUEST_BYTES} = 8 MiB)",
    )
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help=f"reply length of a chat request without max_tokens, within the context (default {DEFAULT_MAX_TOKENS})",
    )
    parser.add_argument(
        "--allow-request-chat-template",
        action="store_true",
        help="render a request's own chat_template (sandboxed, time- and size-limited); refused (400) by default",
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        choices=["hermes", "qwen", "llama3_json", "mistral"],
        help="tool-call format the model writes (default: detected from its chat template; hermes when it has none)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256, help="sequences batched in one engine step")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens computed in one step")
    parser.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens (default: model's)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    parser.add_argument("--device", default=None, help="torch device (default: the accelerator, else cpu)")
    parser.add_argument("--kv-cache-blocks", type=int, default=None, help="KV-cache blocks (default: from memory)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="device memory share (0, 1]")
    parser.add_argument("--block-size", type=int, default=16, help="KV-cache block size in tokens")
    parser.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="serve a PEFT LoRA adapter on the base (repeatable); requests pick it with model=NAME",
    )
    parser.add_argument(
        "--quantize",
        choices=["fp8"],
        default=None,
        help="fp8: projection weights quantised to FP8 per output channel (activations per token) for serving; "
        "needs an FP8 GEMM (compute capability >= 8.9, MI300); docs/fp8-rollout.md",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3"],
        default="auto",
        help="KV-cache element type: auto = the model's dtype; fp8 (= fp8_e4m3) stores keys/values as float8_e4m3fn "
        "with a unit scale: twice the cached tokens in the same memory, faster long-context decode; on CUDA needs "
        "compute capability >= 8.9; docs/fp8-rollout.md",
    )
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def build_configs(args: argparse.Namespace):
    """(ServeConfig, RolloutConfig) from the parsed arguments; ConfigError for bad values."""

    api_key = args.api_key if args.api_key is not None else envvars.get(envvars.POLYRL_API_KEY)
    serve = ServeConfig(
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name or args.model,
        api_key=api_key,
        max_queue=args.max_queue,
        max_request_bytes=args.max_request_bytes,
        default_max_tokens=args.default_max_tokens,
        allow_request_chat_template=args.allow_request_chat_template,
        tool_call_parser=args.tool_call_parser,
        log_level=args.log_level,
    )
    engine = RolloutConfig(
        block_size=args.block_size,
        num_blocks=args.kv_cache_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        weight_precision=getattr(args, "quantize", None),
        kv_cache_dtype=None if getattr(args, "kv_cache_dtype", "auto") == "auto" else args.kv_cache_dtype,
    )
    return serve, engine


def run(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.model):
        raise UserError(f"--model {args.model!r} is not a folder; give an HF checkpoint folder (config.json, weights)")
    refuse_adapter(args.model, "serve")
    require_tokenizer(args.model)
    if args.device is not None:
        parse_device(args.device)
    serve, engine = build_configs(args)
    adapters = parse_adapters(args.lora)
    if adapters and engine.weight_precision is not None:
        raise UserError(f"--quantize {engine.weight_precision} does not combine with --lora yet; drop one of them")
    if not adapters:
        run_server(args.model, serve, engine_config=engine, dtype=args.dtype, device=args.device)
        return 0

    llm = load_llm(args.model, engine, dtype=args.dtype, device=args.device)
    names = llm.load_adapters(adapters)
    print(f"polyrl serve: LoRA adapters {', '.join(names)} on {serve.served_model_name!r}", flush=True)
    run_server(llm, serve)
    return 0


def parse_adapters(items: list[str]) -> dict[str, str]:
    """``["name=dir", ...]`` -> ``{name: dir}``; each folder must be a PEFT adapter folder."""

    out: dict[str, str] = {}
    for item in items:
        name, eq, path = item.partition("=")
        if not eq or not name or not path:
            raise UserError(f"--lora {item!r} must look like NAME=DIR, e.g. --lora math=runs/sft-lora/final")
        if name in out:
            raise UserError(f"--lora name {name!r} is given twice; give each adapter its own name")
        if not is_adapter_dir(path):
            raise UserError(f"--lora {name}={path}: no adapter_config.json there; give a PEFT adapter folder")
        out[name] = path
    return out
