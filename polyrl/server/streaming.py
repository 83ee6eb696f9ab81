"""How request outputs reach the client: SSE framing for streams, and a disconnect-aware wait for the
final output of non-streaming requests (a client that hangs up gets its requests aborted in the engine).

Shared by ``chat.py`` and ``completions.py``; knows nothing of their schemas.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from polyrl.server.api_errors import APIError, error_body
from polyrl.server.async_engine import EngineDeadError, StreamGroup

DONE = "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


class ClientGone(Exception):
    """The client disconnected before its non-streaming response was ready (the engine work is aborted)."""


async def _wait_disconnect(request: Any) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def final_outputs(group: StreamGroup, request: Any) -> dict[str, Any]:
    """request id -> its finished ``RequestOutput``; aborts the group and raises ClientGone on disconnect."""

    async def collect() -> dict[str, Any]:
        done = {}
        async for rs, out in group:
            if out.finished:
                done[rs.request_id] = out
        return done

    getter = asyncio.ensure_future(collect())
    watcher = asyncio.ensure_future(_wait_disconnect(request)) if request is not None else None
    try:
        waiters = {getter} | ({watcher} if watcher else set())
        done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if getter in done:
            return _engine_result(getter)
        group.abort()
        raise ClientGone()
    finally:
        for task in (getter, watcher):
            if task is not None and not task.done():
                task.cancel()


def _engine_result(task: asyncio.Future) -> dict[str, Any]:
    try:
        return task.result()
    except EngineDeadError as exc:
        raise APIError(str(exc), 500, "server_error", None, "engine_error") from exc


async def guarded_stream(group: StreamGroup, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Pass SSE chunks through; abort unfinished requests when the client goes away (the task is cancelled)
    and turn an engine failure into a final SSE error event."""
    try:
        async for chunk in chunks:
            yield chunk
    except EngineDeadError as exc:
        yield sse(error_body(str(exc), "server_error", None, "engine_error"))
        yield DONE
    finally:
        if not group.finished:
            group.abort()
