"""AgentRunner: one episode per sample driven by a user's own agent, which talks to the policy
through the OpenAI-compatible endpoint the rollout actor serves (rollout/agent_endpoint.py).

    reward = agent(base_url, metadata)    the agent's calls ──► endpoint ──► CallStitcher.serve
                                              ──► actor.complete (token ids, logprobs, versions)

The agent is `agent(base_url, metadata) -> reward`: a plain function (run on a thread pool of the
runner's own, so an openai.OpenAI client may block in it) or a coroutine function (awaited on the
actor's loop; use openai.AsyncOpenAI). `metadata` is a copy of the prompt record's, plus
`prompt_text` and `prompt_ids` (the run's rendered prompt, for an agent that wants it). The reward
is a float, `(float, info)` (info, made JSON-safe, goes into the episode record; its `tool_calls`
and `tool_errors` ints are counted like an environment's) or None: the run's verifier then scores
the sample as any other (reward.type `episode` reads the returned reward, and scores None as 0).

The sample is the episode's calls stitched into one token sequence, token in, token out:
- Its prompt is the first call's prompt ids (the agent's own rendering; the PromptItem's
  `prompt_ids` only reach the agent as metadata); prompt_id and group_id are the PromptItem's.
- A later call *extends* the episode when its prompt continues what the last stitched call saw:
  its rendered text (a chat call: `apply_chat_template(messages, add_generation_prompt=True)`; a
  completion call: the prompt string) starts with the previous call's text + the reply's text.
  The rest, less the text of the sampled tokens the reply left out (its *tail*: the end-of-turn
  token, a stop string) where the rest starts with it, is encoded alone: observation tokens (loss
  mask 0, logprob 0.0, the version of the model token before them). The engine is then given the
  previous prompt ids + sampled ids + observation ids, never a re-tokenization of the text, so the
  sample is exactly what the engine saw. Comparing text with the previous prompt's text + reply,
  rather than two renderings of the conversation, keeps the template text between the sampled
  end-of-turn token and the next turn (Qwen's "\n" after "<|im_end|>"), and serves completion
  calls alike. Failing the text test (a prompt of token ids, a template that renders history
  unlike its generation prompt), the call's full encoding extends the episode if it begins with
  the ids so far.
- A call that does not extend the episode (the agent edited or dropped history, or a side call:
  a summary, a judge) is still served, from its own encoding, so the agent keeps working, but it is
  not in the sample: it counts in the episode record's `unstitched_calls`. A later call that
  extends the stitched sequence is stitched again.
- Every model token keeps the logprob and version `actor.complete` gave it (aborted and resumed
  across in-flight weight updates like any completion).

The budget: rollout.max_tokens bounds the sample's response (model and observation tokens) plus
the tokens unstitched calls sampled. A call's max_tokens is cut to what is left; a call with nothing
left is refused with a 400 saying so (the agent should end). With `max_model_len` (the engine's),
a call is also cut to the model's context, and a prompt that does not fit is refused with a 400;
without it such a prompt fails the engine, and the actor with it. The sample's finish_reason is
"stop" when the agent returned, its last stitched call stopped and no call ran out of budget; else
"length" (truncated).

Limits: the chat template must render a conversation's history as the prefix it rendered when that
history was the prompt (templates that rewrite earlier turns, e.g. dropping past reasoning, leave
every later call unstitched); an observation is encoded on its own, so tokens may split at its
edges unlike a full encoding of the conversation (the engine and the learner both get the stitched
ids, so training stays consistent); a tail the agent's next prompt leaves out (a stop string that
chat messages drop, an end-of-sequence token a completion agent never saw) stays in the sample as
sampled, so the model's context there is its own tokens, not the agent's text exactly; a retry of
a call, or any call on a branch the agent forked, is unstitched.

An agent that runs out of the episode's budget ends its episode as `truncated` (as an environment
that reaches rollout.max_tokens does), whether it returns or raises on the 400 it gets. An agent
that otherwise raises, times out (`episode_timeout_s` of its own time: from when it starts, less
the time its calls spent in the engine, which a busy engine stretches and the stall watch guards) or returns
something that is not a reward ends its own episode exactly as a failing environment step does
(rollout/episode.py): the sample keeps its stitched calls, its episode record's status is `failed`
and its `error` holds the error's last line. A thread-run agent that times out keeps its thread
until it returns (its later calls get 404). An engine failure is raised from `run`, as the actor's
own requests raise it.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import math
import numbers
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from asyncrl.rollout.agent_endpoint import MODEL_NAME, AgentEndpoint, Call, CallRefused, Reply
from asyncrl.rollout.engine import SamplingSpec
from asyncrl.rollout.episode import Completer, episode_sample
from asyncrl.types import EpisodeRecord, EpisodeStatus, PromptItem, Sample

AGENT_THREADS = 256  # a thread-run agent holds one for its whole episode
LONG_EPISODE_S = 60.0  # an agent episode running longer is named when a run stalls
MIN_WAIT_S = 0.05  # how often the agent's time left is read again while a call holds it still


class ChatTokenizer(Protocol):
    def __len__(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any: ...


class AgentFailed(Exception):
    """An agent that raised, timed out or returned something that is not a reward."""


@dataclass(frozen=True)
class LastCall:
    """What the last stitched call's successor must start with."""

    text: str | None
    """The call's rendered prompt text (None: it was given token ids)."""
    reply: str
    tail: str | None
    """The sampled tokens' text past the reply's (end-of-turn token, stop string); None: unknown."""


