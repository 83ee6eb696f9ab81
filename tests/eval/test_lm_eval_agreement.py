"""lm-eval-harness (the ``eval`` extra, lm-eval 0.4.13) on polyrl's own tasks (``polyrl/eval/tasks``: multiple
choice, generation, rolling log-likelihood; no hub): ``local-completions`` against a real ``polyrl serve``, the
in-process ``polyrl`` model, and lm-eval's own ``hf`` backend on the same tiny fp32 checkpoint agree per sample
(log-likelihoods within 1e-3, the same greedy flags, the same generations, the same metrics);
``local-chat-completions`` generates what the engine's own chat() does. ~15 s on one CPU thread."""

from __future__ import annotations

import os

import pytest
import torch

from polyrl.eval.bundled import BUNDLED_TASKS, bundled_task_dir

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks read local jsonl; nothing may come from the hub

METRICS = ("acc,none", "acc_norm,none", "exact_match,none", "word_perplexity,none", "bits_per_byte,none")


def run(model: str, model_args: str, tasks=BUNDLED_TASKS, **kw) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    import polyrl.eval.harness  # noqa: F401  (registers the polyrl model)

    tm = TaskManager(include_path=str(bundled_task_dir()), include_defaults=False)
    return lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=list(tasks), task_manager=tm, log_samples=True, batch_size=16, **kw
    )


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from polyrl.infer import LLM, RolloutConfig
    from polyrl.server import ServeConfig, start_server

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = RolloutConfig(block_size=16, num_blocks=512, max_num_seqs=64, max_model_len=256)
    llm = LLM.from_pretrained(str(tiny_model_dir), cfg, dtype="float32", device="cpu")
    handle = start_server(llm, ServeConfig(port=0, served_model_name="tiny", log_level="warning"))
    yield handle
    handle.stop()
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def results(server, tiny_model_dir):
    d = str(tiny_model_dir)
    api = f"model=tiny,tokenizer={d},tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,max_length=256"
    return {
        "hf": run("hf", f"pretrained={d},dtype=float32", device="cpu"),
        "polyrl": run("polyrl", f"pretrained={d},dtype=float32,max_length=256", device="cpu"),
        "serve": run("local-completions", f"base_url={server.base_url}/completions,tokenized_requests=True,{api}"),
    }


def responses(result: dict, task: str) -> list:
    return [s["resps"] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


@pytest.mark.parametrize("task", ["polyrl_arith_mc", "polyrl_text_ppl"])
@pytest.mark.parametrize("backend", ["polyrl", "serve"])
def test_loglikelihoods_equal_the_hf_backend(results, backend, task):
    want, got = responses(results["hf"], task), responses(results[backend], task)
    assert len(got) == len(want) == (40 if task == "polyrl_arith_mc" else 8)
    worst, count = 0.0, 0
    for w_doc, g_doc in zip(want, got):
        assert len(w_doc) == len(g_doc)  # one response per choice (or per document for rolling)
        for (w,), (g,) in zip(w_doc, g_doc):
            w_ll, g_ll = (w[0], g[0]) if isinstance(w, tuple) else (w, g)
            worst = max(worst, abs(w_ll - g_ll))
            count += 1
            if isinstance(w, tuple):
                assert w[1] == g[1]  # is_greedy
    assert count == (160 if task == "polyrl_arith_mc" else 8)
    assert worst <= 1e-3, worst
    for metric in METRICS:
        if metric in results["hf"]["results"][task]:
            assert results[backend]["results"][task][metric] == pytest.approx(
                results["hf"]["results"][task][metric], rel=1e-4
            )


@pytest.mark.parametrize("backend", ["polyrl", "serve"])
def test_generation_equals_the_hf_backend(results, backend):
    want, got = responses(results["hf"], "polyrl_arith_gen"), responses(results[backend], "polyrl_arith_gen")
    assert len(got) == 40 and got == want
    assert all(isinstance(r[0][0], str) and r[0][0] for r in got)
    m = "exact_match,none"
    assert results[backend]["results"]["polyrl_arith_gen"][m] == results["hf"]["results"]["polyrl_arith_gen"][m]


def test_local_chat_completions_generates_what_the_engine_does(server, tiny_model_dir):
    from polyrl.infer import LLM, RolloutConfig, SamplingParams

    args = f"base_url={server.base_url}/chat/completions,model=tiny,tokenizer={tiny_model_dir},num_concurrent=1"
    out = run("local-chat-completions", args + ",max_retries=1", ["polyrl_arith_gen"], apply_chat_template=True)
    got = [r[0][0] for r in responses(out, "polyrl_arith_gen")]
    llm = LLM.from_pretrained(str(tiny_model_dir), RolloutConfig(num_blocks=256), dtype="float32", device="cpu")
    docs = sorted(out["samples"]["polyrl_arith_gen"], key=lambda s: s["doc_id"])
    messages = [[{"role": "user", "content": f"Question: {s['doc']['question']}\nAnswer:"}] for s in docs]
    want = [o.outputs[0].text for o in llm.chat(messages, SamplingParams(temperature=0, max_tokens=8, stop=["\n"]))]
    assert len(got) == 40 and got == want
