"""The data pipeline: spec -> rows -> examples -> token sequences -> resumable packed-batch iterator.

``load_examples`` reads and parses rows for a purpose ("sft", "dpo" or "rl"), raising a DataError that names the
file, row and problem, or skipping and counting bad rows with ``skip_bad_rows``. ``build_sft`` / ``build_preference``
tokenise, check every token id against the model's vocabulary (``vocab_limit``: a row with an id the embedding
cannot look up is a bad row, not an IndexError mid-training), truncate (``right``) or drop over-long rows, and
return units ready for ``PackedBatchIterator``; ``load_prompts`` gives RL its prompt-only view. ``DataStats``
carries the counts for the run summary. Everything is in memory; there is no streaming or multi-process tokenisation.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from polyrl.data import formats
from polyrl.data.chat import ChatTokenizer
from polyrl.data.config import DataConfig, max_sequence_len
from polyrl.data.examples import ChatExample, PreferenceExample, PromptExample, TokenizedSeq, TokensExample
from polyrl.data.packing import DEFAULT_MICRO_BATCH_TOKENS
from polyrl.data.sampler import PackedBatchIterator
from polyrl.data.sources import iter_rows
from polyrl.errors import ConfigError, DataError, UserError
from polyrl.models.config import ModelConfig

PURPOSES = {"sft": formats.as_sft, "dpo": formats.as_preference, "rl": formats.as_prompt}
MAX_REPORTED_BAD_ROWS = 5


@dataclass
class DataStats:
    """Counts for the run summary. ``bad_examples`` keeps the first few skipped-row messages."""

    rows: int = 0
    bad_rows: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    dropped_no_target: int = 0
    sequences: int = 0
    tokens: int = 0
    target_tokens: int = 0
    bad_examples: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TokenizedData:
    """Units (tuples of sequences packed together) plus the examples they came from and the stats."""

    units: list[tuple[TokenizedSeq, ...]]
    stats: DataStats
    config: DataConfig
    micro_batch_tokens: int  # the packing budget the units were fitted to (``engine.micro_batch_tokens`` of a run)

    def iterator(self, rank: int = 0, world_size: int = 1, max_epochs: int | None = None) -> PackedBatchIterator:
        c = self.config
        return PackedBatchIterator(
            self.units, self.micro_batch_tokens, c.packing, c.shuffle, c.seed, rank, world_size, max_epochs,
            c.fixed_shapes,
        )  # fmt: skip


def _holdout_keep(n: int, cfg: DataConfig, part: str) -> set[int] | None:
    if cfg.holdout <= 0.0:
        if part != "train":
            raise ConfigError("a test part needs data.holdout > 0 (or a builtin spec with @test)")
        return None
    order = list(range(n))
    random.Random(f"polyrl-holdout:{cfg.seed}").shuffle(order)
    n_test = max(1, round(cfg.holdout * n))
    chosen = order[:n_test] if part == "test" else order[n_test:]
    return set(chosen)


def _with_system(messages: list[dict], system: str | None) -> list[dict]:
    if system and (not messages or messages[0]["role"] != "system"):
        return [{"role": "system", "content": system}, *messages]
    return messages


def _add_system(ex: Any, system: str | None) -> Any:
    if not system:
        return ex
    if isinstance(ex, (ChatExample, PromptExample)):
        ex.messages = _with_system(ex.messages, system)
    elif isinstance(ex, PreferenceExample):
        ex.prompt = _with_system(ex.prompt, system)
    return ex


def _bad(stats: DataStats, cfg: DataConfig, where: str, problem: str) -> None:
    message = f"{where}: {problem}"
    if not cfg.skip_bad_rows:
        raise DataError(f"{message} (fix the row, or pass --skip-bad-rows to skip and count such rows)")
    stats.bad_rows += 1
    if len(stats.bad_examples) < MAX_REPORTED_BAD_ROWS:
        stats.bad_examples.append(message)


def _with_keys(problem: str, row: dict, purpose: str) -> str:
    """A row's problem with its keys and, when renaming some of them would make it a row for ``purpose``, which."""
    if "from keys" in problem:  # the format could not be told: the message lists the keys and the renames
        return problem
    return f"{problem} (the row's keys: {', '.join(map(str, row))}{formats.view_hint(purpose, row)})"