@dataclass(frozen=True)
class Stitched:
    """An episode's sample so far: the calls that extend it, stitched into its token columns
    (model tokens with their logprobs and versions; observation tokens masked out). `extend` and
    `stitch` are pure: they read a record and return a new one."""

    prompt_ids: list[int] | None = None  # the first call's; None before it
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    spans: list[list[Any]] = field(default_factory=list)  # [start, end, "model" | "env"]
    last: LastCall | None = None
    finish_reason: str = "length"  # the last stitched call's

    @property
    def turns(self) -> int:
        return sum(1 for span in self.spans if span[2] == "model")

    @property
    def observation_tokens(self) -> int:
        return sum(end - start for start, end, kind in self.spans if kind == "env")


def extend(sofar: Stitched, text: str | None, given: list[int] | None,
           encode: Callable[[str], list[int]]) -> tuple[list[int], list[int] | None]:
    """A call's prompt (its rendered `text`, or the ids it was `given`) against the episode so far:
    the ids the engine is given, and the observation ids when the call extends the episode ([] for
    its first call; None: it does not). The rule is the module docstring's."""
    if sofar.prompt_ids is None:
        return given if given is not None else encode(text or ""), []
    context, last = sofar.prompt_ids + sofar.tokens, sofar.last
    if text is not None and last is not None and last.text is not None \
            and text.startswith(head := last.text + last.reply):
        rest, tail = text[len(head):], last.tail or ""
        if rest.startswith(tail):  # already in the sample, as the model sampled it
            obs = encode(rest[len(tail):])
            return context + obs, obs
        if rest:  # the agent's history leaves the tail out (an empty reply's too): it stays in the sample
            obs = encode(rest)
            return context + obs, obs
        # Else nothing follows the reply, as in a retry of the call: the ids test below decides.
    full = given if given is not None else encode(text or "")
    return full, full[len(context):] if full[:len(context)] == context else None


def stitch(sofar: Stitched, ids: list[int], obs: list[int], out: list[int], lps: list[float], vers: list[int],
           last: LastCall, finish_reason: str, version: int) -> Stitched:
    """`sofar` with a call that extends it: `ids` its prompt (the first call's becomes the sample's
    prompt), `obs` the observation before it (each token at the version of the model token before
    it, or `version` for none), `out` the sampled tokens with their logprobs and versions."""
    if sofar.prompt_ids is None:
        sofar, obs = replace(sofar, prompt_ids=list(ids)), []
    start, spans = len(sofar.tokens), list(sofar.spans)
    if obs:
        spans.append([start, start + len(obs), "env"])
    spans.append([start + len(obs), start + len(obs) + len(out), "model"])
    obs_version = sofar.versions[-1] if sofar.versions else version
    return replace(sofar, tokens=sofar.tokens + obs + list(out), logprobs=sofar.logprobs + [0.0] * len(obs) + list(lps),
                   versions=sofar.versions + [obs_version] * len(obs) + list(vers),
                   mask=sofar.mask + [0] * len(obs) + [1] * len(out), spans=spans, last=last,
                   finish_reason=finish_reason)


