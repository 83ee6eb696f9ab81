"""Batched continuation scoring: ``sum log p(continuation | context)`` and whether every continuation token is the
argmax, for thousands of (context, continuation) pairs at once (lm-eval's ``loglikelihood``).

The engine's request path (``LLM.generate`` with ``prompt_logprobs``) pays per request for a ``Sequence``, the
scheduler, a sampled token, a ``RequestOutput`` and per-token Python lists; this path pays a few list operations per
request and runs the model directly on the engine's paged KV cache:

- **shared contexts**: requests are grouped by context (``owner``). In one forward, a context's leading full KV blocks
  (``s = floor((c - 1) / block_size) * block_size`` of its ``c`` tokens) are one sequence, and each of its
  continuations is a branch sequence of the context's tail ``ctx[s:]`` plus the continuation, whose block table
  starts with the shared blocks. Every layer writes the step's keys/values before it attends
  (``models/decoder.py``), so branches read the shared blocks written in the same forward: a four-way
  multiple-choice document computes its context once (plus up to ``block_size`` tail tokens per choice). A context
  with one continuation is a single sequence. The last continuation token is never fed (nothing scores
  what follows it), as lm-eval's ``hf`` backend does.
- **only the continuation rows reach the LM head**: the hidden rows at positions ``c - 1 .. c + L - 2``, in row
  chunks of at most ``ROW_CHUNK_ELEMS`` logits (logits in the model's dtype, upcast, log-softmax: the arithmetic of
  ``kernels.token_logprobs``' reference; on CUDA that op's Triton row kernel reads the model-dtype logits once for
  the log-sum-exp and the log-prob, no fp32 copy: ``prompt_logprobs.logit_row_stats``); never a ``[T, V]`` log-softmax.
- **no host sync per batch**: per-request sums and greedy flags accumulate on the device (``index_add_``); the host
  reads them once at the end. Batches of at most ``RolloutConfig.max_num_batched_tokens`` tokens (what the cache
  sizing reserved activations for); their index arrays are built by numpy with no Python step per sequence
  (``_arrays``) and go to the device in one pinned copy (``batch.to_device``).

``score_prompts`` scores every position of whole prompts the same way (a server's ``echo`` + ``logprobs`` request,
``server/scoring.py``): per token its log-prob and the argmax (id, log-prob), read in one transfer at the end.

The KV blocks are borrowed from the engine's ``BlockManager`` for the call and given back (evicting cached prefixes
as any allocation does); the engine is not stepped. It must be idle, or (``require_idle=False``) the call runs on the
engine's own thread between steps: running sequences keep their blocks and every forward is queued on the same
stream. Not here: tokenisation, lm-eval's request objects (``polyrl/eval/harness.py``), top-k > 1 alternatives and
ranks (``prompt_logprobs.py``, the request path), LoRA adapter banks (a served adapter engine uses the request path).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import torch

from polyrl.errors import UserError
from polyrl.infer.batch import to_device
from polyrl.infer.prompt_logprobs import logit_row_stats, uses_row_kernel
from polyrl.infer.sampling_params import SamplingParams
from polyrl.infer.sequence import Sequence
from polyrl.models.attention_metadata import AttnMetadata
from polyrl.platform import device as platform_device

ROW_CHUNK_ELEMS = 1 << 25  # logits elements per LM-head chunk: [rows, V] fp32 = 128 MiB (220 rows at V = 152k)


@dataclass
class ScoreResult:
    logprobs: list[float]  # per request: sum of the continuation tokens' log-probs
    greedy: list[bool]  # per request: every continuation token is the argmax of its distribution
    stats: dict[str, float] = field(default_factory=dict)  # seconds and counts (``score_continuations``)
    # per_token=True: per request, per continuation token: its log-prob, the argmax token and the argmax's log-prob
    token_logprobs: list[list[float]] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


def supports_scoring(llm: Any) -> bool:
    """Whether ``llm`` can take this path: its KV cache is allocated and no LoRA adapter bank is attached (adapter
    slots are per request; the request path handles them)."""
    return llm.kv.caches is not None and getattr(llm.model, "lora_bank", None) is None


@dataclass
class _Batch:
    seq_tokens: list[list[int]]  # fed tokens of each sequence of the forward
    seq_start: list[int]  # first position of each sequence (a multiple of the block size)
    seq_shared: list[int]  # index (in this batch) of the shared-prefix sequence a branch extends, or -1
    rows: list[tuple[int, int, int]]  # (sequence, first scored local index, request) per scored request
    num_tokens: int = 0
    num_blocks: int = 0


def _plan(
    contexts: Seq[Seq[int]],
    conts: Seq[Seq[int]],
    owner: Seq[int],
    bs: int,
    budget: int,
    block_budget: int,
) -> list[_Batch]:
    """Requests (sorted by context) into batches of at most ``budget`` fed tokens and ``block_budget`` KV blocks."""
    order = sorted(range(len(conts)), key=owner.__getitem__)
    counts: dict[int, int] = {}
    for u in owner:
        counts[u] = counts.get(u, 0) + 1
    batches: list[_Batch] = []
    cur = _Batch([], [], [], [])
    shared_at: dict[int, int] = {}  # context -> its shared sequence in the current batch
    for r in order:
        u = owner[r]
        ctx, cont = contexts[u], conts[r]
        c = len(ctx)
        s = (c - 1) // bs * bs if counts[u] > 1 else 0  # a context scored once needs no shared sequence
        n = c - s + len(cont) - 1  # fed branch tokens: ctx[s:] + cont[:-1]
        extra = 0 if (s == 0 or u in shared_at) else s
        need_blocks = -(-n // bs) + (s // bs if extra else 0)
        if cur.rows and (cur.num_tokens + n + extra > budget or cur.num_blocks + need_blocks > block_budget):
            batches.append(cur)
            cur, shared_at = _Batch([], [], [], []), {}
            extra = s
            need_blocks = -(-n // bs) + s // bs
        if n + extra > budget or need_blocks > block_budget:
            raise UserError(
                f"a context of {c} tokens with a continuation of {len(cont)} does not fit one scoring batch "
                f"({budget} tokens, {block_budget} KV blocks); raise max_num_batched_tokens or the KV cache size"
            )
        shared = -1
        if s:
            if u not in shared_at:
                shared_at[u] = len(cur.seq_tokens)
                cur.seq_tokens.append(list(ctx[:s]))
                cur.seq_start.append(0)
                cur.seq_shared.append(-1)
            shared = shared_at[u]
        cur.rows.append((len(cur.seq_tokens), c - 1 - s, r))
        cur.seq_tokens.append(list(ctx[s:]) + list(cont[:-1]))
        cur.seq_start.append(s)
        cur.seq_shared.append(shared)
        cur.num_tokens += n + extra
        cur.num_blocks += need_blocks
    if cur.rows:
        batches.append(cur)
    return batches


def _arrays(batch: _Batch, pool: np.ndarray, bs: int, conts: Seq[Seq[int]]) -> tuple[dict[str, np.ndarray], dict]:
    """The forward's index arrays (``batch.host_arrays``' layout) and the scored rows (flat row of ``[T]``, target
    token, request) of one batch; KV blocks are taken from ``pool`` in order."""
    nseq = len(batch.seq_tokens)
    lens = np.fromiter((len(t) for t in batch.seq_tokens), dtype=np.int64, count=nseq)
    cu = np.zeros(nseq + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    starts = np.asarray(batch.seq_start, dtype=np.int64)
    own = -(-lens // bs)  # own blocks of each sequence
    first = np.zeros(nseq + 1, dtype=np.int64)
    np.cumsum(own, out=first[1:])
    shared_blocks = np.where(np.asarray(batch.seq_shared) >= 0, starts // bs, 0)
    width = int((shared_blocks + own).max())
    # every token's sequence and index in it, every own KV block's sequence: no Python step per sequence
    seq = np.repeat(np.arange(nseq), lens)
    local = np.arange(int(cu[-1]), dtype=np.int64) - cu[:-1][seq]
    positions = starts[seq] + local
    slots = pool[first[:-1][seq] + local // bs] * bs + local % bs
    tables = np.zeros((nseq, width), dtype=np.int64)
    blk_seq = np.repeat(np.arange(nseq), own)
    blk = np.arange(int(first[-1]), dtype=np.int64) - first[:-1][blk_seq]
    tables[blk_seq, shared_blocks[blk_seq] + blk] = pool[: int(first[-1])]
    branch = np.flatnonzero(shared_blocks)
    if branch.size:  # a branch's leading blocks: its shared sequence's own blocks (that one has no shared blocks)
        k = shared_blocks[branch]
        rows = np.repeat(branch, k)
        col = np.arange(int(k.sum()), dtype=np.int64) - np.repeat(np.cumsum(k) - k, k)
        owner = np.asarray(batch.seq_shared, dtype=np.int64)[branch]
        tables[rows, col] = pool[np.repeat(first[owner], k) + col]
    seqs, locs, reqs = (np.asarray(c, dtype=np.int64) for c in zip(*batch.rows))
    counts = np.fromiter((len(conts[r]) for r in reqs.tolist()), dtype=np.int64, count=len(reqs))
    total = int(counts.sum())
    offset = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    row_idx = np.repeat(cu[seqs] + locs, counts) + offset
    targets = np.fromiter(chain.from_iterable(conts[r] for r in reqs.tolist()), dtype=np.int64, count=total)
    req = np.repeat(reqs, counts)
    arrays = {
        "input_ids": np.fromiter(chain.from_iterable(batch.seq_tokens), dtype=np.int64, count=int(cu[-1])),
        "positions": positions,
        "slot_mapping": slots,
        "cu_seqlens": cu,
        "context_lens": starts + lens,
        "block_tables": tables,
        "sample_rows": row_idx,
        "max_seqlen": np.array([int(lens.max())]),
    }
    return arrays, {"targets": targets, "requests": req}


def _score_rows(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-prob fp32 ``[R]``, is-argmax bool ``[R]``, argmax id int64 ``[R]``, argmax log-prob fp32 ``[R]``) of
    ``targets`` under the LM head over ``hidden`` ``[R, H]``."""
    chunk = max(1, ROW_CHUNK_ELEMS // weight.shape[0])
    fused = hidden.shape[0] > 0 and uses_row_kernel(hidden)
    lps, greedy, ids, tops = [], [], [], []
    for lo in range(0, hidden.shape[0], chunk):
        logits = torch.nn.functional.linear(hidden[lo : lo + chunk], weight)  # [r, V], the model's dtype
        t = targets[lo : lo + chunk]
        if fused:  # CUDA: one read of the model-dtype logits for lse and log-prob (prompt_logprobs.logit_row_stats)
            lse, lp = logit_row_stats(logits, t)
            own = logits.gather(-1, t[:, None])[:, 0]
            best, arg = logits.max(dim=-1)  # exact in the model's dtype, as the comparison below
            lps.append(lp)
            greedy.append(own >= best)
            ids.append(arg)
            tops.append(best.float() - lse)
            continue
        logits = logits.float()
        own = logits.gather(-1, t[:, None])[:, 0]
        best, arg = logits.max(dim=-1)
        lse = (logits - best[:, None]).exp_().sum(-1).log_().add_(best)  # the row maximum reused
        lps.append(own - lse)
        greedy.append(own >= best)
        ids.append(arg)
        tops.append(best - lse)
    return torch.cat(lps), torch.cat(greedy), torch.cat(ids), torch.cat(tops)


def score_prompts(llm: Any, prompts: Seq[Seq[int]], require_idle: bool = True) -> ScoreResult:
    """Every position of each prompt (``echo`` + ``logprobs``): per prompt, ``token_logprobs`` of its tokens 1 ..
    n - 1, and ``top_ids`` / ``top_logprobs``: the argmax token and its log-prob after each of its n positions (the
    last one is the greedy next token). ``logprobs`` / ``greedy`` are the sums and flags of tokens 1 .. n - 1."""
    for i, p in enumerate(prompts):
        if len(p) < 1:
            raise UserError(f"prompt {i} is empty")
    # context = the first token; continuation = the rest plus a stand-in for the next token (its row gives the
    # argmax after the last prompt token; its own log-prob is dropped)
    conts = [list(p[1:]) + [p[-1]] for p in prompts]
    res = score_continuations(
        llm, [p[:1] for p in prompts], conts, list(range(len(prompts))), per_token=True, require_idle=require_idle
    )
    last = [lps.pop() for lps in res.token_logprobs]
    res.logprobs = [s - x for s, x in zip(res.logprobs, last)]
    res.greedy = [ids[: len(p) - 1] == list(p[1:]) for ids, p in zip(res.top_ids, prompts)]  # C-speed compares
    return res


def score_continuations(
    llm: Any,
    contexts: Seq[Seq[int]],
    continuations: Seq[Seq[int]],
    owner: Seq[int],
    max_batch_tokens: int | None = None,
    on_batch: Any = None,
    per_token: bool = False,
    require_idle: bool = True,
) -> ScoreResult:
    """Score ``continuations[r]`` after ``contexts[owner[r]]`` (token ids; every context and continuation non-empty,
    ``len(context) + len(continuation) - 1 <= llm.max_model_len``) on ``llm``'s model and KV cache.
    ``on_batch(n)`` is called after each batch is queued with its number of requests (a progress bar).
    ``per_token``: also each continuation token's log-prob and the argmax (id, log-prob) at its position.
    ``require_idle=False`` (the server's engine thread, between steps): requests may be in flight; their blocks are
    untouched (the scoring blocks are taken from the free list) and every forward is queued on the same stream.

    ``stats``: ``plan_s`` (grouping and batching on the host), ``arrays_s`` (index arrays), ``launch_s`` (host time
    queueing forwards and LM-head chunks: on an accelerator the device runs behind it), ``wait_s`` (waiting for the
    device at the end), ``gather_s`` (results to Python), ``batches``, ``fed_tokens`` (tokens through the model),
    ``unshared_tokens`` (what one sequence per request would have fed), ``scored_tokens`` (LM-head rows)."""
    if require_idle and llm.has_unfinished_requests():
        raise UserError("score_continuations needs an idle engine; finish or abort the running requests first")
    if not supports_scoring(llm):
        raise UserError("this engine cannot score directly (KV cache released or LoRA adapters attached)")
    n = len(continuations)
    stats: dict[str, float] = {"requests": n}
    if n == 0:
        return ScoreResult([], [], stats)
    for r, cont in enumerate(continuations):
        if not cont or not contexts[owner[r]]:
            raise UserError(f"request {r}: contexts and continuations must be non-empty token lists")
        if len(contexts[owner[r]]) + len(cont) - 1 > llm.max_model_len:
            raise UserError(f"request {r} has more tokens than the engine's context ({llm.max_model_len})")
    t0 = time.perf_counter()
    bs = llm.config.block_size
    budget = max_batch_tokens or llm.config.max_num_batched_tokens
    bm = llm.block_manager
    holder = Sequence(-1, "score", 0, [], SamplingParams())
    want = min(bm.num_free_blocks, 2 * -(-budget // bs))  # a batch's blocks: its tokens plus partly filled ones
    batches = _plan(contexts, continuations, owner, bs, budget, want)
    blocks = max(b.num_blocks for b in batches)
    if not bm.allocate(holder, blocks * bs):
        raise UserError(f"the KV cache has {bm.num_free_blocks} free blocks; scoring needs {blocks}")
    runner = llm.runner
    dev = runner.device
    weight = llm.model.lm_head_weight
    sums = torch.zeros(n, dtype=torch.float64, device=dev)
    misses = torch.zeros(n, dtype=torch.float32, device=dev)  # non-argmax tokens per request (exact below 2**24)
    stats.update(plan_s=time.perf_counter() - t0, arrays_s=0.0, launch_s=0.0, batches=len(batches))
    stats.update(fed_tokens=sum(b.num_tokens for b in batches), scored_tokens=sum(len(c) for c in continuations))
    stats["unshared_tokens"] = sum(len(contexts[owner[r]]) + len(c) - 1 for r, c in enumerate(continuations))
    pool = np.asarray(holder.block_table, dtype=np.int64)
    flat: list[tuple[torch.Tensor, ...]] = []  # per_token: per batch (request, log-prob, argmax id, its log-prob)
    try:
        with torch.inference_mode(), runner._precision():
            for batch in batches:
                t1 = time.perf_counter()
                arrays, rows = _arrays(batch, pool, bs, continuations)
                x = to_device(arrays, dev)
                extra = torch.from_numpy(np.concatenate([rows["targets"], rows["requests"]]))
                extra = (extra.pin_memory() if dev.type != "cpu" else extra).to(dev, non_blocking=True)
                t2 = time.perf_counter()
                meta = AttnMetadata(
                    cu_seqlens=x.cu_seqlens,
                    max_seqlen=x.max_seqlen,
                    kv_caches=llm.kv.caches,
                    slot_mapping=x.slot_mapping,
                    block_tables=x.block_tables,
                    context_lens=x.context_lens,
                )
                hidden = llm.model(x.input_ids, x.positions, meta)  # [T, H]
                m = len(rows["targets"])
                lp, top, arg, best = _score_rows(hidden.index_select(0, x.sample_rows), weight, extra[:m])
                if per_token:
                    flat.append((extra[m:], lp, arg, best))
                sums.index_add_(0, extra[m:], lp.double())
                misses.index_add_(0, extra[m:], (~top).float())
                stats["arrays_s"] += t2 - t1
                stats["launch_s"] += time.perf_counter() - t2
                if on_batch is not None:
                    on_batch(len(batch.rows))
            t3 = time.perf_counter()
            if dev.type != "cpu":
                platform_device.synchronize()
            t4 = time.perf_counter()
            total, greedy = sums.tolist(), (misses == 0).tolist()
            out = ScoreResult(total, greedy, stats)
            if per_token:
                _split_tokens(out, flat, n)
    finally:
        bm.free_sequence(holder)
    stats.update(wait_s=t4 - t3, gather_s=time.perf_counter() - t4)
    return out


def _split_tokens(out: ScoreResult, flat: list[tuple[torch.Tensor, ...]], n: int) -> None:
    """Per-row device results of every batch to per-request Python lists (one transfer per kind). A request's rows
    are contiguous and in position order within its batch, and a request lies in one batch."""
    req = torch.cat([f[0] for f in flat]).cpu().numpy()
    order = np.argsort(req, kind="stable")
    bounds = np.searchsorted(req[order], np.arange(n + 1)).tolist()
    cols = [torch.cat([f[k] for f in flat]).cpu().numpy()[order].tolist() for k in (1, 2, 3)]
    lps, ids, tops = ([c[bounds[r] : bounds[r + 1]] for r in range(n)] for c in cols)
    out.token_logprobs, out.top_ids, out.top_logprobs = list(lps), list(ids), list(tops)
