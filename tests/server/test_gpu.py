"""On an accelerator: the server's engine thread runs the model there (bf16, CUDA graphs where supported),
greedy answers equal the engine's own, 32 concurrent streams finish with the right token counts, and concurrent
lm-eval scoring requests answer what each alone answers."""

from __future__ import annotations

import asyncio

import pytest

from .conftest import MODEL

pytestmark = pytest.mark.gpu


def test_serving_on_the_accelerator(tiny_model_dir):
    import openai

    from polyrl.infer import LLM, RolloutConfig, SamplingParams
    from polyrl.platform import device
    from polyrl.server import ServeConfig, start_server

    cfg = RolloutConfig(num_blocks=1024, max_num_seqs=32, max_model_len=512)
    ref = LLM.from_pretrained(str(tiny_model_dir), cfg, dtype="bfloat16", device=device.torch_device())
    want = ref.generate(["The answer is"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    llm = LLM.from_pretrained(str(tiny_model_dir), cfg, dtype="bfloat16", device=device.torch_device())
    with start_server(llm, ServeConfig(port=0, served_model_name=MODEL, log_level="warning")) as h:
        client = openai.OpenAI(base_url=h.base_url, api_key="x", max_retries=0)
        got = client.completions.create(
            model=MODEL, prompt="The answer is", temperature=0, max_tokens=12, extra_body={"ignore_eos": True}
        )
        assert got.choices[0].text == want.outputs[0].text

        async def one(ac, i):
            stream = await ac.completions.create(
                model=MODEL,
                prompt=f"request {i}",
                max_tokens=32,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            chunks = [c async for c in stream]
            return chunks[-1].usage.completion_tokens

        async def main():
            async with openai.AsyncOpenAI(base_url=h.base_url, api_key="x", max_retries=0) as ac:
                return await asyncio.gather(*(one(ac, i) for i in range(32)))

        assert asyncio.run(main()) == [32] * 32


def test_tools_and_structured_outputs_on_the_accelerator(tiny_model_dir):
    """Forced tool calls and a pydantic schema, mixed with free requests in one batch, on the accelerator: the mask
    is applied after the CUDA-graph forward; every constrained reply is valid, the free ones run alongside."""
    import json

    import openai
    from pydantic import BaseModel, Field

    from polyrl.infer import LLM, RolloutConfig
    from polyrl.platform import device
    from polyrl.server import ServeConfig, start_server

    class Item(BaseModel):
        name: str = Field(max_length=8)
        count: int = Field(ge=0, le=99)

    tool = {
        "type": "function",
        "function": {
            "name": "pick",
            "parameters": {"type": "object", "properties": {"x": {"enum": ["a", "b"]}}, "required": ["x"],
                           "additionalProperties": False},
        },
    }  # fmt: skip
    cfg = RolloutConfig(num_blocks=1024, max_num_seqs=64, max_model_len=512)
    llm = LLM.from_pretrained(str(tiny_model_dir), cfg, dtype="bfloat16", device=device.torch_device())
    with start_server(llm, ServeConfig(port=0, served_model_name=MODEL, log_level="warning")) as h:

        async def main():
            async with openai.AsyncOpenAI(base_url=h.base_url, api_key="x", max_retries=0, timeout=120) as ac:
                msgs = [{"role": "user", "content": "go"}]
                chat = ac.chat.completions
                parsed = [
                    chat.parse(model=MODEL, messages=msgs, response_format=Item, n=8, max_tokens=80) for _ in range(4)
                ]
                forced = {"tools": [tool], "tool_choice": "required", "parallel_tool_calls": False}
                calls = [chat.create(model=MODEL, messages=msgs, n=8, max_tokens=80, **forced) for _ in range(2)]
                extra = {"ignore_eos": True}
                free = [chat.create(model=MODEL, messages=msgs, n=8, max_tokens=64, extra_body=extra) for _ in range(2)]
                return await asyncio.gather(*parsed), await asyncio.gather(*calls), await asyncio.gather(*free)

        parsed, calls, free = asyncio.run(main())
    assert all(isinstance(c.message.parsed, Item) for r in parsed for c in r.choices)
    for r in calls:
        for c in r.choices:
            assert c.finish_reason == "tool_calls"
            assert json.loads(c.message.tool_calls[0].function.arguments)["x"] in ("a", "b")
    assert all(c.finish_reason == "length" for r in free for c in r.choices)
    assert llm.grammar_cache().compiles == 2 and llm.runner.use_graphs == device.supports_graphs()


def test_concurrent_lm_eval_scoring_on_the_accelerator(tiny_model_dir):
    """lm-eval's local-completions request shape (token-id prompts, echo + logprobs 1, max_tokens 1, greedy), 8
    requests in flight: every prompt is scored (directly, concurrent calls merged on the engine thread) and each
    answer is what the same request alone gives: the same tokens and offsets, log-probs within bf16 noise."""
    import concurrent.futures
    import random

    import httpx

    from polyrl.infer import LLM, RolloutConfig
    from polyrl.platform import device
    from polyrl.server import ServeConfig, start_server

    rnd = random.Random(0)
    batches = [[[rnd.randrange(5, 2000) for _ in range(rnd.randint(20, 90))] for _ in range(16)] for _ in range(16)]
    cfg = RolloutConfig(num_blocks=1024, max_num_seqs=32, max_model_len=512)
    llm = LLM.from_pretrained(str(tiny_model_dir), cfg, dtype="bfloat16", device=device.torch_device())
    with start_server(llm, ServeConfig(port=0, served_model_name=MODEL, log_level="warning")) as h:
        body = {"model": MODEL, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0, "seed": 1234}

        def post(prompts):
            with httpx.Client(timeout=120) as c:
                r = c.post(h.base_url + "/completions", json={**body, "prompt": prompts})
                assert r.status_code == 200, r.text
                return r.json()["choices"]

        alone = [post(b) for b in batches]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            together = list(pool.map(post, batches))
        metrics = httpx.get(h.url + "/metrics").text
    assert "polyrl_scoring_prompts_total " + str(2 * 16 * 16) in metrics
    for a_choices, t_choices in zip(alone, together):
        for a, t in zip(a_choices, t_choices):
            la, lt = a["logprobs"], t["logprobs"]  # the prompt's part (the greedy next token may flip in bf16)
            assert la["tokens"][:-1] == lt["tokens"][:-1] and la["text_offset"] == lt["text_offset"]
            assert la["token_logprobs"][0] is None and lt["token_logprobs"][0] is None
            assert la["token_logprobs"][1:-1] == pytest.approx(lt["token_logprobs"][1:-1], abs=5e-2)