@dataclass
class CallLog:
    """What an episode's calls did besides the sample: served, left out of it, the engine's time
    and failure. `failed` is set by an engine failure: the episode ends at once."""

    calls: int = 0
    unstitched: int = 0
    unstitched_tokens: int = 0
    out_of_budget: bool = False
    engine_s: float = 0.0
    engine_error: BaseException | None = None
    failed: asyncio.Event = field(default_factory=asyncio.Event)
    calling_since: float | None = None
    """When the call now in the engine began (an episode's calls are sequential, agent_endpoint.py)."""

    def call_started(self, now: float) -> None:
        self.calling_since = now

    def call_ended(self, now: float) -> None:
        self.engine_s += now - self.calling_since
        self.calling_since = None

    def agent_s(self, since: float, now: float) -> float:
        """The agent's own time from `since` to `now`: the time none of its calls was in the engine."""
        in_engine = self.engine_s + (now - self.calling_since if self.calling_since is not None else 0.0)
        return now - since - in_engine


class CallStitcher:
    """One episode's calls: serves each through `actor.complete`, stitches those that extend the
    episode (`extend`, `stitch`) and logs them all (`CallLog`)."""

    def __init__(self, actor: Completer, tokenizer: ChatTokenizer, base: SamplingSpec, name: str,
                 abortable: bool, max_call_tokens: int | None = None, max_model_len: int | None = None):
        self.actor, self.tokenizer, self.base, self.name, self.abortable = actor, tokenizer, base, name, abortable
        self.max_call_tokens, self.max_model_len = max_call_tokens, max_model_len
        self.sample, self.log = Stitched(), CallLog()

    async def serve(self, call: Call) -> Reply:
        text, given = self._render(call)
        ids, obs = extend(self.sample, text, given, self._encode)
        max_tokens = self._max_tokens(call, len(ids), len(obs or ()))
        spec = replace(self.base, max_tokens=max_tokens, stop=call.stop)
        log = self.log
        log.calls += 1  # before the call: an engine request id is never reused
        log.call_started(time.monotonic())
        try:
            out, lps, vers, reason = await self.actor.complete(ids, spec, f"{self.name}-c{log.calls}", self.abortable)
        except Exception as e:  # the engine failed: the actor must learn it, not the agent alone
            log.engine_error = e
            log.failed.set()
            raise CallRefused(500, f"the engine failed: {e!r:.300}") from e
        finally:
            log.call_ended(time.monotonic())
        reply, tail = self._reply(out, reason, call.stop)
        if obs is None:
            log.unstitched += 1
            log.unstitched_tokens += len(out)
        else:
            self.sample = stitch(self.sample, ids, obs, out, lps, vers, LastCall(text, reply, tail), reason,
                                 self.actor.version)
        return Reply(reply, reason, len(ids), len(out))

    def _render(self, call: Call) -> tuple[str | None, list[int] | None]:
        """The call's prompt as text, or as ids when it was given ids."""
        if call.messages is not None:
            try:
                return self.tokenizer.apply_chat_template(call.messages, add_generation_prompt=True,
                                                          tokenize=False), None
            except Exception as e:  # a template that rejects these messages (roles, order)
                raise CallRefused(400, f"the chat template cannot render these messages: {e}") from e
        if isinstance(call.prompt, str):
            return call.prompt, None
        vocab = len(self.tokenizer)  # an id past it would fail the engine, and with it the actor
        if not all(0 <= t < vocab for t in call.prompt):
            raise CallRefused(400, f"prompt token ids must be below the vocabulary size {vocab}")
        return None, list(call.prompt)

    def _max_tokens(self, call: Call, prompt_len: int, obs_len: int) -> int:
        if prompt_len == 0:  # the engine would fail on it, and with it the actor
            raise CallRefused(400, "the prompt is empty")
        left = self.base.max_tokens - len(self.sample.tokens) - obs_len - self.log.unstitched_tokens
        if left <= 0:
            self.log.out_of_budget = True
            raise CallRefused(400, f"this episode's token budget (rollout.max_tokens={self.base.max_tokens}, "
                                   f"model and observation tokens) is used up: end the episode")
        if self.max_model_len is not None:
            room = self.max_model_len - prompt_len
            if room <= 0:
                raise CallRefused(400, f"a prompt of {prompt_len} tokens leaves no room in the model's "
                                       f"context ({self.max_model_len} tokens)")
            left = min(left, room)
        return min(left, call.max_tokens or left, self.max_call_tokens or left)

    def _reply(self, out: list[int], reason: str, stop: tuple[str, ...]) -> tuple[str, str | None]:
        """The reply's text (special tokens and a stop string left out, as OpenAI's API does) and
        the rest of the sampled tokens' text."""
        text = self.tokenizer.decode(out, skip_special_tokens=True)
        cuts = [i for s in stop if (i := text.find(s)) >= 0] if reason == "stop" else []
        text = text[:min(cuts)] if cuts else text
        full = self.tokenizer.decode(out, skip_special_tokens=False)
        return text, full[len(text):] if full.startswith(text) else None

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def episode_record(self, env: str) -> EpisodeRecord:
        """What EpisodeRunner records, and the calls served and left out of the sample."""
        return EpisodeRecord(env, turns=self.sample.turns, calls=self.log.calls, unstitched_calls=self.log.unstitched,
                             observation_tokens=self.sample.observation_tokens, spans=self.sample.spans)


