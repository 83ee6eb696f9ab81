"""``PolyrlLM``: lm-eval-harness's model interface over polyrl's rollout engine, registered as ``polyrl``.

- ``loglikelihood``: every (context, continuation) pair is scored in one ``infer.scoring.score_continuations`` call:
  requests grouped by context, a context's full KV blocks computed once per batch for all its continuations (the
  choices of a multiple-choice document), only the continuation tokens' rows through the LM head, sums and greedy
  flags kept on the device until the end (no per-request engine round trip, no host sync per request).
  ``is_greedy``: every continuation token is the argmax of its distribution. An engine serving LoRA adapters takes
  the request path instead (``prompt_logprobs`` from the continuation's first token on, prefix cache shared).
  Tokenisation is lm-eval's ``_encode_pair`` with each distinct string (a document's context, each context +
  choice) encoded once in one batched tokenizer call.
- ``loglikelihood_rolling``: lm-eval's disjoint rolling windows of ``max_length`` tokens, each scored as above.
- ``generate_until``: greedy (or sampled, when ``do_sample``) generation through the engine, cut at the stop
  strings (the engine stops on them and on EOS).

Tokenisation follows lm-eval's ``hf`` backend (the tokenizer's default special tokens; ``prefix_token_id`` = BOS,
else EOS), so per-sample log-likelihoods match it (``tests/eval``). Imports lm-eval at module level: import this
module only when lm-eval is wanted (the ``eval`` extra). Not here: the CLI (``cli/eval.py``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lm_eval.models  # noqa: F401  (the builtin backends first: lm-eval loads them only into an empty registry)
import lm_eval.utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from polyrl.errors import UserError, did_you_mean
from polyrl.eval.bundled import BUNDLED_TASKS, bundled_task_dir
from polyrl.eval.loading import eval_engine, load_eval_model
from polyrl.infer.llm import LLM
from polyrl.infer.sampling_params import SamplingParams
from polyrl.infer.scoring import score_continuations, supports_scoring
from polyrl.platform.host import gc_paused

CHUNK_REQUESTS = 4096  # requests per engine call on the request path of log-likelihood scoring


def _truthy(v: Any) -> bool:
    return v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes")


@register_model("polyrl")
class PolyrlLM(TemplateLM):
    """lm-eval model ``polyrl``. ``pretrained``: an HF or PEFT adapter folder (``--model_args pretrained=DIR``,
    optional ``dtype``, ``device``, ``max_length``, ``base``); or ``llm``: an engine already built (``polyrl eval``,
    in-training evaluation)."""

    def __init__(
        self,
        pretrained: str | None = None,
        llm: LLM | None = None,
        dtype: str | None = None,
        device: str | None = None,
        max_length: int | None = None,
        base: str | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        batch_size: Any = None,  # lm-eval passes these; the engine batches by tokens instead
        max_batch_size: Any = None,
        show_progress: Any = True,
        **unused: Any,
    ) -> None:
        super().__init__()
        if llm is None:
            if pretrained is None:
                raise UserError("the polyrl lm-eval model needs pretrained=DIR (an HF or PEFT adapter folder)")
            model, tokenizer = load_eval_model(pretrained, dtype, device, base)
            llm = eval_engine(
                model,
                tokenizer,
                max_model_len=int(max_length) if max_length else None,
                max_num_seqs=int(max_num_seqs),
                max_num_batched_tokens=int(max_num_batched_tokens) if max_num_batched_tokens else None,
            )
        if llm.tokenizer is None:
            raise UserError("the polyrl lm-eval model needs an engine with a tokenizer")
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self._max_length = llm.max_model_len
        self.show_progress = _truthy(show_progress)
        self.last_score_stats: dict[str, float] = {}  # the last direct scoring call's breakdown (infer/scoring.py)
        self.last_generate_stats: dict[str, float] = {}  # the last generate_until: tokenising, generating

    # ---- what TemplateLM needs ----------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        return int(eos) if eos is not None else next(iter(self.llm.eos_token_ids))

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "polyrl")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        if add_special_tokens is None:
            return list(self.tokenizer.encode(string))
        return list(self.tokenizer.encode(string, add_special_tokens=add_special_tokens))

    def tok_decode(self, tokens: list[int], **kwargs: Any) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # ---- scoring ------------------------------------------------------------------------------------
    def _score(self, pairs: list[tuple[list[int], list[int]]], desc: str) -> list[tuple[float, bool]]:
        """(sum of continuation log-probs, whether every continuation token is the argmax) per (context,
        continuation) pair of token ids. As lm-eval's ``hf`` backend: ``(context + continuation)[-(max_length +
        1):]``, the last token never fed. Pairs with the same context share its computation
        (``infer/scoring.py``); an engine that cannot score directly (LoRA adapters served) takes the request path."""
        direct = supports_scoring(self.llm)
        limit = self.max_length + 1 if direct else self.max_length - 1  # a request also samples one token
        contexts: list[list[int]] = []
        conts: list[list[int]] = []
        owner: list[int] = []
        index: dict[tuple[int, ...], int] = {}
        for ctx, cont in pairs:
            if not cont:
                raise UserError("lm-eval asked to score an empty continuation; check the task's doc_to_choice")
            if len(ctx) + len(cont) > limit:  # cut the context from the left; at least one token of it stays
                whole = (ctx + cont)[-limit:]
                cut = max(1, len(whole) - len(cont))
                ctx, cont = whole[:cut], whole[cut:]
            key = tuple(ctx)
            u = index.get(key)
            if u is None:
                u = index[key] = len(contexts)
                contexts.append(ctx)
            owner.append(u)
            conts.append(cont)
        self.last_score_stats = {}
        if not direct:
            return self._score_requests(contexts, conts, owner, desc)
        # A request longer than one forward's token budget takes the request path (chunked prefill) instead.
        budget = self.llm.config.max_num_batched_tokens
        fits = [len(contexts[u]) + len(c) - 1 <= budget for u, c in zip(owner, conts)]
        out: list[tuple[float, bool] | None] = [None] * len(conts)
        if not all(fits):
            rest = [r for r, ok in enumerate(fits) if not ok]
            long = self._score_requests(contexts, [conts[r] for r in rest], [owner[r] for r in rest], desc)
            for r, res in zip(rest, long):
                out[r] = res
        keep = [r for r, ok in enumerate(fits) if ok]
        bar = tqdm(total=len(keep), desc=desc, disable=not self.show_progress)
        res = score_continuations(
            self.llm, contexts, [conts[r] for r in keep], [owner[r] for r in keep], on_batch=bar.update
        )
        bar.close()
        self.last_score_stats = dict(res.stats)
        for r, lp, greedy in zip(keep, res.logprobs, res.greedy):
            out[r] = (lp, greedy)
        return out  # type: ignore[return-value]

    def _score_requests(
        self, contexts: list[list[int]], conts: list[list[int]], owner: list[int], desc: str
    ) -> list[tuple[float, bool]]:
        """``_score`` through engine requests: ``prompt_logprobs=1`` from the continuation's first token on, so a
        context's full blocks come from the prefix cache (chunked prefill: any length the context holds, cut to
        ``max_length - 1`` tokens as the engine samples one more)."""
        prompts, params = [], []
        limit = self.max_length - 1  # the engine samples one token after the prompt
        for u, cont in zip(owner, conts):
            whole, first = contexts[u] + cont, len(contexts[u])
            if len(whole) > limit:  # cut from the left, at least one context token kept
                whole = whole[-limit:]
                first = max(1, len(whole) - len(cont))
            prompts.append(whole)
            params.append(SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, prompt_logprobs_from=first))
        out: list[tuple[float, bool]] = []
        bar = tqdm(total=len(prompts), desc=desc, disable=not self.show_progress)
        for lo in range(0, len(prompts), CHUNK_REQUESTS):
            results = self.llm.generate(prompts[lo : lo + CHUNK_REQUESTS], params[lo : lo + CHUNK_REQUESTS])
            for r, sp in zip(results, params[lo : lo + CHUNK_REQUESTS]):
                pl = r.prompt_logprobs
                ids = r.prompt_token_ids
                first = sp.prompt_logprobs_from
                total = sum(pl.logprobs[first:])
                greedy = all(ids[i] in pl.top_logprobs[i] for i in range(first, len(ids)))
                out.append((float(total), bool(greedy)))
            bar.update(len(results))
        bar.close()
        return out

    def _encode_many(self, strings: list[str]) -> dict[str, list[int]]:
        """``tok_encode`` of each distinct string, in one batched tokenizer call (Rust, several threads)."""
        uniq = list(dict.fromkeys(strings))
        if not uniq:
            return {}
        if callable(self.tokenizer):  # a HF tokenizer: a list in, ``input_ids`` per string out
            ids = self.tokenizer(uniq)["input_ids"]
        else:
            ids = [self.tokenizer.encode(u) for u in uniq]
        return {u: list(i) for u, i in zip(uniq, ids)}

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``TemplateLM.loglikelihood``'s tokenisation (its ``_encode_pair``: trailing context spaces move to the
        continuation; the whole string is encoded and the context's token count cut off; an empty context becomes
        ``prefix_token_id``), with every distinct string encoded once in one batched call: a document's choices
        share their context, and per-string ``encode`` calls were ~20% of this phase (``docs/evaluation.md``)."""
        t0 = time.perf_counter()
        args = [req.args for req in requests]
        parts: list[tuple[str, str] | None] = []  # (context, continuation) after the space move; None: empty context
        for context, continuation in args:
            n = len(context) - len(context.rstrip())
            parts.append(
                None if context == "" else (context[:-n], context[-n:] + continuation) if n else (context, continuation)
            )
        with gc_paused():  # the many small lists would trigger full collections over lm-eval's live objects
            pairs = [p for p in parts if p is not None]
            enc = self._encode_many([c + k for c, k in pairs] + [c for c, _ in pairs])
            bare = {k: self.tok_encode(k, add_special_tokens=False) for (c, k), p in zip(args, parts) if p is None}
            new_reqs = []
            for (context, continuation), p in zip(args, parts):
                if p is None:
                    ctx, cont = [self.prefix_token_id], bare[continuation]
                else:
                    ctx = enc[p[0]]
                    cont = enc[p[0] + p[1]][len(ctx) :]
                new_reqs.append(((context, continuation), ctx, cont))
            tokenize_s = time.perf_counter() - t0
            out = self._loglikelihood_tokens(new_reqs, disable_tqdm=disable_tqdm)
        self.last_score_stats.update(tokenize_s=tokenize_s, loglikelihood_s=time.perf_counter() - t0)
        return out

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list:
        pairs = [(ctx, cont) for _, ctx, cont in requests]
        results = self._score(pairs, "polyrl loglikelihood")
        for (key, _, _), res in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, res)
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, req in enumerate(requests):
            (string,) = req.args
            for w in lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length - 1,
                context_len=1,
            ):
                windows.append(lm_utils.make_disjoint_window(w))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (lp, _) in zip(owner, self._score(windows, "polyrl loglikelihood_rolling")):
            totals[i] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    # ---- generation ---------------------------------------------------------------------------------
    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Every request in one ``LLM.generate`` call (continuous batching over all of them, whatever their
        ``gen_kwargs``: each request carries its own ``SamplingParams``; a progress bar fed by ``on_finish``), the
        distinct contexts encoded in one batched tokenizer call. The ``until`` strings are the engine's stop strings,
        checked as each token is accepted (``infer/stopping.py``): a sequence stops at the token that completes one,
        and its text is cut before it, as lm-eval's ``hf`` backend cuts its text afterwards (``tests/eval``).
        ``last_generate_stats`` (see ``_generate_stats``) says where the call's time went."""
        t0 = time.perf_counter()
        prompts, params = [], []
        eos_text = self.tok_decode([self.eot_token_id])
        with gc_paused():
            enc = self._encode_many([req.args[0] for req in requests])
        for req in requests:
            context, gen_kwargs = req.args
            kw = dict(gen_kwargs or {})
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            if eos_text and eos_text not in until:
                until.append(eos_text)
            max_gen = int(kw.pop("max_gen_toks", 256))
            do_sample = _truthy(kw.pop("do_sample", False))
            temperature = float(kw.pop("temperature", 0.0)) if do_sample else 0.0
            ids = enc[context]
            ids = ids[-max(1, self.max_length - max_gen) :]
            max_gen = max(1, min(max_gen, self.max_length - len(ids)))
            until = [s for s in until if s]
            prompts.append(ids)
            params.append(SamplingParams(temperature=temperature, max_tokens=max_gen, stop=until or None))
        t1 = time.perf_counter()
        bar = tqdm(total=len(prompts), desc="polyrl generate_until", disable=not self.show_progress)
        # host time and the engine's launch count at the end of each engine step (but the last): which steps ran
        # prompts synchronously and which queued decode launches ahead
        llm = self.llm
        marks = [(t1, _queued_ahead(llm))]
        capture0, tokens0 = llm.runner.graph_capture_s, llm.num_generated_tokens
        results = (
            llm.generate(
                prompts,
                params,
                on_finish=lambda i, j, out: bar.update(1),
                between_steps=lambda e, steps: marks.append((time.perf_counter(), _queued_ahead(e))),
            )
            if prompts
            else []
        )
        bar.close()
        texts = [r.outputs[0].text for r in results]
        for req, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", req.args, text)
        t2 = time.perf_counter()
        marks.append((t2, _queued_ahead(llm)))
        self.last_generate_stats = _generate_stats(marks, t0, prompts, results)
        self.last_generate_stats["graph_capture_s"] = llm.runner.graph_capture_s - capture0
        self.last_generate_stats["engine_tokens"] = llm.num_generated_tokens - tokens0
        return texts


