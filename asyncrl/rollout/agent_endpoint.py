"""An OpenAI-compatible HTTP endpoint inside a rollout actor, for agents written elsewhere
(rollout/agent_episode.py runs them and stitches their calls into samples).

    agent (openai client) ──POST /episodes/<id>/v1/chat/completions──► AgentEndpoint
        ──► that episode's calls (EpisodeCalls.serve) ──► actor.complete ──► the engine

One server per actor, on the actor's own event loop (aiohttp, already a vLLM dependency), bound to
127.0.0.1 on a free port: agents run in the actor's process, so nothing off the host needs it. Each
episode gets a base URL of its own, `http://127.0.0.1:<port>/episodes/<id>/v1`; a request is routed
by the id in its path, and an unknown or ended episode answers 404. An agent behind an HTTP(S)_PROXY
needs 127.0.0.1 in NO_PROXY (httpx, under the openai client, proxies 127.0.0.1 otherwise).

What is served, in OpenAI's JSON shapes (replies carry id, object, created, model, choices[0] with
`message.content` or `text` and finish_reason "stop"/"length", and usage):
- POST chat/completions (messages; content a string or a list of text parts) and POST completions
  (prompt: one string, or one list of token ids); GET models lists one model.
- Honoured: max_tokens / max_completion_tokens (capped by what is left of the episode's token
  budget), stop (a string or a list; as in OpenAI's API the reply's text ends before it).
- Refused with 400: n > 1, best_of > 1, stream, echo, suffix, tools / functions (a tool call is
  model-specific text: put the tools in the messages and parse the calls from the reply's text),
  content parts other than text.
- Ignored: temperature, top_p, seed, penalties, logprobs, response_format, model, user. Every token
  is sampled with the run's own settings (rollout.temperature, top_p), so the behaviour policy the
  learner corrects for is the run's whatever an agent asks; logprobs go into the sample, not the reply.
- A second call of an episode while one runs: 409 (an episode's calls are sequential). The openai
  client retries 409 and 5xx (max_retries, 2 by default); a retried 409 finds the first call done.
- A client that disconnects cancels its call (handler cancellation), so a request the agent gave up
  on never enters the sample.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

log = logging.getLogger(__name__)

MODEL_NAME = "asyncrl-policy"
MAX_BODY_BYTES = 64 << 20  # aiohttp's default (1 MiB) is short for a long conversation
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 409: "conflict_error", 500: "server_error"}
REFUSED = {"stream": "streaming is not supported", "echo": "echo is not supported",
           "suffix": "suffix is not supported", "tools": "tools are not supported: describe them in the "
           "messages and parse the calls from the reply's text", "functions": "functions are not supported"}


class CallRefused(Exception):
    """A request answered with an OpenAI-shaped error instead of a completion."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class Call:
    """One parsed request: chat (`messages`) or completion (`prompt`)."""

    kind: str
    """"chat" or "completion"."""
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()


@dataclass
class Reply:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


class EpisodeCalls(Protocol):
    async def serve(self, call: Call) -> Reply:
        """Sample one completion for the episode; raise CallRefused to answer an error."""
        ...


def parse_call(kind: str, body: Any) -> Call:
    """A request body as a Call; CallRefused(400) for what is malformed or not supported."""
    if not isinstance(body, dict):
        raise CallRefused(400, "the request body must be a JSON object")
    for key, why in REFUSED.items():
        if body.get(key):
            raise CallRefused(400, why)
    for key in ("n", "best_of"):
        if body.get(key) not in (None, 1):
            raise CallRefused(400, f"{key}={body[key]!r}: one completion per request (send {key}=1)")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise CallRefused(400, f"max_tokens must be a positive integer, got {max_tokens!r}")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise CallRefused(400, f"stop must be a string or a list of non-empty strings, got {stop!r}")
    if kind == "chat":
        return Call(kind, messages=_messages(body.get("messages")), max_tokens=max_tokens, stop=tuple(stop))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if not (isinstance(prompt, str) or isinstance(prompt, list) and prompt
            and all(type(t) is int for t in prompt)):
        raise CallRefused(400, "prompt must be one string or one list of token ids")
    return Call(kind, prompt=prompt, max_tokens=max_tokens, stop=tuple(stop))


