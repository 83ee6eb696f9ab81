"""``polyrl bench rollout``: the rollout engine vs HF ``generate`` on the same prompts, in one run.

Random weights of a preset shape (``--shape qwen3-0.6b`` = the ``qwen3-0.6b-shape`` preset), random prompt
token ids, every sample generating exactly ``--gen-len`` tokens (EOS ignored). Prints:

- output tokens/s of the engine and of each baseline at ``--batch``, and the ratio;
- the decode roofline: per decode step the bytes that must be read (all weights once + the KV cache of
  every sequence at its mean context) over the device-to-device copy bandwidth measured here, as
  tokens/s, and the fraction of it the engine's decode phase reaches (timed inside the run, from the first step
  after every prompt is computed: ``_run_engine_phased``);
- batch-1 time per output token (engine and baselines);
- where a decode step's time goes: the engine's wall time per decode step against the device time of one
  replay of that batch's CUDA graph (the model alone, at the final context), and with ``--compare-sync`` the
  same run with synchronous steps (host work not overlapped with the device, ``RolloutConfig.overlap_decode``);
- bf16 log-prob agreement: the engine's sampled-token log-probs vs a training-style packed forward
  (``kernels.token_logprobs`` over ``lm_head_weight``) on the same tokens: max / mean abs difference.

``--response-format json_schema`` (or ``json_object``) also times the same run with every sample constrained by a
grammar (``SamplingParams.structured``: an array of tool calls that cannot close within ``--gen-len``, so every
token is masked: ``BENCH_SCHEMA``), built with the preset's tokenizer: constrained tokens/s, its cost against the free
run's decode phase (the issue's budget: at most 10% at batch 256 on the H200), the grammar compilations (1: cached
per schema), the host time of the batched grammar masks per step (mean and slowest), the grammar executor's
threads and lanes (default ``auto``: the engine's rule, ``structured.auto_lanes``; ``--grammar-lanes N``: N separate
lexers; ``--grammar-lanes auto,1,16``: each in one run, the first in the structured row, the others as A/B lines;
``--grammar-pipeline-ab``: one more A/B line, the first value with the (opt-in) feed/mask pipeline of guided steps,
whose share of steps the structured row reports; ``--guided-ab``: an A/B line per named part of the guided path as
it was before: ``steps4``, ``row-consume``, ``inline-upload``, ``read-at-step0``, ``old``), and where a guided decode
step's host time goes (``structured.HostTimes``, per step: the launches' time, of which waiting for the previous
step's tokens, the matchers consuming them, the masks, queueing the masked draw, and reading the previous launch,
which runs beside the steps' masks) against the guided step's wall time: on an accelerator the launch's forwards
run meanwhile, so a step's wall time above the launches' is host work between launches (schedule, inputs, outputs).

``--precision fp8`` also times the engine with FP8 projection weights, and with FP8 weights + an FP8 KV cache, in the
same run, with greedy agreement against the model's precision and log-prob mismatch (``bench/rollout_fp8.py``).

``--fuse-projections`` builds the engine with fused q/k/v and gate/up copies (``RolloutConfig.fuse_projections``,
``polyrl/infer/fused_projections.py``; made before the KV cache is sized, as the option does) but runs every other row
without them, then times the same engine unfused and fused, interleaved (off, on, off, on, ...; medians of 3, graphs
recaptured after each switch): output tokens/s, decode-step wall ms and the decode graph's device ms of both, the
ratio, the copies' bytes and the fused run's log-prob mismatch against the training forward (``FUSED_ROWS``).

``--decoder-options`` sets the built model's ``DecoderOptions``; ``--compare-parts`` times the decode path's parts
(``PARTS``) on and off, the ``DecoderOptions`` ones by replacing the model's options. Copy bandwidth comes from
``bench/common.py``. This module measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch

from polyrl import kernels
from polyrl.bench import rollout_fp8
from polyrl.bench.common import add_decoder_options, decoder_options, hf_moe_kwargs, measure_copy_bandwidth
from polyrl.errors import UserError
from polyrl.infer import LLM, RolloutConfig, SamplingParams, StructuredOutputs, overlap
from polyrl.kernels import registry
from polyrl.models.attention_metadata import AttnMetadata
from polyrl.models.decoder import DecoderLM, DecoderOptions, build_model
from polyrl.models.presets import PRESETS, preset_config
from polyrl.platform import device
from polyrl.platform.host import gc_paused


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="qwen3-0.6b", help="model preset (with or without the -shape suffix)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=256)
    parser.add_argument("--baselines", default="hf", help="comma-separated: hf, or none")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)
    parser.add_argument("--device", default=None, help="default: the accelerator, else cpu")
    parser.add_argument("--no-graphs", action="store_true", help="disable CUDA graphs (eager decode)")
    parser.add_argument("--logprob-seqs", type=int, default=16, help="sequences used for the log-prob check")
    parser.add_argument("--skip-batch1", action="store_true", help="skip the batch-1 latency runs")
    parser.add_argument(
        "--compare-sync", action="store_true", help="also time the engine without one-step-ahead decoding"
    )
    parser.add_argument("--decode-steps", type=int, default=None, help="decode steps per launch (RolloutConfig)")
    parser.add_argument(
        "--overlap-decode",
        choices=["auto", "on", "off"],
        default="auto",
        help="RolloutConfig.overlap_decode (auto: on an accelerator only; on: also on the CPU, where it measures the "
        "host work of the overlapped paths, since nothing runs asynchronously there)",
    )
    parser.add_argument(
        "--compare-parts",
        action="store_true",
        help="also time the engine without launch graphs (batch and batch-1) and without skinny_linear (batch-1)",
    )
    parser.add_argument(
        "--response-format",
        choices=["none", "json_schema", "json_object"],
        default="none",
        help="also time the run with every sample constrained to this structured output (llguidance mask)",
    )
    parser.add_argument(
        "--grammar-lanes",
        default=None,
        help="separately compiled matchers per schema (structured.GrammarCache.lanes; default auto: one per grammar "
        "executor thread on a host with >= 4 of them, else 1 (RolloutConfig.grammar_lanes = None); N gives rows N "
        "separate lexers, round-robin); a list (auto,1,16) times the constrained run once per value, the first in "
        "the structured row, the others as an A/B",
    )
    parser.add_argument(
        "--grammar-pipeline-ab",
        action="store_true",
        help="also time the first --grammar-lanes value with the feed/mask pipeline of guided steps on "
        "(overlap.PIPELINE, off by default): an A/B line",
    )
    parser.add_argument(
        "--guided-ab",
        default=None,
        help="also time the first --grammar-lanes value with parts of the guided decode path as they were before "
        "(comma-separated, an A/B line each): steps4 (4 steps per guided launch instead of "
        "overlap.GUIDED_LAUNCH_STEPS), row-consume (a consume_token per row instead of one executor call over the "
        "lanes), inline-upload (the masks' upload on the compute stream), read-at-step0 (the previous launch read "
        "whole beside step 0's masks), old (all four)",
    )
    add_decoder_options(parser)
    parser.add_argument(
        "--fuse-projections",
        action="store_true",
        help="also time the engine with q/k/v and gate/up fused into one GEMM each (RolloutConfig.fuse_projections) "
        "against the same engine unfused, interleaved in the same run",
    )
    rollout_fp8.add_arguments(parser)  # --precision fp8 (bench/rollout_fp8.py)
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")


def _sync(dev: torch.device) -> None:
    if dev.type != "cpu":
        device.synchronize()


def _model(shape: str, dtype: torch.dtype, dev: torch.device, options: DecoderOptions | None = None) -> DecoderLM:
    name = shape if shape in PRESETS else f"{shape}-shape"
    cfg = preset_config(name)
    return build_model(cfg, dtype=dtype, device=dev, seed=0, options=options).eval()


def _run_engine(llm, prompts: list[list[int]], gen: int, dev: torch.device, seed: int | None = None):
    params = SamplingParams(temperature=1.0, max_tokens=gen, ignore_eos=True, seed=seed)
    _sync(dev)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    _sync(dev)
    return time.perf_counter() - t, outs


# --response-format json_schema: tool calls (a name and its arguments) in an array that cannot close within the run,
# so every token is constrained. The free-text argument is a bounded string of letters: the preset tokenizer pads its
# vocabulary with ~148k ``<filler_N>`` tokens of 10-17 bytes, all valid JSON-string content, and a bounded string
# that allows them ("maxLength": 24) defeats llguidance's precomputed token slices, so each row entering such a
# string walks all of them (2-30 ms of one core per row; the step waits for its slowest row). A real tokenizer's
# vocabulary is mostly short tokens and has no such state; this schema's masks take ~0.2 ms per row at most.
BENCH_SCHEMA = {
    "type": "array",
    "minItems": 100000,
    "items": {
        "type": "object",
        "properties": {
            "name": {"enum": ["get_weather", "search_flights", "book_hotel"]},
            "arguments": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"},
                    "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                    "refundable": {"type": "boolean"},
                },
                "required": ["city", "date", "days", "unit", "refundable"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    },
}


def _run_engine_phased(llm, prompts: list[list[int]], gen: int, dev: torch.device, structured=None) -> dict:
    """``generate`` stepped by hand, timing the decode phase inside the same run: it starts (after one device sync)
    at the first step after which no sequence waits or has prompt tokens left to compute, and counts the tokens
    drawn from then on (launched ones included). A separate prefill-only run to subtract is noisier than the decode
    phase itself when the prefill dominates (the 4k-context case: 64 x 4032 prompt tokens)."""
    params = SamplingParams(temperature=1.0, max_tokens=gen, ignore_eos=True, structured=structured)
    ids = [llm.add_request(p, params) for p in prompts]
    done: dict[str, object] = {}
    sched = llm.scheduler
    start = None
    _sync(dev)
    t0 = time.perf_counter()
    with gc_paused(llm.config.pause_gc):
        while len(done) < len(ids):
            for out in llm.step(ahead=True):
                if out.finished:
                    done[out.request_id] = out
            if start is None and not sched.waiting and all(q.num_computed >= q.num_prompt for q in sched.running):
                _sync(dev)
                drawn = llm.num_generated_tokens + sum(q.pending for q in sched.running)
                start = (time.perf_counter(), drawn, llm.num_steps)
    llm._flush()
    _sync(dev)
    t_end = time.perf_counter()
    if start is None:  # nothing left to decode after the prefill
        start = (t_end, llm.num_generated_tokens, llm.num_steps)
    return {
        "total_s": t_end - t0,
        "decode_s": max(t_end - start[0], 1e-9),
        "decode_tokens": llm.num_generated_tokens - start[1],
        "decode_steps": max(llm.num_steps - start[2], 1),
        "outs": [done[i] for i in ids],
    }


def _hf_model(model, dev: torch.device):
    # lazy: transformers is the optional HF baseline, imported only when that row runs
    import transformers

    cfg = transformers.AutoConfig.for_model(**model.config.to_hf_dict())
    cfg._attn_implementation = "sdpa"
    dtype = next(model.parameters()).dtype
    with torch.device(dev):
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype, **hf_moe_kwargs(model.config, "hf"))
    hf.load_state_dict(model.state_dict(), strict=False)
    return hf.eval()


@torch.inference_mode()
def _run_hf(hf, prompts: list[list[int]], gen: int, dev: torch.device) -> float:
    ids = torch.tensor(prompts, device=dev)
    _sync(dev)
    t = time.perf_counter()
    hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=gen,
        min_new_tokens=gen,
        do_sample=True,
        top_k=0,
        top_p=1.0,
        temperature=1.0,
        pad_token_id=0,
    )
    _sync(dev)
    return time.perf_counter() - t


@torch.inference_mode()
def logprob_agreement(model, outs, count: int) -> tuple[float, float]:
    """Max / mean |engine log-prob - training forward log-prob| over the first ``count`` samples."""
    dev = next(model.parameters()).device
    diffs = []
    for out in outs[:count]:
        c = out.outputs[0]
        ids = torch.tensor(out.prompt_token_ids + c.token_ids, device=dev)
        hidden = model(ids, torch.arange(len(ids), device=dev), AttnMetadata.from_seqlens([len(ids)], dev))
        p = out.num_prompt_tokens
        targets = torch.tensor(c.token_ids, device=dev)
        ref = kernels.token_logprobs(hidden[p - 1 : -1], model.lm_head_weight, targets)
        diffs.append((torch.tensor(c.logprobs, device=dev) - ref.float()).abs())
    d = torch.cat(diffs)
    return d.max().item(), d.mean().item()


def graph_replay_ms(llm, batch: int, reps: int = 20) -> float | None:
    """Device time of one replay of the decode graph for ``batch`` (its buffers hold the last step's inputs),
    or None without graphs: what a decode step costs when the host adds nothing."""
    graphs = llm.runner.graphs
    if graphs is None:
        return None
    entry = graphs.graphs.get(graphs.bucket(batch))
    if entry is None:
        return None
    graph = entry[0]
    graph.replay()
    start, end = device.event(), device.event()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    device.synchronize()
    return start.elapsed_time(end) / reps


def roofline_tokens_per_s(model, batch: int, prompt_len: int, gen_len: int, kv_dtype_bytes: int, bw: float) -> float:
    """Decode tokens/s if each step only had to read weights once plus the KV cache at the mean context. An MoE
    model's step reads only the experts its ``batch`` tokens pick: with uniform routing the expected number per layer
    is ``E * (1 - (1 - k/E) ** batch)`` (all of them at batch 256 with 8 of 128, about 8 at batch 1)."""
    cfg = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if cfg.is_moe:
        e, k = cfg.num_experts, cfg.num_experts_per_tok
        expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * next(model.parameters()).element_size()
        unread = e - e * (1 - (1 - k / e) ** batch)
        weight_bytes -= len(cfg.moe_layers) * unread * expert_bytes
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_dtype_bytes
    mean_ctx = prompt_len + gen_len / 2
    step_bytes = weight_bytes + batch * mean_ctx * kv_per_token
    return batch * bw / step_bytes


def run(args: argparse.Namespace) -> int:
    for value in str(args.grammar_lanes or "auto").split(","):
        _grammar_lanes(value)  # a bad --grammar-lanes fails before the runs
    _guided_ab(args.guided_ab)  # and a bad --guided-ab
    sizes = {"--batch": args.batch, "--prompt-len": args.prompt_len, "--gen-len": args.gen_len}
    bad = [f"{flag} {value}" for flag, value in sizes.items() if value < 1]
    if bad:  # before the model is built (--batch 0 ended in a ZeroDivisionError after the runs, -1 in a traceback)
        raise UserError(f"{', '.join(bad)}: --batch, --prompt-len and --gen-len must each be >= 1")
    dev = device.parse_device(args.device) if args.device else device.torch_device()
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if dev.type != "cpu" else torch.float32)
    baselines = [b for b in args.baselines.split(",") if b and b != "none"]
    model = _model(args.shape, dtype, dev, decoder_options(args.decoder_options))
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, cfg.vocab_size, (args.batch, args.prompt_len), generator=g).tolist()
    ecfg = RolloutConfig(
        max_num_seqs=max(args.batch, 1),
        max_num_batched_tokens=max(8192, args.batch),
        max_model_len=args.prompt_len + args.gen_len + 1,
        cuda_graphs=False if args.no_graphs else None,
        **({"decode_steps": args.decode_steps} if args.decode_steps else {}),
        overlap_decode={"auto": None, "on": True, "off": False}[args.overlap_decode],
        fuse_projections=args.fuse_projections,
    )
    tokenizer = None
    if args.response_format != "none":  # structured outputs need the vocabulary as text: the preset's own tokenizer
        # lazy: the preset tokenizer (transformers) is built only for the constrained run
        from polyrl.models.presets import get_preset
        from polyrl.models.tokenizer import build_tokenizer

        spec = get_preset(args.shape if args.shape in PRESETS else f"{args.shape}-shape")
        tokenizer = build_tokenizer(cfg.vocab_size, trained_vocab=spec.trained_vocab, seed=0)
    llm = LLM(model, tokenizer, ecfg)
    # --fuse-projections: the copies were made before the cache was sized; every row but the A/B runs without them
    fused_copies, llm.runner.fused = llm.runner.fused, None
    ecfg = dataclasses.replace(ecfg, fuse_projections=False)  # the FP8 engines' base config
    res: dict[str, float | str] = {"shape": args.shape, "device": device.name() if dev.type != "cpu" else "cpu"}
    print(
        f"# {args.shape} on {res['device']}: {model.num_parameters() / 1e6:.0f}M params, {dtype}, "
        f"batch {args.batch}, prompt {args.prompt_len}, gen {args.gen_len}; KV cache {llm.kv.num_blocks} blocks "
        f"({llm.kv.total_bytes / 2**30:.1f} GiB), CUDA graphs {'on' if llm.runner.use_graphs else 'off'}, "
        f"{ecfg.decode_steps} decode step(s) per launch"
    )

    # Warm-up: every decode graph bucket up to the batch (what the timed runs use, the shrinking tail included),
    # then kernel compilation.
    res["graph_capture_s"] = llm.capture_graphs(args.batch)
    # long enough for the mixed prefill + decode steps of a full-batch run (each new step shape compiles once)
    _run_engine(llm, prompts, min(args.gen_len, 16), dev)
    _run_engine(llm, prompts[:1], 4, dev)
    llm.reset_prefix_cache()
    full = _run_engine_phased(llm, prompts, args.gen_len, dev)
    t_full, outs = full["total_s"], full["outs"]
    n_out = args.batch * args.gen_len
    res["engine_tok_s"] = n_out / t_full
    res["engine_decode_tok_s"] = full["decode_tokens"] / full["decode_s"]
    res["engine_decode_step_ms"] = 1e3 * full["decode_s"] / full["decode_steps"]
    graph_ms = graph_replay_ms(llm, args.batch)
    if graph_ms is not None:
        res["graph_replay_ms"] = graph_ms
    bw = measure_copy_bandwidth(dev)
    kv_bytes = llm.kv.caches[0][0].element_size()
    res["copy_bandwidth_gb_s"] = bw / 1e9
    res["roofline_tok_s"] = roofline_tokens_per_s(model, args.batch, args.prompt_len, args.gen_len, kv_bytes, bw)
    res["roofline_fraction"] = res["engine_decode_tok_s"] / res["roofline_tok_s"]
    lp_max, lp_mean = logprob_agreement(model, outs, args.logprob_seqs)
    res["logprob_max_abs_diff"], res["logprob_mean_abs_diff"] = lp_max, lp_mean
    if not args.skip_batch1:
        llm.reset_prefix_cache()
        t1_prefill, _ = _run_engine(llm, prompts[:1], 1, dev)
        llm.reset_prefix_cache()
        t1, _ = _run_engine(llm, prompts[:1], args.gen_len, dev)
        res["engine_batch1_ms_per_token"] = 1e3 * t1 / args.gen_len
        # the decode phase alone (the eager prefill of one prompt is host-bound: ~400 kernel launches from Python)
        res["engine_batch1_decode_ms_per_token"] = 1e3 * max(t1 - t1_prefill, 1e-9) / max(args.gen_len - 1, 1)
    stats = llm.stats()
    res["engine_preemptions"] = stats["num_preemptions"]
    if args.compare_sync:
        before, llm.config.overlap_decode = llm.config.overlap_decode, False
        llm.reset_prefix_cache()
        sync = _run_engine_phased(llm, prompts, args.gen_len, dev)
        res["engine_sync_tok_s"] = n_out / sync["total_s"]
        res["engine_sync_decode_step_ms"] = 1e3 * sync["decode_s"] / sync["decode_steps"]
        llm.config.overlap_decode = before
    if args.compare_parts:
        _compare_parts(llm, prompts, args, dev, res)
    if args.response_format != "none":
        _constrained(llm, prompts, args, dev, res)
    if fused_copies is not None:
        _fused_ab(llm, fused_copies, prompts, args, dev, res)
    if args.precision != "model":  # the same engine with FP8 weights (and KV), same run (bench/rollout_fp8.py)
        base_greedy = rollout_fp8.greedy(llm, prompts[: args.agree_seqs], args.agree_tokens)
        llm.release()
        timed = lambda e: _run_engine_phased(e, prompts, args.gen_len, dev)  # noqa: E731 - the bench's own timing
        measures = rollout_fp8.Measures(graph_replay_ms, logprob_agreement, roofline_tokens_per_s)
        rollout_fp8.run_fp8(model, prompts, args, dev, ecfg, res, base_greedy, timed, measures)
    llm.release()

    if "hf" in baselines:
        hf = _hf_model(model, dev)
        _run_hf(hf, prompts[: min(4, args.batch)], 4, dev)
        t_hf = _run_hf(hf, prompts, args.gen_len, dev)
        res["hf_tok_s"] = n_out / t_hf
        res["ratio_vs_hf"] = res["engine_tok_s"] / res["hf_tok_s"]
        if not args.skip_batch1:
            res["hf_batch1_ms_per_token"] = 1e3 * _run_hf(hf, prompts[:1], args.gen_len, dev) / args.gen_len
        del hf
    for b in baselines:
        if b != "hf":
            print(f"# baseline {b!r} is not known here (known: hf); skipped")

    _print(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


# The decode path's parts --compare-parts switches on and off: (name, what it is, measured at the batch, at batch 1)
PARTS = (
    ("launch_graphs", "a launch of decode_steps steps as one graph, sampling inside", True, True),
    ("parallel_proj", "q/k/v and gate/up as concurrent GEMMs (DecoderOptions.parallel_projections)", True, False),
    ("fused_qk", "q/k norms + RoPE in one kernel (DecoderOptions.fused_qk_norm_rope)", True, True),
    ("skinny", "batch-1 projections by kernels.skinny_linear instead of cuBLAS", False, True),
    ("grouped", "q/k/v and gate/up in one skinny_linear launch each (DecoderOptions.group_projections)", False, True),
)


def _compare_parts(llm, prompts: list[list[int]], args: argparse.Namespace, dev: torch.device, res: dict) -> None:
    """The same runs with each of ``PARTS`` on and off, interleaved (on, off, on, off, ...; medians of 3 each, so
    drift between runs does not read as a difference). A part that changes what the graphs hold recaptures them in
    an untimed short run after every switch. Each part is left as it was found."""
    reps = 3
    kernels_env = os.environ.get("POLYRL_KERNELS")

    def set_skinny(on: bool) -> None:
        if not on:
            os.environ["POLYRL_KERNELS"] = "skinny_linear:reference"
        elif kernels_env is None:
            os.environ.pop("POLYRL_KERNELS", None)
        else:
            os.environ["POLYRL_KERNELS"] = kernels_env
        registry.reset_cache()

    def flag(field: str):  # a DecoderOptions field of the engine's model (read at each forward, so at each capture)
        def set_flag(on: bool) -> None:
            llm.model.options = dataclasses.replace(llm.model.options, **{field: on})

        return set_flag, getattr(llm.model.options, field)

    def set_launch(on: bool) -> None:
        llm.config.launch_graphs = on

    switches = {  # name -> (setter, the value found, whether the captured graphs change with it)
        "launch_graphs": (set_launch, llm.config.launch_graphs, False),
        "parallel_proj": (*flag("parallel_projections"), True),
        "fused_qk": (*flag("fused_qk_norm_rope"), True),
        "skinny": (set_skinny, True, True),
        "grouped": (*flag("group_projections"), True),
    }
    t_prefill1 = None
    if not args.skip_batch1:
        llm.reset_prefix_cache()
        t_prefill1 = _run_engine(llm, prompts[:1], 1, dev)[0]

    def timed(batch: int) -> float:
        llm.reset_prefix_cache()
        return _run_engine(llm, prompts[:batch], args.gen_len, dev)[0]

    for name, _, at_batch, at_one in PARTS:
        setter, found, recapture = switches[name]
        batches = ([args.batch] if at_batch and args.batch > 1 else []) + (
            [1] if at_one and not args.skip_batch1 else []
        )
        try:
            for batch in batches:
                times: dict[bool, list[float]] = {True: [], False: []}
                for _ in range(reps):
                    for on in (True, False):
                        setter(on)
                        if recapture:
                            llm.runner.invalidate_graphs()
                            llm.reset_prefix_cache()
                            _run_engine(llm, prompts[:batch], min(args.gen_len, 8), dev)
                        times[on].append(timed(batch))
                for on in (True, False):
                    t = statistics.median(times[on])
                    key = f"engine_{'' if on else 'no_'}{name}"
                    if batch > 1:
                        res[f"{key}_tok_s"] = batch * args.gen_len / t
                    else:
                        res[f"{key}_batch1_decode_ms_per_token"] = (
                            1e3 * max(t - t_prefill1, 1e-9) / max(args.gen_len - 1, 1)
                        )
        finally:
            setter(found)
            if recapture:
                llm.runner.invalidate_graphs()


def _fused_ab(llm, copies, prompts: list[list[int]], args: argparse.Namespace, dev: torch.device, res: dict) -> None:
    """``--fuse-projections``: the engine without and with its fused q/k/v + gate/up copies (``copies``, a
    ``FusedProjections``), interleaved (off, on, off, on, ...; medians of 3 phased runs each, so drift between runs
    does not read as a difference); after every switch all decode graphs up to the batch are recaptured and a short
    untimed run warms the path. The engine is left unfused, graphs dropped."""
    reps = 3
    n_out = args.batch * args.gen_len
    runs: dict[bool, list[dict]] = {False: [], True: []}
    replay: dict[bool, float | None] = {}
    try:
        for _ in range(reps):
            for on in (False, True):
                llm.runner.fused = copies if on else None
                llm.runner.invalidate_graphs()
                llm.capture_graphs(args.batch)
                llm.reset_prefix_cache()
                _run_engine(llm, prompts, min(args.gen_len, 8), dev)
                llm.reset_prefix_cache()
                runs[on].append(_run_engine_phased(llm, prompts, args.gen_len, dev))
                if on not in replay:
                    replay[on] = graph_replay_ms(llm, args.batch)
    finally:
        llm.runner.fused = None
        llm.runner.invalidate_graphs()
    for on, key in ((False, "unfused"), (True, "fused")):
        res[f"{key}_tok_s"] = statistics.median(n_out / r["total_s"] for r in runs[on])
        res[f"{key}_decode_step_ms"] = statistics.median(1e3 * r["decode_s"] / r["decode_steps"] for r in runs[on])
        if replay[on] is not None:
            res[f"{key}_graph_replay_ms"] = replay[on]
    res["fused_speedup"] = res["fused_tok_s"] / res["unfused_tok_s"]
    res["fused_weight_bytes"] = copies.nbytes
    res["fused_groups"] = len(copies.entries)
    lp_max, lp_mean = logprob_agreement(llm.model, runs[True][-1]["outs"], args.logprob_seqs)
    res["fused_logprob_max_abs_diff"], res["fused_logprob_mean_abs_diff"] = lp_max, lp_mean


# --fuse-projections rows: (label, key, format)
FUSED_ROWS = (
    ("A/B unfused: output tokens/s", "unfused_tok_s", "{:,.0f}"),
    ("A/B fused:   output tokens/s", "fused_tok_s", "{:,.0f}"),
    ("A/B unfused: decode step ms (wall)", "unfused_decode_step_ms", "{:.3f}"),
    ("A/B fused:   decode step ms (wall)", "fused_decode_step_ms", "{:.3f}"),
    ("A/B unfused: graph replay ms", "unfused_graph_replay_ms", "{:.3f}"),
    ("A/B fused:   graph replay ms", "fused_graph_replay_ms", "{:.3f}"),
    ("A/B fused / unfused (output)", "fused_speedup", "{:.3f}x"),
    ("fused copies GiB (groups)", "fused_weight_bytes", "{:.2f}"),
    ("fused log-prob |eng - train| max", "fused_logprob_max_abs_diff", "{:.2e}"),
    ("fused log-prob |eng - train| mean", "fused_logprob_mean_abs_diff", "{:.2e}"),
)


def _constrained(llm, prompts: list[list[int]], args: argparse.Namespace, dev: torch.device, res: dict) -> None:
    """The same run with every sample constrained (``--response-format``): tokens/s and cost vs the free run, for
    the first ``--grammar-lanes`` value (the structured row) and each further one (an A/B in the same run)."""
    lanes = [x.strip() for x in str(args.grammar_lanes).split(",")] if args.grammar_lanes is not None else [None]
    _constrained_run(llm, prompts, args, dev, res, lanes[0])
    for n in lanes[1:]:
        ab: dict = {"engine_decode_tok_s": res["engine_decode_tok_s"]}
        _constrained_run(llm, prompts, args, dev, ab, n)
        res[f"lanes{n}_constrained_decode_cost"] = ab["constrained_decode_cost"]
        res[f"lanes{n}_constrained_decode_step_ms"] = ab["constrained_decode_step_ms"]
        res[f"lanes{n}_grammar_mask_ms_mean"] = ab["grammar_mask_ms_mean"]
    for name in _guided_ab(args.guided_ab):
        ab = {"engine_decode_tok_s": res["engine_decode_tok_s"]}
        _constrained_run(llm, prompts, args, dev, ab, lanes[0], GUIDED_AB[name])
        for key in ("constrained_decode_cost", "constrained_decode_step_ms", "grammar_mask_ms_mean"):
            res[f"guided_ab_{name}_{key}"] = ab[key]
    if args.grammar_pipeline_ab:
        ab = {"engine_decode_tok_s": res["engine_decode_tok_s"]}
        was, overlap.PIPELINE = overlap.PIPELINE, not overlap.PIPELINE
        try:
            _constrained_run(llm, prompts, args, dev, ab, lanes[0])
        finally:
            overlap.PIPELINE = was
        for key in ("constrained_decode_cost", "constrained_decode_step_ms", "grammar_mask_ms_mean"):
            res[f"pipe_{key}"] = ab[key]


# --guided-ab: name -> (decode steps per guided launch, one executor call per step's consumes, side-stream upload,
# the previous launch read a step at a time beside each step's masks)
GUIDED_AB = {
    "steps4": (4, True, True, True),
    "row-consume": (None, False, True, True),
    "inline-upload": (None, True, False, True),
    "read-at-step0": (None, True, True, False),
    "old": (4, False, False, False),
}


def _guided_ab(value: str | None) -> list[str]:
    names = [x.strip() for x in value.split(",") if x.strip()] if value else []
    bad = [n for n in names if n not in GUIDED_AB]
    if bad:
        raise UserError(f"--guided-ab takes {', '.join(GUIDED_AB)} (comma-separated), got {bad[0]!r}")
    return names


def _grammar_lanes(value: str) -> int | None:
    """A ``--grammar-lanes`` value: ``auto`` (None: ``structured.auto_lanes``) or a count >= 1."""
    if value.strip() == "auto":
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise UserError(f"--grammar-lanes takes 'auto' or counts >= 1 (comma-separated), got {value!r}")
    return n


def _constrained_run(llm, prompts, args, dev: torch.device, res: dict, lanes: str | None, variant=None) -> None:
    """One constrained run; ``variant``: a ``GUIDED_AB`` value, the guided path's parts set for this run only."""
    if variant is None:
        return _constrained_run_as_set(llm, prompts, args, dev, res, lanes)
    # lazy: structured.py needs llguidance, only for --response-format
    from polyrl.infer import structured

    steps, par, side, split = variant
    was = overlap.GUIDED_LAUNCH_STEPS, structured.SIDE_STREAM_UPLOAD, overlap.SPLIT_READ
    if steps is not None:
        overlap.GUIDED_LAUNCH_STEPS = steps
    structured.SIDE_STREAM_UPLOAD, overlap.SPLIT_READ = side, split
    try:
        _constrained_run_as_set(llm, prompts, args, dev, res, lanes, par)
    finally:
        overlap.GUIDED_LAUNCH_STEPS, structured.SIDE_STREAM_UPLOAD, overlap.SPLIT_READ = was
        cache = llm.grammar_cache()
        cache.par_consume = cache.lanes > 1 and cache.num_threads >= structured.AUTO_LANES_MIN_THREADS  # its rule


def _constrained_run_as_set(llm, prompts, args, dev, res: dict, lanes: str | None, par: bool = True) -> None:
    kind = args.response_format
    so = StructuredOutputs.json_schema(BENCH_SCHEMA) if kind == "json_schema" else StructuredOutputs("json_object")
    if lanes is not None:  # a fresh cache per value (the engine's own is made with RolloutConfig.grammar_lanes)
        # lazy: structured.py needs llguidance, only for --response-format
        from polyrl.infer.structured import GrammarCache

        n = _grammar_lanes(lanes)
        llm._grammars = GrammarCache(llm.tokenizer, llm.vocab_size, llm.eos_token_ids, lanes=n)
    if not par:  # --guided-ab row-consume / old
        llm.grammar_cache().par_consume = False
    llm.reset_prefix_cache()
    _run_engine_phased(llm, prompts[: min(8, len(prompts))], 8, dev, so)  # warm-up: the one compilation
    llm.reset_prefix_cache()
    cache = llm.grammar_cache()
    cache.mask_calls, cache.mask_s, cache.mask_max_s = 0, 0.0, 0.0
    cache.times.reset()
    llm.sampler.mask_buffers.starts = 0
    run = _run_engine_phased(llm, prompts, args.gen_len, dev, so)
    times = cache.times
    if times.steps:  # the overlapped guided launches' host time, per decode step (structured.HostTimes)
        res["guided_steps_per_launch"] = times.steps / max(times.launches, 1)
        res["guided_pipelined_fraction"] = llm.sampler.mask_buffers.starts / times.steps
        for part, ms in times.ms_per_step().items():
            res[f"guided_host_{part}_ms"] = ms
    res["constrained_decode_step_ms"] = 1e3 * run["decode_s"] / run["decode_steps"]
    res["response_format"] = kind
    res["grammar_threads"], res["grammar_lanes"], res["grammar_lanes_auto"] = cache.num_threads, cache.lanes, cache.auto
    res["grammar_par_consume"] = cache.par_consume  # a step's consumes in one executor call (GrammarCache.consume)
    res["grammar_mask_ms_mean"] = 1e3 * cache.mask_s / max(cache.mask_calls, 1)
    res["grammar_mask_ms_max"] = 1e3 * cache.mask_max_s
    res["constrained_tok_s"] = args.batch * args.gen_len / run["total_s"]
    res["constrained_decode_tok_s"] = run["decode_tokens"] / run["decode_s"]
    res["constrained_decode_cost"] = 1.0 - res["constrained_decode_tok_s"] / res["engine_decode_tok_s"]
    res["grammar_compiles"] = cache.compiles


def _print(res: dict) -> None:
    rows = [
        ("engine output tokens/s", "engine_tok_s", "{:,.0f}"),
        ("engine decode-phase tokens/s", "engine_decode_tok_s", "{:,.0f}"),
        ("HF generate output tokens/s", "hf_tok_s", "{:,.0f}"),
        ("ratio engine / HF", "ratio_vs_hf", "{:.1f}x"),
        ("copy bandwidth GB/s", "copy_bandwidth_gb_s", "{:,.0f}"),
        ("decode roofline tokens/s", "roofline_tok_s", "{:,.0f}"),
        ("fraction of roofline (decode)", "roofline_fraction", "{:.0%}"),
        ("engine decode step ms (wall)", "engine_decode_step_ms", "{:.2f}"),
        ("graph replay ms (device only)", "graph_replay_ms", "{:.2f}"),
        ("engine, synchronous steps, tokens/s", "engine_sync_tok_s", "{:,.0f}"),
        ("synchronous decode step ms (wall)", "engine_sync_decode_step_ms", "{:.2f}"),
        ("engine batch-1 ms/token", "engine_batch1_ms_per_token", "{:.2f}"),
        ("engine batch-1 decode ms/token", "engine_batch1_decode_ms_per_token", "{:.2f}"),
        ("HF batch-1 ms/token", "hf_batch1_ms_per_token", "{:.2f}"),
        ("log-prob |engine - train fwd| max", "logprob_max_abs_diff", "{:.2e}"),
        ("log-prob |engine - train fwd| mean", "logprob_mean_abs_diff", "{:.2e}"),
        ("engine preemptions", "engine_preemptions", "{}"),
        ("constrained output tokens/s", "constrained_tok_s", "{:,.0f}"),
        ("constrained decode-phase tokens/s", "constrained_decode_tok_s", "{:,.0f}"),
        ("constrained decode cost vs free", "constrained_decode_cost", "{:.1%}"),
        ("grammar compilations", "grammar_compiles", "{}"),
        ("grammar mask ms/step (host, mean)", "grammar_mask_ms_mean", "{:.2f}"),
        ("grammar mask ms/step (host, max)", "grammar_mask_ms_max", "{:.2f}"),
        ("grammar executor threads / lanes", "grammar_lanes", "{}"),
        ("constrained decode step ms (wall)", "constrained_decode_step_ms", "{:.2f}"),
        ("grammar consumes: one executor call", "grammar_par_consume", "{}"),
        ("guided decode steps per launch", "guided_steps_per_launch", "{:.2f}"),
        ("guided steps feed/mask pipelined", "guided_pipelined_fraction", "{:.0%}"),
        ("guided host ms/step: in launches", "guided_host_launch_ms", "{:.2f}"),
        ("  waiting for the step's tokens", "guided_host_wait_ms", "{:.2f}"),
        ("  matchers consuming them", "guided_host_consume_ms", "{:.2f}"),
        ("  computing the masks", "guided_host_mask_ms", "{:.2f}"),
        ("  queueing upload + masked draw", "guided_host_draw_ms", "{:.2f}"),
        ("  reading the prev. launch (beside)", "guided_host_read_ms", "{:.2f}"),
        ("graph capture s (all buckets, once)", "graph_capture_s", "{:.2f}"),
    ]
    for label, key, fmt in rows:
        if key == "grammar_lanes" and key in res:
            auto = " (auto)" if res.get("grammar_lanes_auto") else ""
            print(f"{label:<36} {res['grammar_threads']} / {res[key]}{auto}")
        elif key in res:
            print(f"{label:<36} {fmt.format(res[key])}")
    for key in [k for k in res if k.startswith("lanes") and k.endswith("_constrained_decode_cost")]:  # lanes A/B
        n = key[len("lanes") : -len("_constrained_decode_cost")]
        step, mask = res[f"lanes{n}_constrained_decode_step_ms"], res[f"lanes{n}_grammar_mask_ms_mean"]
        print(f"{f'A/B {n} grammar lanes: cost':<36} {res[key]:.1%} (step {step:.2f} ms, mask {mask:.2f} ms)")
    for name in GUIDED_AB:  # --guided-ab
        if f"guided_ab_{name}_constrained_decode_cost" in res:
            at = f"guided_ab_{name}_"
            cost, step = res[f"{at}constrained_decode_cost"], res[f"{at}constrained_decode_step_ms"]
            mask = res[f"{at}grammar_mask_ms_mean"]
            print(f"{f'A/B guided {name}: cost':<36} {cost:.1%} (step {step:.2f} ms, mask {mask:.2f} ms)")
    if "pipe_constrained_decode_cost" in res:  # --grammar-pipeline-ab
        step, mask = res["pipe_constrained_decode_step_ms"], res["pipe_grammar_mask_ms_mean"]
        cost = res["pipe_constrained_decode_cost"]
        print(f"{'A/B feed/mask pipeline on: cost':<36} {cost:.1%} (step {step:.2f} ms, mask {mask:.2f} ms)")
    for label, key, fmt in FUSED_ROWS:  # --fuse-projections
        if key == "fused_weight_bytes" and key in res:
            print(f"{label:<36} {res[key] / 2**30:.2f} ({res['fused_groups']})")
        elif key in res:
            print(f"{label:<36} {fmt.format(res[key])}")
    rollout_fp8.print_rows(res)  # --precision fp8
    for name, what, _, _ in PARTS:  # --compare-parts
        for on, tag in ((True, "on"), (False, "off")):
            prefix = f"engine_{'' if on else 'no_'}{name}"
            if f"{prefix}_tok_s" in res:
                print(f"{f'A/B {name} {tag}: tokens/s':<36} {res[f'{prefix}_tok_s']:,.0f}")
            if f"{prefix}_batch1_decode_ms_per_token" in res:
                print(f"{f'A/B {name} {tag}: b1 decode ms':<36} {res[f'{prefix}_batch1_decode_ms_per_token']:.2f}")
        if f"engine_{name}_tok_s" in res or f"engine_{name}_batch1_decode_ms_per_token" in res:
            print(f"    ({name}: {what})")