class AgentRunner:
    """EpisodeRunner's interface (`run`, `close`) for agents; one endpoint per actor, started on
    the actor's loop by `start` (or the first `run`) and stopped by `aclose` (or `close`)."""

    def __init__(self, agent: Callable[..., Any], tokenizer: ChatTokenizer, episode_timeout_s: float = 120.0,
                 max_call_tokens: int | None = None, max_model_len: int | None = None,
                 num_threads: int = AGENT_THREADS, model_name: str = MODEL_NAME, name: str | None = None):
        self.agent, self.tokenizer, self.episode_timeout_s = agent, tokenizer, episode_timeout_s
        self.max_call_tokens, self.max_model_len = max_call_tokens, max_model_len
        self.name = name or f"agent:{getattr(agent, '__module__', '?')}:{getattr(agent, '__qualname__', '?')}"
        self.endpoint = AgentEndpoint(model_name)
        self._threads = ThreadPoolExecutor(num_threads, thread_name_prefix="agent")
        self._starting = asyncio.Lock()
        self._running: dict[str, float] = {}  # episode id -> when its agent started
        self._stopping: asyncio.Task | None = None

    async def start(self) -> None:
        async with self._starting:
            if self.endpoint.port is None:
                await self.endpoint.start()

    async def run(self, actor: Completer, p: PromptItem, index: int, base: SamplingSpec, name: str,
                  abortable: bool = True) -> Sample:
        await self.start()
        calls = CallStitcher(actor, self.tokenizer, base, name, abortable, self.max_call_tokens, self.max_model_len)
        episode_id = f"{name}-{secrets.token_hex(4)}"  # a timed-out agent's late calls never reach a new episode
        url = self.endpoint.open(episode_id, calls)
        failure: BaseException | None = None
        reward, info = None, {}
        t0 = self._running[episode_id] = time.monotonic()
        try:
            result = await self._agent(url, self._metadata(p), calls.log)
            if calls.log.engine_error is None:
                reward, info = agent_reward(result)
                if calls.log.calls == 0:
                    raise AgentFailed() from RuntimeError("no call of the agent reached the model "
                                                          "(none made, or all refused)")
        except AgentFailed as e:
            failure = e.__cause__ or e
        finally:
            del self._running[episode_id]
            await self.endpoint.end(episode_id)
        if calls.log.engine_error is not None:
            raise calls.log.engine_error
        record, sample = calls.episode_record(self.name), calls.sample
        record.env_s = calls.log.agent_s(t0, time.monotonic())
        ended = failure is None and not calls.log.out_of_budget and sample.finish_reason == "stop"
        if failure is not None and not calls.log.out_of_budget:
            record.fail(failure)
        else:  # it returned, or stopped because its budget ran out (its 400): truncated, not an error
            record.reward, record.info = reward, info
            record.status = EpisodeStatus.DONE if ended else EpisodeStatus.TRUNCATED
            record.tool_calls, record.tool_errors = (int(info[k]) if isinstance(info.get(k), numbers.Real) else 0
                                                     for k in ("tool_calls", "tool_errors"))
        return episode_sample(p, index, actor.actor_id, base.temperature, sample.prompt_ids or p.prompt_ids,
                              sample.tokens, sample.logprobs, sample.versions, sample.mask,
                              "stop" if ended else "length", record)

    def stuck(self) -> str | None:
        now = time.monotonic()
        n = sum(1 for t0 in self._running.values() if now - t0 > LONG_EPISODE_S)
        return (f"{n} agent episode(s) running for over {LONG_EPISODE_S:g}s (env.episode_timeout_s="
                f"{self.episode_timeout_s:g}s): the agent may hang or wait on something") if n else None

    def _metadata(self, p: PromptItem) -> dict[str, Any]:
        """The agent's own copy of the record (it may change it), with the run's prompt."""
        return {**copy.deepcopy(p.metadata), "prompt_ids": list(p.prompt_ids),
                "prompt_text": self.tokenizer.decode(list(p.prompt_ids), skip_special_tokens=False)}

    async def _agent(self, url: str, metadata: dict[str, Any], log: CallLog) -> Any:
        """The agent's return value; AgentFailed when it raised or ran out of its own time (the time
        none of its calls is in the engine: a busy engine is not the agent's fault); None at once
        when the engine failed."""
        loop = asyncio.get_running_loop()
        started = asyncio.Event()
        if inspect.iscoroutinefunction(self.agent) or inspect.iscoroutinefunction(getattr(self.agent, "__call__", 0)):
            started.set()
            work = asyncio.ensure_future(self.agent(url, metadata))
        else:
            def call() -> Any:
                loop.call_soon_threadsafe(started.set)  # the timeout counts from here, not from the queue
                return self.agent(url, metadata)

            work = loop.run_in_executor(self._threads, call)
        waits = [asyncio.ensure_future(started.wait()), asyncio.ensure_future(log.failed.wait())]
        done: set[asyncio.Future] = set()
        try:
            await asyncio.wait({work, waits[0]}, return_when=asyncio.FIRST_COMPLETED)
            since = time.monotonic()
            # wait out the agent's time left; while a call is in the engine it does not run down
            while not done and (left := self.episode_timeout_s - log.agent_s(since, time.monotonic())) > 0:
                done, _ = await asyncio.wait({work, waits[1]}, timeout=max(left, MIN_WAIT_S),
                                             return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            if not work.done():
                work.cancel()  # a coroutine agent ends here; a thread keeps running until it returns
        if log.failed.is_set():
            return None
        if work not in done:
            raise AgentFailed() from TimeoutError(
                f"the agent ran past env.episode_timeout_s={self.episode_timeout_s:g}s of its own time (its calls' "
                "time in the engine not counted)")
        if work.cancelled():
            raise AgentFailed() from asyncio.CancelledError("the agent was cancelled")
        if work.exception() is not None:
            raise AgentFailed() from work.exception()
        return work.result()

    async def aclose(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        await self.endpoint.stop()

    def close(self) -> None:
        """From the actor's shutdown (sync, on its loop): the server stops in a task of that loop."""
        self._threads.shutdown(wait=False, cancel_futures=True)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop: the server went with the one it ran on
        self._stopping = loop.create_task(self.endpoint.stop())


def agent_reward(result: Any) -> tuple[float | None, dict[str, Any]]:
    """An agent's return value as (reward, info); AgentFailed when it is not a reward."""
    reward, info = result if isinstance(result, tuple) and len(result) == 2 else (result, {})
    if not isinstance(info, dict) or not (reward is None or isinstance(reward, numbers.Real)):
        raise AgentFailed() from TypeError(f"the agent returned {str(result)[:200]}, not a float, None "
                                           f"or (float, dict)")
    if reward is not None and not math.isfinite(reward):
        raise AgentFailed() from ValueError(f"the agent returned a reward of {reward}")
    # The record travels with the sample (msgpack): keep only what JSON keeps.
    return None if reward is None else float(reward), json.loads(json.dumps(info, default=str))
