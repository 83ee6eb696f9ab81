"""Proxy mode over HTTP (imports FastAPI and uvicorn: import this module only when proxy mode is used; ``import
polyrl.agents`` never does): an OpenAI-compatible endpoint per episode (``<url>/agents/<episode id>/v1``) that records
every call of an agent program for RL, plus ``AgentProxy.run_agents`` to run such programs many at once.

Bring an existing agent: it takes a ``base_url`` and builds ``openai.OpenAI(base_url=base_url, api_key="x")`` (or
any framework's OpenAI model with that base URL) and runs its own loop: ``chat.completions.create(messages=...,
tools=...)``, executes the ``tool_calls`` it gets back, appends ``tool`` messages, calls again. Routes:

- ``POST /agents/{id}/v1/chat/completions``: messages (system/user/assistant/tool, ``tool_calls``; content a string
  or text parts, joined as ``polyrl serve`` joins them; other parts and nameless calls are 400s), ``tools``,
  ``temperature``, ``top_p``, ``max_tokens`` / ``max_completion_tokens`` (capped by the proxy's), ``seed``,
  ``logprobs``, ``response_format`` / ``parallel_tool_calls`` (with tools: a call or an answer in the format; without
  a request format, the run's ``rollout_response_format``). The reply's ``<tool_call>`` blocks come back as OpenAI
  ``tool_calls`` (``finish_reason "tool_calls"``); a reply the token limit cut keeps its whole calls, drops the one
  it left half written and says ``finish_reason "length"``, as ``polyrl serve`` (``tool_parsers.finished_text`` /
  ``finish_reason``). Extra fields ``prompt_token_ids`` and ``choices[0].token_ids`` show what was recorded (the
  sampled ids, a half-written call's included).
- ``POST /agents/{id}/v1/responses``: the Responses API (``input`` items, ``instructions``, function ``tools``,
  ``max_output_tokens``, ...; not streamed, stateless) over the same recording; its items are those of
  ``polyrl serve`` (``responses_items``), so an agent written against the Responses API trains unchanged; a reply
  cut by ``max_output_tokens`` is ``incomplete`` (``incomplete_details.reason "max_output_tokens"``) with its whole
  calls only.
- ``POST /agents/{id}/reward`` ``{"reward": 1.0}``: the episode's reward (or the agent function returns it).
- ``GET /agents/{id}/v1/models``, ``GET /health``.
The prompts are built token-exactly by ``polyrl.agents.proxy.AgentSession``; one engine thread drives
``llm.step()`` while the proxy runs. Partial rollouts (async RL): ``driving(between_steps)`` has that thread call the
producer's weight-swap hook between its engine steps (``EngineDriver``), and each call records the policy version of
every sampled token (``CompletionOutput.token_versions`` -> ``Episode.versions``); the time the engine stands still
there is not counted against an agent's timeout.
``run_agents(agent, examples, n)`` calls ``agent(base_url, example)`` in threads (continuous batching across all
their calls) with a per-episode timeout; an agent that raises, times out or returns something that is not a finite
number (nor None) is counted and gets the failure reward, never fatal. In training (``--agent file.py:fn``) the run's
sampling settings win over the request's (``request_sampling=False``: the ratios need the rollout temperature), and
``max_turns`` / ``max_episode_tokens`` bound each episode (a call past them gets a 400).
Not here: the plain OpenAI server (``polyrl.server``), training (``polyrl.agents.train``).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import socket
import threading
import time
import uuid
import warnings
from contextlib import contextmanager
from numbers import Real
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from polyrl.agents.formats import pick, to_format, turn_grammar
from polyrl.agents.proxy import AgentSession
from polyrl.agents.render import ChatRenderer
from polyrl.agents.responses_items import (
    ItemError,
    ResponseShell,
    chat_tool_choice,
    chat_tools,
    input_messages,
    output_items,
    usage,
)
from polyrl.agents.rollout import turn_seed
from polyrl.agents.tool_parsers import finish_reason, finished_text
from polyrl.errors import UserError
from polyrl.infer import SamplingParams


class EngineDriver:
    """Runs ``llm.step()`` on one thread; ``submit(ids, params, done)`` calls ``done(RequestOutput)`` there.
    ``start(between_steps)``: with partial rollouts, ``between_steps(llm, steps)`` is called on that thread at every
    engine-step boundary while requests are in flight (``steps``: the engine steps since ``start``), as
    ``LLM.generate`` calls it; it may ``swap_weights`` (the outputs of the step it read come with the next
    ``step()``, which follows at once) or block there until an update is published.
    ``stop()`` waits ``join_timeout`` seconds for the thread. Each ``start`` gives its thread a stop event of its own,
    so a thread still blocked in its hook when ``stop()`` gave up on it (the next window's thread may be running by
    then) never steps the engine again: it re-checks its event after the hook (and before each step) and exits; an
    error it raises then is not reported to the next window's calls."""

    def __init__(self, llm: Any, join_timeout: float = 30.0) -> None:
        self.llm = llm
        self.join_timeout = join_timeout
        self.between_steps: Any = None
        # (seconds the driver spent inside between_steps -- waiting for an update, loading it --, the monotonic start
        # of the call in progress or None): set by the driver thread and stop(), read by run_agents's thread, as one
        # tuple under _lock
        self._lock = threading.Lock()
        self._pause: tuple[float, float | None] = (0.0, None)
        self._done: dict[str, Any] = {}
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._stop = threading.Event()  # the running thread's own (a fresh one per start)
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self, between_steps: Any = None) -> None:
        self._stop = stop = threading.Event()
        self.between_steps = between_steps
        self._thread = threading.Thread(
            target=self._run, args=(stop, between_steps), name="polyrl-agent-engine", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.join_timeout)
        with self._lock:  # a hook call the thread may still be blocked in no longer holds this driver up
            paused, since = self._pause
            if since is not None:
                self._pause = (paused + time.monotonic() - since, None)
        self._thread = None
        self.between_steps = None

    @property
    def paused_s(self) -> float:
        """Seconds spent in ``between_steps`` so far (the one in progress included): the engine served no call then,
        so ``AgentProxy.run_agents`` does not count them against an agent's timeout."""
        with self._lock:
            paused, since = self._pause
        return paused + (time.monotonic() - since if since is not None else 0.0)

    def submit(self, ids: list[int], params: SamplingParams, done: Any) -> str:
        if self.error is not None:
            raise UserError(f"the engine stopped after an error: {self.error}")
        rid = f"agent-{next(self._ids)}"
        self._done[rid] = done
        try:
            self.llm.add_request(ids, params, request_id=rid)
        except BaseException:
            self._done.pop(rid, None)
            raise
        self._wake.set()
        return rid

    def _pause_begins(self, stop: threading.Event) -> bool:
        with self._lock:
            if stop.is_set():
                return False
            self._pause = (self._pause[0], time.monotonic())
            return True

    def _pause_ends(self, stop: threading.Event) -> None:
        with self._lock:
            paused, since = self._pause
            if not stop.is_set() and since is not None:  # once stopped, stop() has closed this pause
                self._pause = (paused + time.monotonic() - since, None)

    def _run(self, stop: threading.Event, hook: Any) -> None:
        steps = 0
        try:
            while not stop.is_set():
                if not self.llm.has_unfinished_requests():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                if steps and hook is not None:  # a step boundary with requests in flight (partial rollouts)
                    if not self._pause_begins(stop):
                        break
                    try:
                        hook(self.llm, steps)
                    finally:
                        self._pause_ends(stop)
                    if stop.is_set():  # stopped while in the hook: the engine may be the next window's thread's now
                        break
                steps += 1
                for out in self.llm.step():
                    if out.finished:
                        cb = self._done.pop(out.request_id, None)
                        if cb is not None:
                            cb(out)
                time.sleep(0)  # let the HTTP thread take the GIL between steps
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting call
            if stop.is_set():  # a stopped thread's error: the waiting calls (if any) are the next window's
                warnings.warn(f"a stopped agent engine driver failed after its stop: {exc!r}", RuntimeWarning, 2)
                return
            self.error = exc
            for cb in list(self._done.values()):
                cb(exc)
            self._done.clear()