def _messages(messages: Any) -> list[dict[str, Any]]:
    """The messages, each content part list joined into its text (what chat templates expect)."""
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise CallRefused(400, "messages must be a non-empty list of objects")
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
                raise CallRefused(400, "only text content parts are supported")
            m = {**m, "content": "".join(str(part.get("text", "")) for part in content)}
        out.append(m)
    return out


def error(status: int, message: str) -> web.Response:
    """OpenAI's error shape, which its client turns into BadRequestError, NotFoundError, ..."""
    return web.json_response({"error": {"message": message, "type": ERROR_TYPES.get(status, "error"),
                                        "param": None, "code": None}}, status=status)


class AgentEndpoint:
    def __init__(self, model: str = MODEL_NAME):
        self.model = model
        self.port: int | None = None
        self._episodes: dict[str, EpisodeCalls] = {}
        self._running: dict[str, asyncio.Task] = {}  # the call each episode is serving
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        """Serve on a free port of 127.0.0.1, on the running loop."""
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        base = "/episodes/{episode}/v1"
        app.add_routes([web.post(f"{base}/chat/completions", self._chat),
                        web.post(f"{base}/completions", self._completion),
                        web.get(f"{base}/models", self._models)])
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(self._runner, sock).start()
        self.port = sock.getsockname()[1]

    def open(self, episode_id: str, calls: EpisodeCalls) -> str:
        """Route `episode_id`'s requests to `calls`; its base URL."""
        if self.port is None:
            raise RuntimeError("the agent endpoint is not started")
        self._episodes[episode_id] = calls
        return f"http://127.0.0.1:{self.port}/episodes/{episode_id}/v1"

    async def end(self, episode_id: str) -> None:
        """Stop serving the episode: later requests get 404, and a call still running is cancelled
        (its tokens never enter the sample) and answered 404."""
        self._episodes.pop(episode_id, None)
        task = self._running.get(episode_id)
        if task is not None:
            task.cancel()
            await asyncio.wait({task})

    async def stop(self) -> None:
        for episode_id in list(self._episodes):
            await self.end(episode_id)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _chat(self, request: web.Request) -> web.Response:
        return await self._serve(request, "chat")

    async def _completion(self, request: web.Request) -> web.Response:
        return await self._serve(request, "completion")

    async def _models(self, request: web.Request) -> web.Response:
        if request.match_info["episode"] not in self._episodes:
            return error(404, f"no running episode {request.match_info['episode']!r}")
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "asyncrl"}]})

    async def _serve(self, request: web.Request, kind: str) -> web.Response:
        episode_id = request.match_info["episode"]
        try:
            body = await request.json()
        except ValueError as e:
            return error(400, f"the request body is not JSON: {e}")
        calls = self._episodes.get(episode_id)  # looked up after the body: the episode may end meanwhile
        if calls is None:
            return error(404, f"no running episode {episode_id!r} (it ended, or the base URL is wrong)")
        if episode_id in self._running:
            return error(409, f"episode {episode_id!r} is already serving a call: its calls are sequential")
        try:
            call = parse_call(kind, body)
        except CallRefused as e:
            return error(e.status, e.message)
        task = asyncio.ensure_future(calls.serve(call))
        self._running[episode_id] = task
        try:
            reply = await task
        except CallRefused as e:
            return error(e.status, e.message)
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # the client went away: nothing to answer
                raise
            return error(404, f"episode {episode_id!r} ended while this call ran")
        except Exception as e:  # a bug in stitching: answer it rather than drop the connection
            log.exception("agent call of episode %s failed", episode_id)
            return error(500, f"{type(e).__name__}: {e}")
        finally:
            if self._running.get(episode_id) is task:
                del self._running[episode_id]
        return web.json_response(self._body(kind, reply))

    def _body(self, kind: str, reply: Reply) -> dict[str, Any]:
        usage = {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
                 "total_tokens": reply.prompt_tokens + reply.completion_tokens}
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": reply.text},
                      "finish_reason": reply.finish_reason, "logprobs": None}
            head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion"}
        else:
            choice = {"index": 0, "text": reply.text, "finish_reason": reply.finish_reason, "logprobs": None}
            head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion"}
        return {**head, "created": int(time.time()), "model": self.model, "choices": [choice], "usage": usage}