def _queued_ahead(llm) -> int:
    """Steps the engine has queued before reading the one in flight: decode launches and prompt steps."""
    return llm.num_launches_ahead + llm.num_mixed_ahead


def _generate_stats(marks: list[tuple[float, int]], t0: float, prompts: list[list[int]], results: list) -> dict:
    """Where a ``generate_until`` call went. ``marks``: (host time, launches queued ahead so far) at the start of
    the engine call and after each engine step. ``prepare_s``: tokenising and parameters; ``generate_s``: the engine
    call; ``steps``: engine steps (a launch of several decode steps counts once), ``first_step_s`` /
    ``slowest_step_s`` (a compilation or a graph capture inside the call shows there); ``sync_steps`` /
    ``sync_s``: the steps that ran synchronously (prompt chunks whose draws the host needs at once, e.g. top-k
    alternatives); ``launches`` / ``launch_s``: the steps that queued a launch ahead, prompt steps included (their
    host time: reading the previous launch, stop checks, scheduling); ``final_s``: the last step and reading what
    was left. ``requests``, ``engine_calls``, ``prompt_tokens``, ``generated_tokens`` (sum of the outputs' token
    counts: a sequence that stops early at an ``until`` string or EOS generates fewer)."""
    gaps = [(b - a, nb > na) for (a, na), (b, nb) in zip(marks, marks[1:])]
    body, final = gaps[:-1], gaps[-1:]
    times = [g for g, _ in gaps]
    return {
        "requests": len(prompts),
        "engine_calls": 1 if prompts else 0,
        "prompt_tokens": sum(len(p) for p in prompts),
        "generated_tokens": sum(len(c.token_ids) for r in results for c in r.outputs),
        "prepare_s": marks[0][0] - t0,
        "generate_s": marks[-1][0] - marks[0][0],
        "steps": len(gaps),
        "first_step_s": times[0] if times else 0.0,
        "slowest_step_s": max(times, default=0.0),
        "sync_steps": sum(1 for _, ahead in body if not ahead),
        "sync_s": sum(g for g, ahead in body if not ahead),
        "launches": sum(1 for _, ahead in body if ahead),
        "launch_s": sum(g for g, ahead in body if ahead),
        "final_s": sum(g for g, _ in final),
    }