def load_examples(cfg: DataConfig, purpose: str = "sft", part: str = "train", stats: DataStats | None = None):
    """Parsed examples of ``cfg.path`` for ``purpose``, each with its row location: list of (where, example)."""
    if not cfg.path:
        raise ConfigError("no dataset given; pass --data SPEC (a file, a datasets name or folder, or builtin:NAME)")
    if purpose not in PURPOSES:
        raise ValueError(f"purpose {purpose!r} not in {sorted(PURPOSES)}")
    stats = stats if stats is not None else DataStats()
    rows = list(iter_rows(cfg.path, cfg.split))
    if cfg.limit is not None:
        rows = rows[: cfg.limit]
    keep = _holdout_keep(len(rows), cfg, part)
    view = PURPOSES[purpose]
    out = []
    for idx, raw in enumerate(rows):
        if keep is not None and idx not in keep:
            continue
        stats.rows += 1
        if raw.error is not None:
            _bad(stats, cfg, raw.where, raw.error)
            continue
        try:
            ex = view(formats.parse_row(raw.data, cfg.format))
        except formats.RowError as exc:
            _bad(stats, cfg, raw.where, _with_keys(str(exc), raw.data, purpose))
            continue
        out.append((raw.where, _add_system(ex, cfg.system_prompt)))
    if not out:
        raise DataError(f"{cfg.path}: no usable rows ({stats.rows} read, {stats.bad_rows} bad)")
    return out, stats


def chat_tokenizer(cfg: DataConfig, tokenizer: Any) -> ChatTokenizer:
    template = cfg.chat_template
    if template and "{" not in template:
        path = Path(template)
        if not path.is_file():
            raise ConfigError(f"data.chat_template {template!r} is neither a Jinja template nor a file")
        template = path.read_text()
    return ChatTokenizer(tokenizer, template, cfg.loss_on)


def _fit(seq: TokenizedSeq, max_len: int, cfg: DataConfig, stats: DataStats) -> TokenizedSeq | None:
    """Apply the truncation policy; None when the sequence is dropped (too long, or nothing to learn)."""
    if len(seq) > max_len:
        cut = TokenizedSeq(seq.input_ids[:max_len], seq.loss_mask[:max_len], truncated=True)
        # a prompt longer than max_len leaves no target after the cut: dropped as too long, whatever the policy
        if cfg.truncation == "drop" or (any(seq.loss_mask[1:]) and not any(cut.loss_mask[1:])):
            stats.dropped_too_long += 1
            return None
        stats.truncated += 1
        seq = cut
    if not any(seq.loss_mask[1:]):  # token 0 is never a target once labels are shifted
        stats.dropped_no_target += 1
        return None
    return seq


def vocab_limit(tokenizer: Any, vocab_size: int | None = None) -> tuple[int, str] | None:
    """The exclusive bound on token ids, and what it is: ``vocab_size`` when given (the model's embedding rows),
    else the ``vocab_size`` of the model config.json beside the tokenizer (the folder it was loaded from, which a
    run's model folder is), else ``len(tokenizer)``. The model's embedding may be larger than the tokenizer."""
    if vocab_size is not None:
        return vocab_size, "the model's vocab_size"
    folder = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    if str(folder) and (folder / "config.json").is_file():
        try:
            return ModelConfig.from_pretrained(folder).vocab_size, f"vocab_size in {folder / 'config.json'}"
        except UserError:  # not a model config this package reads: fall back to the tokenizer
            pass
    try:
        return len(tokenizer), "the tokenizer's vocabulary"
    except TypeError:
        return None


def _out_of_vocab(seqs: tuple[TokenizedSeq, ...], limit: tuple[int, str] | None) -> str | None:
    """The first id that the model's embedding cannot look up, as a row problem; None when all fit."""
    if limit is None:
        return None
    bound, what = limit
    for seq in seqs:
        for t, i in enumerate(seq.input_ids):
            if not 0 <= i < bound:
                return (
                    f"input_ids[{t}]={i} is outside the vocabulary [0, {bound}) ({what}); "
                    "tokenize with this model's tokenizer"
                )
    return None


# Rows tokenised per batched tokenizer call: large enough to amortise the call, small enough to keep memory flat.
TOKENIZE_CHUNK = 1024


def _tokenize_chunk(tok: ChatTokenizer, chunk: list[Any]) -> list[tuple[TokenizedSeq, ...] | formats.RowError]:
    """The sequences of each example of ``chunk`` (a preference pair gives two), in order, every conversation of the
    chunk encoded in one batched call (``ChatTokenizer.tokenize_many``); a row the template rejects is its error."""
    convs: list[list] = []
    starts: list[int] = []
    tools: list[list[dict] | None] = []
    for ex in chunk:
        if isinstance(ex, PreferenceExample):
            convs += [ex.prompt + ex.chosen, ex.prompt + ex.rejected]
            starts += [len(ex.prompt)] * 2
            tools += [ex.tools, ex.tools]
        elif not isinstance(ex, TokensExample):
            convs.append(ex.messages)
            starts.append(0)
            tools.append(getattr(ex, "tools", None))
    done = iter(tok.tokenize_many(convs, starts, tools))
    out: list[tuple[TokenizedSeq, ...] | formats.RowError] = []
    for ex in chunk:
        if isinstance(ex, TokensExample):
            out.append((TokenizedSeq(ex.input_ids, ex.loss_mask),))
            continue
        seqs = (next(done), next(done)) if isinstance(ex, PreferenceExample) else (next(done),)
        err = next((s for s in seqs if isinstance(s, formats.RowError)), None)
        out.append(err if err is not None else seqs)
    return out


