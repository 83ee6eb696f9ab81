"""Real agent frameworks against ``polyrl serve`` (the random tiny model; calls forced with tool_choice="required",
final answers shaped by an output type, so every run ends): the openai-agents SDK with its chat-completions model
and its default Responses model, plain and streamed; LangChain's ChatOpenAI with bind_tools and
with_structured_output. Pinned in the ``agents`` extra (``make install`` installs it)."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from .conftest import API_KEY, make_llm

# the agents extra (installed by `make test`); a machine without it (the GPU image) skips this module
agents = pytest.importorskip("agents", reason='the agents extra: pip install -e ".[agents]"')


class Report(BaseModel):
    city: Literal["Paris", "Rome"]
    summary: str = Field(max_length=12)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from polyrl.server import ServeConfig, start_server

    llm = make_llm(tiny_model_dir, max_model_len=1024)
    handle = start_server(llm, ServeConfig(port=0, served_model_name="tiny", api_key=API_KEY, log_level="warning"))
    yield handle
    handle.stop()


def test_openai_agents_sdk_runs_a_tool_agent_to_its_final_answer(server):
    import openai
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather of a city."""
        calls.append(city)
        return f"sunny in {city}"

    async def main():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)
        results = []
        for model_cls in (OpenAIChatCompletionsModel, OpenAIResponsesModel):
            agent = agents.Agent(
                name="weather",
                instructions="Call get_weather, then report.",
                tools=[get_weather],
                output_type=Report,
                model=model_cls(model="tiny", openai_client=client),
                # after the first call the SDK resets tool_choice to auto: with the output type, each later turn is a
                # call or the Report (the grammar is their union); greedy, so the number of turns is reproducible
                model_settings=ModelSettings(
                    tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=0.0
                ),
            )
            assert isinstance(agent, Agent)
            results.append(await Runner.run(agent, "Weather in Paris?", max_turns=8))
            streamed = Runner.run_streamed(agent, "Weather in Rome?", max_turns=8)
            events = [e async for e in streamed.stream_events()]
            assert events
            results.append(streamed)
        await client.close()
        return results

    results = asyncio.run(main())
    assert len(results) == 4 and len(calls) >= 4  # each run called the tool at least once (then tool_choice resets)
    for res in results:
        kinds = [type(i) for i in res.new_items]
        assert kinds[0] is ToolCallItem and ToolCallOutputItem in kinds and kinds[-1] is MessageOutputItem
        assert isinstance(res.final_output, Report)  # the final answer, parsed from the last turn


def test_langchain_bind_tools_and_structured_output(server):
    import langchain_openai
    from langchain_core.tools import tool

    @tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather of a city."""
        return f"sunny in {city}"

    llm = langchain_openai.ChatOpenAI(
        model="tiny", base_url=server.base_url, api_key=API_KEY, max_tokens=80, max_retries=0, temperature=0.8
    )
    msg = llm.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False, strict=True).invoke(
        "Weather in Rome?"
    )
    assert len(msg.tool_calls) == 1
    assert msg.tool_calls[0]["name"] == "get_weather" and msg.tool_calls[0]["args"]["city"] in ("Paris", "Rome")
    assert msg.response_metadata["finish_reason"] == "tool_calls"
    report = llm.with_structured_output(Report).invoke("Report the weather.")
    assert isinstance(report, Report)
    forced = llm.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False, strict=True)
    streamed = list(forced.stream("Weather?"))
    merged = streamed[0]
    for chunk in streamed[1:]:
        merged = merged + chunk
    assert merged.tool_calls and merged.tool_calls[0]["name"] == "get_weather"