def _task_names(folder: Path) -> dict[str, Path]:
    """The ``task:`` names of the YAML files under ``folder`` -> the file declaring each (read as text, so a file
    lm-eval cannot parse is found too)."""
    names = {}
    for p in sorted(folder.rglob("*.yaml")):
        for line in p.read_text(errors="replace").splitlines():
            if line.startswith("task:"):
                names[line.split(":", 1)[1].strip().strip("'\"")] = p
    return names


def check_tasks(tasks: list[str], include_path: str | None = None) -> Any:
    """lm-eval's ``TaskManager`` over the bundled tasks and ``include_path``, after checking that every name in
    ``tasks`` is a task there (or in lm-eval's own index, read only when a name is not found in those folders): a
    UserError naming the unknown ones and the closest task names. ``polyrl eval`` calls it before the model loads."""
    # lazy: lm-eval's task index loads only when tasks are run
    from lm_eval.tasks import TaskManager

    paths = [bundled_task_dir()]
    if include_path is not None:
        if not Path(include_path).is_dir():
            raise UserError(f"--include-path {include_path!r} is not a folder of lm-eval task YAML files")
        paths.append(Path(include_path))
    declared = {name: f for p in paths for name, f in _task_names(p).items()}
    tm = TaskManager(include_path=[str(p) for p in paths], include_defaults=not set(tasks) <= set(declared))
    unknown = [t for t in tasks if t not in tm.all_tasks]
    unreadable = [(t, declared[t]) for t in unknown if t in declared]
    if unreadable:  # lm-eval skips a YAML it cannot read without a word: say which file and why
        raise UserError(
            "; ".join(
                f"task {t} is declared in {f}, but lm-eval could not read that file: {_yaml_error(f)}"
                for t, f in unreadable
            )
        )
    if unknown:
        raise UserError(
            f"unknown lm-eval task(s) {', '.join(unknown)}{did_you_mean(unknown, tm.all_tasks)}; bundled: "
            f"{', '.join(BUNDLED_TASKS)} (or give --include-path DIR with their YAML files)"
        )
    try:  # build the tasks (their data loads here) so a broken task fails before the model loads
        loaded = tm.load(tasks)
    except Exception as exc:  # noqa: BLE001 - any error of a user's task YAML or its data
        raise UserError(
            f"lm-eval could not build task(s) {', '.join(tasks)}: {type(exc).__name__}: {exc}; check the task's YAML "
            "(dataset_path, dataset_kwargs, doc_to_* fields)"
        ) from None
    _reuse_once(tm, tasks, loaded)
    return tm