def _build(
    cfg: DataConfig, tokenizer: Any, purpose: str, part: str, micro_batch_tokens: int, vocab_size: int | None
) -> TokenizedData:
    if not isinstance(micro_batch_tokens, int) or micro_batch_tokens < 2:
        raise ConfigError(f"micro_batch_tokens={micro_batch_tokens!r}: use an integer >= 2 (e.g. 8192)")
    examples, stats = load_examples(cfg, purpose, part)
    tok = chat_tokenizer(cfg, tokenizer)
    limit = vocab_limit(tokenizer, vocab_size)
    per_unit = 2 if purpose == "dpo" else 1
    max_len = cfg.max_seq_len if per_unit == 1 else min(cfg.max_seq_len, micro_batch_tokens // 2)
    max_len = min(max_len, max_sequence_len(cfg, micro_batch_tokens))
    units = []
    tokenized = (
        zip(part, _tokenize_chunk(tok, [ex for _, ex in part]))
        for part in (examples[i : i + TOKENIZE_CHUNK] for i in range(0, len(examples), TOKENIZE_CHUNK))
    )
    for (where, _), seqs in (pair for chunk in tokenized for pair in chunk):
        if isinstance(seqs, formats.RowError):
            _bad(stats, cfg, where, str(seqs))
            continue
        problem = _out_of_vocab(seqs, limit)  # an id past the embedding would crash the step mid-training
        if problem is not None:
            _bad(stats, cfg, where, problem)
            continue
        fitted = [_fit(s, max_len, cfg, stats) for s in seqs]
        if any(s is None for s in fitted):
            continue
        units.append(tuple(fitted))
        stats.sequences += len(fitted)
        stats.tokens += sum(len(s) for s in fitted)
        stats.target_tokens += sum(sum(s.loss_mask[1:]) for s in fitted)
    if not units:
        raise DataError(
            f"{cfg.path}: no rows left after tokenising ({stats.dropped_too_long} longer than {max_len} tokens: "
            f"dropped, or nothing left to train on once cut; {stats.dropped_no_target} without target tokens, "
            f"{stats.bad_rows} bad); raise data.max_seq_len (--max-seq-len; a sequence is also at most "
            "engine.micro_batch_tokens, half of it for DPO pairs) or check data.loss_on"
        )
    return TokenizedData(units, stats, cfg, micro_batch_tokens)


def build_sft(
    cfg: DataConfig,
    tokenizer: Any,
    part: str = "train",
    micro_batch_tokens: int = DEFAULT_MICRO_BATCH_TOKENS,
    *,
    vocab_size: int | None = None,
) -> TokenizedData:
    """Tokenised SFT data: one sequence per unit, packed into micro-batches of ``micro_batch_tokens`` (a sequence
    is at most that long). Token ids must be below ``vocab_size`` (default: see ``vocab_limit``)."""
    return _build(cfg, tokenizer, "sft", part, micro_batch_tokens, vocab_size)


def build_preference(
    cfg: DataConfig,
    tokenizer: Any,
    part: str = "train",
    micro_batch_tokens: int = DEFAULT_MICRO_BATCH_TOKENS,
    *,
    vocab_size: int | None = None,
) -> TokenizedData:
    """Tokenised DPO data: units are (chosen, rejected), packed together into the same micro-batch."""
    return _build(cfg, tokenizer, "dpo", part, micro_batch_tokens, vocab_size)


def load_prompts(cfg: DataConfig, part: str = "train") -> tuple[list[PromptExample], DataStats]:
    """Prompt-only view for RL (messages + reference answer + task + tools); tokenise with ``encode_prompts``."""
    examples, stats = load_examples(cfg, "rl", part)
    return [ex for _, ex in examples], stats


def encode_prompts(chat: ChatTokenizer, prompts: list[PromptExample], source: str) -> list[list[int]]:
    """``chat.encode_prompt`` of each prompt with its tools; a prompt the template refuses (tools it does not render,
    tools without a template, a conversation it raises on) is a DataError naming ``source`` and the prompt."""
    out = []
    for k, p in enumerate(prompts, start=1):
        try:
            out.append(chat.encode_prompt(p.messages, p.tools))
        except formats.RowError as exc:
            raise DataError(f"{source}: prompt {k}: {exc}") from None
    return out
