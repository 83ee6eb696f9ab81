"""On an accelerator: the server's engine thread runs the model there (bf16, CUDA graphs where supported),
greedy answers equal the engine's own, and 32 concurrent streams finish with the right token counts."""

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
