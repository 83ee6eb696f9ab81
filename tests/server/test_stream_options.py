"""``stream_options`` on a request that does not stream is a 400 naming it on chat and completions (as OpenAI and
vLLM answer), with the official openai client against the real server; on a stream it still shapes the stream."""

from __future__ import annotations

import openai
import pytest

from .conftest import MODEL

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, None])  # stream: false, or stream left out
def test_stream_options_without_stream_is_400(client, endpoint, stream):
    create = client.chat.completions.create if endpoint == "chat" else client.completions.create
    kw = {**(CHAT if endpoint == "chat" else COMPLETION), "max_tokens": 2, "stream_options": {"include_usage": True}}
    if stream is not None:
        kw["stream"] = stream
    with pytest.raises(openai.BadRequestError) as info:
        create(model=MODEL, **kw)
    body = info.value.body
    assert info.value.status_code == 400 and body["param"] == "stream_options" and body["code"] == "invalid_value"
    assert body["message"].startswith("stream_options is only allowed when stream is true"), body
    # streamed, the same options are fine: the last chunk carries the usage
    chunks = list(create(model=MODEL, **{**kw, "stream": True}))
    assert chunks[-1].usage.completion_tokens == 2
