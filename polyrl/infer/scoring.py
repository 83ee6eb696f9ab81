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
``server/scoring.py``): per token its log-prob and the argmax (id, log-prob), read in one transfer at the end (the
per-prompt sums and greedy flags are then numpy over those). lm-eval sends a multiple-choice document as one prompt
per choice (the same context + a short choice), so prompts share prefixes, and those are fed once (``_prefix_tree``,
``_plan_prompts``): the prompts are sorted as token sequences; two neighbours sharing ``L`` tokens can share
``floor((L - 1) / bs) * bs`` of them (whole KV blocks, one token short of ``L`` so that the last shared position's
next token, its target, is common), and the prompts sharing at least one block form a node. Nodes nest (a few-shot
prefix common to many documents, then each document's context): each node is one sequence of the forward fed from
its parent's end, with its parent's blocks leading its block table (a branch of a branch), its rows scored once
through the LM head; each prompt's rest is a branch of its deepest node, every row scored. Each prompt's
per-position values are then gathered from its nodes' rows and its own (numpy, one index array); identical prompts
are scored once. A prompt with no partner is one sequence, as in ``score_continuations``. A batch holds whole
prompts: when one spills into the next batch its nodes are fed again there, not scored again. Host cost: a sort of
the prompts' byte strings (``memcmp``), numpy over the neighbours' common tokens, one short Python step per prompt
(the node walk and the batch plan).

The KV blocks are borrowed from the engine's ``BlockManager`` for the call and given back (evicting cached prefixes
as any allocation does); the engine is not stepped. It must be idle, or (``require_idle=False``) the call runs on the
engine's own thread between steps: running sequences keep their blocks and every forward is queued on the same
stream. Not here: tokenisation, lm-eval's request objects (``polyrl/eval/harness.py``), top-k > 1 alternatives and
ranks (``prompt_logprobs.py``, the request path), LoRA adapter banks (a served adapter engine uses the request path).
Not built: sharing across calls (each call plans only its own prompts; the engine's prefix cache is not read).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager
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


def _seq_arrays(
    lens: np.ndarray, starts: np.ndarray, parents: np.ndarray, pool: np.ndarray, bs: int
) -> dict[str, np.ndarray]:
    """A forward's position, slot, sequence and block-table arrays (``batch.host_arrays``' layout, less the token ids
    and scored rows) for sequences of ``lens`` fed tokens starting at positions ``starts`` (multiples of ``bs``).
    ``parents[i]`` is the earlier sequence whose block table's first ``starts[i] / bs`` blocks sequence ``i``'s
    table starts with (its parent's own blocks are full: shared KV written in the same forward), or -1 (then
    ``starts[i]`` is 0); parents may have parents. Each sequence's own KV blocks are taken from ``pool`` in order."""
    nseq = len(lens)
    cu = np.zeros(nseq + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    own = -(-lens // bs)  # own blocks of each sequence
    first = np.zeros(nseq + 1, dtype=np.int64)
    np.cumsum(own, out=first[1:])
    shared_blocks = np.where(parents >= 0, starts // bs, 0)
    width = int((shared_blocks + own).max())
    # every token's sequence and index in it, every own KV block's sequence: no Python step per sequence
    seq = np.repeat(np.arange(nseq), lens)
    local = np.arange(int(cu[-1]), dtype=np.int64) - cu[:-1][seq]
    slots = pool[first[:-1][seq] + local // bs] * bs + local % bs
    tables = np.zeros((nseq, width), dtype=np.int64)
    blk_seq = np.repeat(np.arange(nseq), own)
    blk = np.arange(int(first[-1]), dtype=np.int64) - first[:-1][blk_seq]
    tables[blk_seq, shared_blocks[blk_seq] + blk] = pool[: int(first[-1])]
    # a branch's leading blocks: its parent's table (whose leading blocks are its own parent's): level by level
    depth = np.zeros(nseq, dtype=np.int64)
    up = parents.copy()
    while (up >= 0).any():
        depth += up >= 0
        up = np.where(up >= 0, parents[np.maximum(up, 0)], -1)
    cols = np.arange(width, dtype=np.int64)
    for level in range(1, int(depth.max()) + 1):
        kids = np.flatnonzero(depth == level)
        lead = cols[None, :] < shared_blocks[kids][:, None]
        tables[kids] = np.where(lead, tables[parents[kids]], tables[kids])
    return {
        "positions": starts[seq] + local,
        "slot_mapping": slots,
        "cu_seqlens": cu,
        "context_lens": starts + lens,
        "block_tables": tables,
        "max_seqlen": np.array([int(lens.max())]),
    }


def _arrays(batch: _Batch, pool: np.ndarray, bs: int, conts: Seq[Seq[int]]) -> tuple[dict[str, np.ndarray], dict]:
    """The forward's index arrays (``batch.host_arrays``' layout) and the scored rows (flat row of ``[T]``, target
    token, request) of one batch; KV blocks are taken from ``pool`` in order."""
    nseq = len(batch.seq_tokens)
    lens = np.fromiter((len(t) for t in batch.seq_tokens), dtype=np.int64, count=nseq)
    starts = np.asarray(batch.seq_start, dtype=np.int64)
    arrays = _seq_arrays(lens, starts, np.asarray(batch.seq_shared, dtype=np.int64), pool, bs)
    cu = arrays["cu_seqlens"]
    seqs, locs, reqs = (np.asarray(c, dtype=np.int64) for c in zip(*batch.rows))
    counts = np.fromiter((len(conts[r]) for r in reqs.tolist()), dtype=np.int64, count=len(reqs))
    total = int(counts.sum())
    offset = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    row_idx = np.repeat(cu[seqs] + locs, counts) + offset
    targets = np.fromiter(chain.from_iterable(conts[r] for r in reqs.tolist()), dtype=np.int64, count=total)
    req = np.repeat(reqs, counts)
    arrays["input_ids"] = np.fromiter(chain.from_iterable(batch.seq_tokens), dtype=np.int64, count=int(cu[-1]))
    arrays["sample_rows"] = row_idx
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


@dataclass
class _PromptBatch:
    """One forward of ``score_prompts``: sequences are slices of the flat prompt tokens."""

    seq_off: list[int] = field(default_factory=list)  # flat index of each sequence's first fed token
    seq_len: list[int] = field(default_factory=list)
    seq_start: list[int] = field(default_factory=list)  # its first position (a multiple of the block size)
    seq_parent: list[int] = field(default_factory=list)  # the sequence (in this batch) whose blocks it extends, or -1
    seq_scored: list[bool] = field(default_factory=list)  # its rows reach the LM head (False: a prefix fed again)
    num_tokens: int = 0
    num_blocks: int = 0


@dataclass
class _Pieces:
    """Where each distinct prompt's positions lie in the result rows: its path's nodes, then its own rest."""

    path_rows: dict[int, list[int]]  # per node a leaf hangs from: the first result row of each node on its path
    path_lens: dict[int, list[int]]  # ... and each one's length
    leaf_node: list[int]  # per distinct prompt: the node it hangs from (0: the root, nothing shared)
    leaf_row: list[int]  # its rest's first result row
    tail: list[int]  # its rest's length

    def rows(self, distinct: np.ndarray, total: int) -> np.ndarray:
        """The result row of every position of every prompt (``distinct``: each prompt's distinct prompt), in
        prompt order: ``total`` rows. Numpy, one generator step per prompt for its path."""
        leaf = np.asarray(self.leaf_node, dtype=np.int64)[distinct]
        nodes = leaf.tolist()
        node_rows = np.fromiter(chain.from_iterable(map(self.path_rows.__getitem__, nodes)), dtype=np.int64)
        node_lens = np.fromiter(chain.from_iterable(map(self.path_lens.__getitem__, nodes)), dtype=np.int64)
        count = np.fromiter(map(len, map(self.path_rows.__getitem__, nodes)), dtype=np.int64, count=len(nodes))
        ends = np.cumsum(count + 1)
        own = np.zeros(int(ends[-1]), dtype=bool)
        own[ends - 1] = True
        first = np.empty(len(own), dtype=np.int64)
        lens = np.empty(len(own), dtype=np.int64)
        first[own], lens[own] = np.asarray(self.leaf_row)[distinct], np.asarray(self.tail)[distinct]
        first[~own], lens[~own] = node_rows, node_lens
        return np.repeat(first - (np.cumsum(lens) - lens), lens) + np.arange(total)


@dataclass
class _PromptPlan:
    batches: list[_PromptBatch]
    rows: int  # LM-head rows over all batches (their results are concatenated in batch and row order)
    pieces: _Pieces
    distinct: np.ndarray  # per prompt: its distinct prompt
    nodes: int  # shared prefixes


def _prefix_tree(
    flat: np.ndarray, off: np.ndarray, bs: int
) -> tuple[list[int], np.ndarray, list[int], list[int], list[int], list[int]]:
    """The shared prefixes of the prompts ``flat[off[i] : off[i + 1]]`` as a tree: (the distinct prompts in sorted
    order, a prompt index each; per prompt its distinct prompt, a position in that list; per distinct prompt its
    parent node; per node its depth, a multiple of ``bs`` (node 0 is the root, depth 0); its parent node; one
    distinct prompt holding it).

    Prompts are sorted as token sequences (``memcmp`` of big-endian 4-byte ids; an id past 32 bits would only sort
    worse: the common prefixes are counted on the ids themselves, and any order keeps the tree right); neighbours'
    longest common prefix ``L`` (numpy, over at most the shorter one's tokens) finds identical prompts (scored once) and
    sets how much they can share: ``floor((L - 1) / bs) * bs`` tokens, whole KV blocks, at least one token short of
    ``L`` so that every shared position's next token (its scored target) is common too. Prompts that share at least one
    block (``L >= bs + 1``) form a node; a node's deeper nodes (longer shared prefixes of some of its prompts) are its
    children: the classic stack walk over the sorted neighbours' shared depths (one Python step per prompt)."""
    n = len(off) - 1
    lens = np.diff(off)
    blob = flat.astype(">u4").tobytes()  # a prefix sorts first, as with lists
    bounds = (4 * off).tolist()
    keys = [blob[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    order = np.asarray(sorted(range(n), key=keys.__getitem__), dtype=np.int64)
    lcp = np.zeros(max(n - 1, 0), dtype=np.int64)
    if n > 1:
        left, right = order[:-1], order[1:]
        m = np.minimum(lens[left], lens[right])
        pair = np.repeat(np.arange(n - 1), m)
        k = np.arange(int(m.sum()), dtype=np.int64) - np.repeat(np.cumsum(m) - m, m)
        differ = np.flatnonzero(flat[off[left][pair] + k] != flat[off[right][pair] + k])
        lcp[:] = m
        at = pair[differ]  # ascending; a pair's first mismatch comes first
        first = np.flatnonzero(np.r_[True, at[1:] != at[:-1]]) if at.size else at
        lcp[at[first]] = k[differ[first]]
    same = np.zeros(n, dtype=bool)  # in sorted order: equal to the previous prompt
    same[1:] = (lcp == lens[order[:-1]]) & (lcp == lens[order[1:]])
    keep = np.flatnonzero(~same)
    distinct = np.empty(n, dtype=np.int64)
    distinct[order] = np.cumsum(~same) - 1
    depths = np.maximum((lcp[keep[1:] - 1] - 1) // bs * bs, 0).tolist()  # between distinct neighbours
    m = len(keep)
    node_depth, node_parent, node_rep = [0], [-1], [0]
    leaf_parent = [0] * m
    stack = [0]
    for i in range(1, m + 1):
        h = depths[i - 1] if i < m else 0
        top = stack[-1]
        last = -1
        while h < node_depth[stack[-1]]:
            last = stack.pop()
            if h <= node_depth[stack[-1]]:
                node_parent[last] = stack[-1]
                last = -1
        if h > node_depth[stack[-1]]:
            stack.append(len(node_depth))
            node_depth.append(h)
            node_parent.append(-1)
            node_rep.append(i - 1)
            if last >= 0:
                node_parent[last] = stack[-1]
        leaf_parent[i - 1] = top if node_depth[top] >= h else stack[-1]
    return order[keep].tolist(), distinct, leaf_parent, node_depth, node_parent, node_rep


def _plan_prompts(flat: np.ndarray, off: np.ndarray, bs: int, budget: int, block_budget: int) -> _PromptPlan:
    """Distinct prompts (sorted) into batches of at most ``budget`` fed tokens and ``block_budget`` KV blocks: each
    shared prefix node is one sequence, scored once, each prompt's rest a branch of its deepest node. A batch holds
    whole prompts; a prompt whose nodes were scored in an earlier batch feeds them again, unscored."""
    leaves, distinct, leaf_parent, depth, parent, rep = _prefix_tree(flat, off, bs)
    starts = off[:-1].tolist()
    lens = np.diff(off).tolist()
    node_len = [0] + [depth[v] - depth[parent[v]] for v in range(1, len(depth))]  # multiples of bs
    paths: dict[int, list[int]] = {0: []}  # node -> the nodes from the root's child down to it
    path_rows: dict[int, list[int]] = {0: []}  # node -> those nodes' first result rows (once all are scored)
    batches: list[_PromptBatch] = []
    cur = _PromptBatch()
    in_batch: dict[int, int] = {}  # node -> its sequence in the current batch
    node_row: dict[int, int] = {}  # node -> its first result row
    rows = 0
    leaf_row, tails = [], []
    for j, p in enumerate(leaves):
        u = leaf_parent[j]
        path = paths.get(u)
        if path is None:
            up, v = [], u
            while v not in paths:
                up.append(v)
                v = parent[v]
            for w in reversed(up):
                paths[w] = paths[v] + [w]
                v = w
            path = paths[u]
        s = depth[u]  # = the path's tokens
        tail = lens[p] - s
        tail_blocks = -(-tail // bs)
        new, size = (), 0
        if u and u not in in_batch:  # the path's nodes not yet fed in this batch (a suffix of it)
            new = [v for v in path if v not in in_batch]
            size = sum(node_len[v] for v in new)
        if cur.seq_len and (
            cur.num_tokens + size + tail > budget or cur.num_blocks + size // bs + tail_blocks > block_budget
        ):
            batches.append(cur)
            cur, in_batch = _PromptBatch(), {}
            new, size = path, s
        if s + tail > budget or s // bs + tail_blocks > block_budget:
            raise UserError(
                f"a prompt of {lens[p]} tokens does not fit one scoring batch ({budget} tokens, {block_budget} KV "
                "blocks); raise max_num_batched_tokens or the KV cache size"
            )
        for v in new:
            a = depth[parent[v]]
            scored = v not in node_row
            if scored:
                node_row[v] = rows
                rows += node_len[v]
            in_batch[v] = len(cur.seq_len)
            cur.seq_parent.append(in_batch[parent[v]] if parent[v] else -1)
            cur.seq_off.append(starts[leaves[rep[v]]] + a)
            cur.seq_len.append(node_len[v])
            cur.seq_start.append(a)
            cur.seq_scored.append(scored)
        if u not in path_rows:
            path_rows[u] = [node_row[v] for v in path]
        cur.seq_parent.append(in_batch[u] if u else -1)
        cur.seq_off.append(starts[p] + s)
        cur.seq_len.append(tail)
        cur.seq_start.append(s)
        cur.seq_scored.append(True)
        cur.num_tokens += size + tail
        cur.num_blocks += size // bs + tail_blocks
        leaf_row.append(rows)
        tails.append(tail)
        rows += tail
    if cur.seq_len:
        batches.append(cur)
    path_lens = {u: [node_len[v] for v in path] for u, path in paths.items()}
    pieces = _Pieces(path_rows, path_lens, leaf_parent, leaf_row, tails)
    return _PromptPlan(batches, rows, pieces, distinct, len(depth) - 1)


def _prompt_arrays(batch: _PromptBatch, flat: np.ndarray, pool: np.ndarray, bs: int) -> tuple[dict, np.ndarray]:
    """The forward's index arrays of one ``score_prompts`` batch and its scored rows' targets (each position's next
    prompt token; a prompt's last position gets a stand-in whose log-prob is dropped)."""
    lens = np.asarray(batch.seq_len, dtype=np.int64)
    arrays = _seq_arrays(
        lens,
        np.asarray(batch.seq_start, dtype=np.int64),
        np.asarray(batch.seq_parent, dtype=np.int64),
        pool,
        bs,
    )
    cu = arrays["cu_seqlens"]
    src = np.repeat(np.asarray(batch.seq_off, dtype=np.int64) - cu[:-1], lens) + np.arange(int(cu[-1]))
    rows = np.flatnonzero(np.repeat(np.asarray(batch.seq_scored), lens))
    arrays["input_ids"] = flat[src]
    arrays["sample_rows"] = rows
    return arrays, flat[np.minimum(src[rows] + 1, len(flat) - 1)]


def score_prompts(llm: Any, prompts: Seq[Seq[int]], require_idle: bool = True) -> ScoreResult:
    """Every position of each prompt (``echo`` + ``logprobs``): per prompt, ``token_logprobs`` of its tokens 1 ..
    n - 1, and ``top_ids`` / ``top_logprobs``: the argmax token and its log-prob after each of its n positions (the
    last one is the greedy next token). ``logprobs`` / ``greedy`` are the sums and flags of tokens 1 .. n - 1.

    Prompts sharing a prefix of at least one KV block and a token (``_prefix_tree``) feed the shared whole blocks
    once, through the model and the LM head, and each get the shared positions' values; identical prompts are scored
    once. ``stats`` as ``score_continuations``' (``fed_tokens``: tokens through the model; ``unshared_tokens``: one
    sequence per prompt; ``scored_tokens``: LM-head rows), and ``distinct_prompts``, ``shared_prefixes`` (nodes)."""
    _check_engine(llm, require_idle, "score_prompts")
    n = len(prompts)
    stats: dict[str, float] = {"requests": n}
    if n == 0:
        return ScoreResult([], [], stats, [], [], [])
    t0 = time.perf_counter()
    lens = np.fromiter(map(len, prompts), dtype=np.int64, count=n)
    bad = np.flatnonzero((lens < 1) | (lens > llm.max_model_len))
    if bad.size:
        i = int(bad[0])
        if lens[i] < 1:
            raise UserError(f"prompt {i} is empty")
        raise UserError(f"prompt {i} has more tokens than the engine's context ({llm.max_model_len})")
    off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=off[1:])
    total = int(off[-1])
    flat = np.fromiter(chain.from_iterable(prompts), dtype=np.int64, count=total)
    bs = llm.config.block_size
    budget = llm.config.max_num_batched_tokens
    bm = llm.block_manager
    plan = _plan_prompts(flat, off, bs, budget, min(bm.num_free_blocks, 2 * -(-budget // bs)))
    stats.update(plan_s=time.perf_counter() - t0, arrays_s=0.0, launch_s=0.0, batches=len(plan.batches))
    stats.update(fed_tokens=sum(b.num_tokens for b in plan.batches), unshared_tokens=total, scored_tokens=plan.rows)
    stats.update(distinct_prompts=len(plan.pieces.tail), shared_prefixes=plan.nodes)
    out: list[tuple[torch.Tensor, ...]] = []
    with _borrowed_blocks(llm, max(b.num_blocks for b in plan.batches)) as pool:
        with torch.inference_mode(), llm.runner._precision():
            for batch in plan.batches:
                t1 = time.perf_counter()
                arrays, targets = _prompt_arrays(batch, flat, pool, bs)
                x, extra = _to_device(llm, arrays, targets)
                t2 = time.perf_counter()
                lp, _, arg, best = _forward(llm, x, extra)
                out.append((lp, arg, best))
                stats["arrays_s"] += t2 - t1
                stats["launch_s"] += time.perf_counter() - t2
            t3 = time.perf_counter()
            if llm.runner.device.type != "cpu":
                platform_device.synchronize()
            t4 = time.perf_counter()
            lp, arg, best = (torch.cat([o[k] for o in out]).cpu().numpy() for k in range(3))
    idx = plan.pieces.rows(plan.distinct, total)  # every prompt's positions: its shared prefixes' rows, its own
    lp, arg, best = lp[idx], arg[idx], best[idx]
    scored = np.ones(total, dtype=bool)  # positions 0 .. n - 2: a prompt token follows
    scored[off[1:] - 1] = False
    pid = np.repeat(np.arange(n), lens)
    sums = np.bincount(pid, np.where(scored, lp.astype(np.float64), 0.0), minlength=n)
    misses = np.bincount(pid, scored & (arg != flat[np.minimum(np.arange(1, total + 1), total - 1)]), minlength=n)
    bounds = off.tolist()
    lps, ids, tops = lp.tolist(), arg.tolist(), best.tolist()
    res = ScoreResult(sums.tolist(), (misses == 0).tolist(), stats)
    res.token_logprobs = [lps[a : b - 1] for a, b in zip(bounds[:-1], bounds[1:])]
    res.top_ids = [ids[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    res.top_logprobs = [tops[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    stats.update(wait_s=t4 - t3, gather_s=time.perf_counter() - t4)
    return res


def _check_engine(llm: Any, require_idle: bool, name: str) -> None:
    if require_idle and llm.has_unfinished_requests():
        raise UserError(f"{name} needs an idle engine; finish or abort the running requests first")
    if not supports_scoring(llm):
        raise UserError("this engine cannot score directly (KV cache released or LoRA adapters attached)")


@contextmanager
def _borrowed_blocks(llm: Any, blocks: int) -> Iterator[np.ndarray]:
    """``blocks`` free KV blocks of the engine (their ids), given back on exit."""
    bm = llm.block_manager
    holder = Sequence(-1, "score", 0, [], SamplingParams())
    if not bm.allocate(holder, blocks * llm.config.block_size):
        raise UserError(f"the KV cache has {bm.num_free_blocks} free blocks; scoring needs {blocks}")
    try:
        yield np.asarray(holder.block_table, dtype=np.int64)
    finally:
        bm.free_sequence(holder)


def _to_device(llm: Any, arrays: dict[str, np.ndarray], extra: np.ndarray) -> tuple[Any, torch.Tensor]:
    """A batch's index arrays and its extra int64 rows (targets, ...) on the device, each in one copy."""
    dev = llm.runner.device
    x = to_device(arrays, dev)
    t = torch.from_numpy(extra)
    return x, (t.pin_memory() if dev.type != "cpu" else t).to(dev, non_blocking=True)


def _forward(llm: Any, x: Any, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One forward on the engine's KV cache and the LM head over its scored rows (``_score_rows``)."""
    meta = AttnMetadata.paged(x, llm.kv.caches)
    hidden = llm.model(x.input_ids, x.positions, meta)  # [T, H]
    return _score_rows(hidden.index_select(0, x.sample_rows), llm.model.lm_head_weight, targets)


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
    _check_engine(llm, require_idle, "score_continuations")
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
    want = min(llm.block_manager.num_free_blocks, 2 * -(-budget // bs))  # a batch's tokens plus partly filled blocks
    batches = _plan(contexts, continuations, owner, bs, budget, want)
    dev = llm.runner.device
    sums = torch.zeros(n, dtype=torch.float64, device=dev)
    misses = torch.zeros(n, dtype=torch.float32, device=dev)  # non-argmax tokens per request (exact below 2**24)
    stats.update(plan_s=time.perf_counter() - t0, arrays_s=0.0, launch_s=0.0, batches=len(batches))
    stats.update(fed_tokens=sum(b.num_tokens for b in batches), scored_tokens=sum(len(c) for c in continuations))
    stats["unshared_tokens"] = sum(len(contexts[owner[r]]) + len(c) - 1 for r, c in enumerate(continuations))
    flat: list[tuple[torch.Tensor, ...]] = []  # per_token: per batch (request, log-prob, argmax id, its log-prob)
    with _borrowed_blocks(llm, max(b.num_blocks for b in batches)) as pool:
        with torch.inference_mode(), llm.runner._precision():
            for batch in batches:
                t1 = time.perf_counter()
                arrays, rows = _arrays(batch, pool, bs, continuations)
                x, extra = _to_device(llm, arrays, np.concatenate([rows["targets"], rows["requests"]]))
                t2 = time.perf_counter()
                m = len(rows["targets"])
                lp, top, arg, best = _forward(llm, x, extra[:m])
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