def _returned_reward(value: Any) -> float | None:
    """The reward an agent function returned, as a float; None when it is not a finite number (a bool is not one,
    as for ``POST /reward``)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        return None
    reward = float(value)
    return reward if math.isfinite(reward) else None


def _chat_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """A request's chat messages as the renderer takes them: OpenAI text parts joined into the content string (as
    ``polyrl serve`` does), and a ValueError (a 400) naming the message for what the chat template cannot render."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a 'role' string")
        content = m.get("content")
        if isinstance(content, list):
            texts = [p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None for p in content]
            bad = next((j for j, t in enumerate(texts) if not isinstance(t, str)), None)
            if bad is not None:
                raise ValueError(
                    f"messages[{i}].content[{bad}] is not a text part; send {{'type': 'text', 'text': ...}} parts "
                    "(the policy is a text model)"
                )
            m = {**m, "content": "".join(texts)}
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        for k, c in enumerate(m.get("tool_calls") or []):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ValueError(f"messages[{i}].tool_calls[{k}].function.name is required (the name of the tool)")
        out.append(m)
    return out


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


class AgentProxy:
    """Sessions + engine driver + HTTP app for proxy-mode episodes (see the module docstring)."""

    def __init__(
        self,
        llm: Any,
        sampling: SamplingParams | None = None,
        max_tokens: int = 256,
        renderer: ChatRenderer | None = None,
        model_name: str = "polyrl-policy",
        request_sampling: bool = True,
        max_turns: int | None = None,
        max_episode_tokens: int | None = None,
    ) -> None:
        self.llm = llm
        self.request_sampling = request_sampling
        self.max_turns, self.max_episode_tokens = max_turns, max_episode_tokens
        self.sampling = sampling or SamplingParams(temperature=1.0)
        self.max_tokens = max_tokens
        self.renderer = renderer or ChatRenderer(llm.tokenizer)
        self.model_name = model_name
        self.sessions: dict[str, AgentSession] = {}
        self.seeds: dict[str, int | None] = {}
        self.driver = EngineDriver(llm)
        self.app = self._build_app()
        self._server: Any = None
        self.url: str | None = None

    # ---- sessions -------------------------------------------------------------------------------------
    def open(self, eid: str | None = None, group: int = 0, index: int = 0, seed: int | None = None) -> AgentSession:
        eid = eid or uuid.uuid4().hex[:12]
        sess = AgentSession(eid, self.renderer, self.llm.eos_token_ids, group, index)
        self.sessions[eid], self.seeds[eid] = sess, seed
        return sess

    def close(self, eid: str) -> AgentSession:
        self.seeds.pop(eid, None)
        return self.sessions.pop(eid)

    def base_url(self, eid: str) -> str:
        if self.url is None:
            raise UserError("the agent proxy is not running; call start() first")
        return f"{self.url}/agents/{eid}/v1"

    # ---- HTTP -----------------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="polyrl agent proxy")

        @app.get("/health")
        async def health() -> dict:
            return {"status": "ok"}

        @app.get("/agents/{eid}/v1/models")
        async def models(eid: str) -> dict:
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "polyrl"}]}

        @app.post("/agents/{eid}/reward")
        async def reward(eid: str, request: Request) -> Any:
            sess = self.sessions.get(eid)
            if sess is None:
                return _error(404, f"no open episode {eid!r}")
            body = await request.json()
            value = _returned_reward(body.get("reward")) if isinstance(body, dict) else None
            if value is None:
                return _error(400, 'send {"reward": <finite number>}', "reward")
            sess.set_reward(value)
            return {"episode": eid, "reward": value}

        @app.post("/agents/{eid}/v1/chat/completions")
        async def chat(eid: str, request: Request) -> Any:
            return await self._chat(eid, await request.json())

        @app.post("/agents/{eid}/v1/responses")
        async def responses(eid: str, request: Request) -> Any:
            return await self._responses(eid, await request.json())

        return app

    async def _chat(self, eid: str, body: Any) -> Any:
        sess = self.sessions.get(eid)
        if sess is None:
            return _error(404, f"no open episode {eid!r}; use the base_url the proxy gave this episode")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
            return _error(400, "messages must be a non-empty list", "messages")
        if body.get("stream"):
            return _error(400, "streaming is not recorded in proxy mode; send stream=false", "stream")
        tools = body.get("tools") or None
        try:
            messages = _chat_messages(body["messages"])
            ids, continues = sess.prompt_for(messages, tools)
            if self.max_turns is not None and sess.num_calls >= self.max_turns:
                return _error(400, f"this episode reached its limit of {self.max_turns} model calls; finish it")
            cap = body.get("max_completion_tokens") or body.get("max_tokens") or self.max_tokens
            limit = min(self.llm.max_model_len, self.max_episode_tokens or self.llm.max_model_len)
            room = limit - len(ids) - 1
            if room < 1:
                return _error(400, f"the conversation has {len(ids)} tokens; this episode may hold {limit}")
            changes: dict[str, Any] = {"n": 1, "max_tokens": max(1, min(int(cap), self.max_tokens, room))}
            for key in ("temperature", "top_p") if self.request_sampling else ():
                if body.get(key) is not None:
                    changes[key] = body[key]
            seed = body.get("seed") if self.request_sampling else None
            if seed is None and self.seeds.get(eid) is not None:
                seed = turn_seed(self.seeds[eid], sess.index, sess.num_calls)
            changes["seed"] = seed
            # the agent's own response_format (part of its program, honoured in training too), else the run's; with
            # tools, a call in the session's parser syntax OR the format (formats.turn_grammar)
            fmt = pick(to_format(body.get("response_format"), "response_format"), self.sampling.structured)
            parallel = body.get("parallel_tool_calls") is not False
            changes["structured"] = turn_grammar(fmt, tools or [], self.llm.tokenizer, parallel, sess.parser)
            params = self.sampling.clone(**changes)
        except (UserError, ValueError, TypeError) as exc:
            return _error(400, str(exc))
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def done(out: Any) -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(out))

        try:
            self.driver.submit(ids, params, done)
        except UserError as exc:
            return _error(400, str(exc))
        out = await fut
        if isinstance(out, BaseException):
            return _error(500, f"the engine failed: {out}")
        c = out.outputs[0]
        mass = getattr(c, "masked_logmass", None)  # None: unconstrained
        versions = getattr(c, "token_versions", None)  # partial rollouts: the policy version of each token
        # as polyrl serve: a reply cut inside a call keeps its whole calls, drops the half-written one (neither a call
        # nor content) and stays "length"; the recorded token ids are the sampled ones, half call included
        text = finished_text(sess.parser, c.text, c.finish_reason)
        reply = sess.record(messages, tools, ids, continues, list(c.token_ids), list(c.logprobs), text, mass, versions)
        msg = {"role": "assistant", "content": reply.get("content")}
        if reply.get("tool_calls"):
            msg["tool_calls"] = reply["tool_calls"]
        finish = finish_reason(c.finish_reason, bool(reply.get("tool_calls")))
        choice: dict[str, Any] = {"index": 0, "message": msg, "finish_reason": finish, "token_ids": list(c.token_ids)}
        if body.get("logprobs"):
            toks = [self.llm.tokenizer.decode([t]) for t in c.token_ids]
            choice["logprobs"] = {
                "content": [
                    {"token": t, "logprob": lp, "bytes": None, "top_logprobs": []} for t, lp in zip(toks, c.logprobs)
                ]
            }
        else:
            choice["logprobs"] = None
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": len(c.token_ids),
                "total_tokens": len(ids) + len(c.token_ids),
            },
            "prompt_token_ids": ids,
        }

    async def _responses(self, eid: str, body: Any) -> Any:
        """The Responses API over ``_chat`` (same recording), with the items of ``responses_items``; stateless and
        not streamed, as the proxy's chat route."""
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        refused = {
            "stream": "streaming is not recorded in proxy mode; send stream=false",
            "previous_response_id": "the proxy keeps no response state; send the whole input",
        }
        for field, why in refused.items():
            if body.get(field):
                return _error(400, why, field)
        try:
            chat = {
                "messages": input_messages(body.get("input", ""), body.get("instructions")),
                "tools": chat_tools(body.get("tools")),
                "tool_choice": chat_tool_choice(body.get("tool_choice")),
            }
        except ItemError as exc:
            return _error(400, str(exc), exc.param)
        for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
            if body.get(src) is not None:
                chat[dst] = body[src]
        if body.get("seed") is not None:
            chat["seed"] = body["seed"]
        if (body.get("text") or {}).get("format") is not None:
            chat["response_format"] = body["text"]["format"]  # flat json_schema: formats.to_format reads both shapes
        out = await self._chat(eid, chat)
        if not isinstance(out, dict):
            return out  # an error response
        choice = out["choices"][0]
        msg = choice["message"]
        cut = choice["finish_reason"] == "length"
        counts = usage(out["usage"]["prompt_tokens"], out["usage"]["completion_tokens"])
        shell = ResponseShell(body, self.model_name)
        items = output_items(msg.get("content"), msg.get("tool_calls") or [], cut)
        result = shell.build("incomplete" if cut else "completed", items, counts, "max_output_tokens" if cut else None)
        result["prompt_token_ids"], result["token_ids"] = out["prompt_token_ids"], choice["token_ids"]
        return result

    # ---- lifecycle ------------------------------------------------------------------------------------
    def start(self, host: str = "127.0.0.1", port: int = 0, drive: bool = True) -> AgentProxy:
        """Serve in a background thread (port 0: a free one) and (``drive``) start driving the engine."""

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise UserError(f"the agent proxy cannot listen on {host}:{port} ({exc.strerror})") from exc
        sock.listen(1024)
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise UserError("the agent proxy did not start within 30 s")
            time.sleep(0.02)
        if drive:
            self.driver.start()
        return self

    def driving(self, between_steps: Any = None) -> Any:
        """Context manager: drive the engine only inside it (training releases the KV cache between rollouts).
        ``between_steps(llm, steps)``: the step-boundary hook of partial rollouts, called by the driver thread
        between its engine steps for the duration of the window (``EngineDriver``)."""

        @contextmanager
        def window():
            self.driver.start(between_steps)
            try:
                yield self
            finally:
                self.driver.stop()

        return window()

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(30)
            self._server = None
        self.driver.stop()
        self.url = None

    def __enter__(self) -> AgentProxy:
        return self.start() if self.url is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- many agents at once --------------------------------------------------------------------------
    def run_agents(
        self,
        agent: Any,
        examples: list[dict[str, Any]],
        n: int = 1,
        seeds: list[int] | None = None,
        timeout: float = 300.0,
        failure_reward: float = 0.0,
        max_parallel: int = 256,
        keep_empty: bool = False,
    ) -> list[Any]:
        """Run ``agent(base_url, example) -> reward | None`` for ``n`` episodes per example, all at once; returns
        every recorded ``Episode`` (one per segment; the episode's reward on each), grouped by example.
        ``keep_empty``: an agent run that made no call (it failed first, or answered without the model) gives one
        ``Episode`` without turns carrying its reward, so every run is counted (training uses this)."""
        jobs = [(g, j) for g in range(len(examples)) for j in range(n)]
        sessions = [
            self.open(f"ep{g}-{j}-{uuid.uuid4().hex[:6]}", g, j, None if seeds is None else int(seeds[g]))
            for g, j in jobs
        ]
        self.failures = {"error": 0, "timeout": 0, "no_reward": 0}
        results: dict[str, tuple[str, Any]] = {}
        gate = threading.Semaphore(max(1, max_parallel))

        def one(sess: AgentSession) -> None:
            with gate:
                try:
                    results[sess.eid] = ("ok", agent(self.base_url(sess.eid), dict(examples[sess.group])))
                except Exception as exc:  # noqa: BLE001 - the user's agent: a counted failure
                    results[sess.eid] = ("error", f"error: {type(exc).__name__}: {exc}"[:300])

        # daemon threads: an agent that hangs past the timeout is abandoned, never waited for (its calls get 404)
        threads = [threading.Thread(target=one, args=(s,), daemon=True, name="polyrl-agent") for s in sessions]
        for t in threads:
            t.start()
        # the timeout leaves out the time the engine stood still for a weight update (partial rollouts: the driver
        # waiting in its between_steps hook for the trainer), which no agent can help
        t0, paused0 = time.monotonic(), self.driver.paused_s
        for t in threads:
            while t.is_alive():
                left = t0 + timeout + self.driver.paused_s - paused0 - time.monotonic()
                if left <= 0:
                    break
                t.join(min(left, 1.0))
        episodes = []
        for sess in sessions:
            self.close(sess.eid)
            kind, value = results.get(sess.eid, ("timeout", None))
            if kind == "timeout":
                sess.failed = f"timeout: the agent did not finish within {timeout:g}s"
            elif kind == "error":
                sess.failed = value
            elif value is not None:
                reward = _returned_reward(value)
                if reward is None:  # the agent's bug: a counted failure, not the run's end
                    kind, sess.failed = (
                        "error",
                        (
                            f"error: the agent returned {value!r:.80} ({type(value).__name__}), not a finite number; "
                            "return the reward as a float, or None after POST <base_url minus /v1>/reward"
                        ),
                    )
                else:
                    sess.set_reward(reward)
            elif sess.reward is None:
                kind = "no_reward"
            if kind != "ok":
                self.failures[kind] += 1
            episodes.extend(sess.episodes(failure_reward, keep_empty))
        return episodes


__all__ = ["AgentProxy", "EngineDriver"]