def _reuse_once(tm: Any, tasks: list[str], loaded: Any) -> None:
    """Make ``tm.load(tasks)`` (what ``simple_evaluate`` calls) return the tasks ``check_tasks`` built, once: their
    data is not loaded twice. Any other call, or a second one, builds afresh."""
    build = tm.load

    def load(task_list: Any, *args: Any, **kwargs: Any) -> Any:
        tm.load = build
        if list(task_list) == tasks and not args and not kwargs:
            return loaded
        return build(task_list, *args, **kwargs)

    tm.load = load


def _yaml_error(path: Path) -> str:
    """Why lm-eval's YAML loader refuses ``path`` (its message), or why lm-eval may have skipped it."""
    # lazy: lm-eval is the optional `eval` extra, read only when a task file failed to load
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        load_yaml(path, resolve_func=False, recursive=True)
    except Exception as exc:  # noqa: BLE001 - the loader's message is what the user needs
        return f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return "it parses, but lm-eval did not index it (check its task: / group: keys)"


def run_tasks(
    llm: LLM,
    tasks: list[str],
    include_path: str | None = None,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    apply_chat_template: bool = False,
    log_samples: bool = False,
    task_manager: Any = None,
) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` of ``tasks`` on ``llm`` (the ``polyrl`` model), the bundled tasks and
    ``include_path`` searchable by name. lm-eval's own task index (thousands of YAMLs, seconds to build) is read
    only when a task is not found in those folders. ``task_manager``: ``check_tasks``'s, when the caller checked
    the names already."""
    # lazy: lm-eval's evaluator loads only when tasks are run
    import lm_eval

    tm = task_manager if task_manager is not None else check_tasks(tasks, include_path)
    return lm_eval.simple_evaluate(
        model=PolyrlLM(llm=llm),
        tasks=tasks,
        task_manager=tm,
        limit=limit,
        num_fewshot=num_fewshot,
        apply_chat_template=apply_chat_template,
        log_samples=log_samples,
    )


def result_rows(results: dict[str, Any]) -> list[tuple[str, str, float, float | None]]:
    """(task, metric, value, stderr) rows of a ``simple_evaluate`` result, for a table or JSON."""
    rows = []
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            if not isinstance(value, (int, float)) or "_stderr" in key or key in ("sample_len",):
                continue
            metric, _, _ = key.partition(",")
            err = metrics.get(key.replace(",", "_stderr,", 1))
            rows.append((task, metric, float(value), float(err) if isinstance(err, (int, float)) else None))
    return rows
