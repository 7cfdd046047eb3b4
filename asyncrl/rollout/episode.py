"""EpisodeRunner: one multi-turn episode per sample, inside a rollout actor (asyncrl/env/base.py).

    context = prompt
    repeat: model turn = actor.complete(context, stop = the environment's)   loss mask 1
            step = env.step(turn)              (a worker thread, or awaited; env.step_timeout_s)
            observation tokens                                                 loss mask 0
            context = prompt + response so far
    until the step is done, env.max_turns, or the response reaches rollout.max_tokens

Each model turn is an ordinary completion of the actor's (`RolloutActor.complete`), so an in-flight
weight update aborts and resumes it like any other request, and every model token keeps the
version and behaviour logprob of the policy that sampled it: an episode that straddles an update
carries both versions, and the learner trains each turn against its own policy. An observation
token carries logprob 0.0 (never read: its loss mask is 0) and the version of the model token
before it, so versions never decrease along the response and the staleness bound, applied per
token, judges observations as their turn.

Each sample carries its episode's record (`Sample.episode`, types.EpisodeRecord): the status, the
reward the steps gave, counters, and the span of every turn. A step that raises, times out or
answers something other than a `Step` ends its own episode: the sample keeps what was generated,
the record's status is `failed` and its `error` holds the error's last line (and `traceback`), and
the reward router scores it 0 with outcome `env_error` (reward/registry.py), which
the driver reports and counts against env.max_error_frac. The engine and the other episodes go
on: steps run on worker threads of their own (step_threads.py: a step that hangs past its timeout
is written off with its thread, and fresh threads take the other steps, however many hang), or on
the loop when `step` is a coroutine function.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import time
from dataclasses import replace
from typing import Any, Protocol

from asyncrl.config.env_section import EnvConfig
from asyncrl.env.base import EnvFactory, Step, Turn
from asyncrl.env.registry import stop_strings
from asyncrl.rollout.engine import SamplingSpec
from asyncrl.rollout.step_threads import StepThreads
from asyncrl.types import EpisodeRecord, EpisodeStatus, PromptItem, Sample

class Tokenizer(Protocol):
    def __len__(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class Completer(Protocol):
    """What an episode needs of its rollout actor (`RolloutActor` is one): one completion at a
    time, abortable and resumed across in-flight updates, and whose samples they are."""

    actor_id: int
    version: int  # the weights' version now: an observation before any model token takes it

    async def complete(self, prompt_ids: list[int], base: SamplingSpec, name: str,
                       abortable: bool = True) -> tuple[list[int], list[float], list[int], str]:
        """Tokens, logprobs, versions and finish reason of one completion of prompt_ids."""
        ...


class Episodes(Protocol):
    """What a rollout actor runs one episode per sample with: `EpisodeRunner` (an environment) or
    `AgentRunner` (rollout/agent_episode.py: the user's agent through an OpenAI-compatible endpoint)."""

    async def run(self, actor: Completer, p: PromptItem, index: int, base: SamplingSpec, name: str,
                  abortable: bool = True) -> Sample: ...

    def stuck(self) -> str | None:
        """What holds episodes up now, in words, for a stalled run's diagnosis (None: nothing)."""
        ...

    def close(self) -> None: ...


def episode_sample(p: PromptItem, index: int, actor_id: int, temperature: float, prompt_ids: list[int],
                   tokens: list[int], logprobs: list[float], versions: list[int], mask: list[int], reason: str,
                   record: EpisodeRecord) -> Sample:
    """An episode's one sample (an environment's or an agent's): its response is every token of the
    episode, the model's (mask 1) and the observations (mask 0), and it carries the record."""
    return Sample(prompt_id=p.prompt_id, group_id=p.prompt_id, sample_index=index, prompt_ids=prompt_ids,
                  response_ids=tokens, logprobs=logprobs, versions=versions, finish_reason=reason, actor_id=actor_id,
                  loss_mask=mask if 0 in mask else [], metadata=p.metadata, temperature=temperature, episode=record)


class EnvStepFailed(Exception):
    """An environment step that raised, timed out or broke the protocol (ends its episode)."""


class EpisodeRunner:
    def __init__(self, cfg: EnvConfig, factory: EnvFactory, tokenizer: Tokenizer):
        self.cfg, self.factory, self.tokenizer = cfg, factory, tokenizer
        self.threads = StepThreads()

    async def run(self, actor: Completer, p: PromptItem, index: int, base: SamplingSpec, name: str,
                  abortable: bool = True) -> Sample:
        cfg = self.cfg
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        mask: list[int] = []
        record = EpisodeRecord(cfg.type)
        reason = "length"
        try:
            env = self.factory(p.metadata, **cfg.options)
            spec = replace(base, stop=stop_strings(cfg, env))
        except Exception as e:  # a factory that fails on this record costs this episode
            env, spec = None, base
            record.fail(e)
        for turn in range(cfg.max_turns if env is not None else 0):
            left = base.max_tokens - len(tokens)
            if left <= 0:
                break
            turn_spec = replace(spec, max_tokens=min(left, cfg.max_turn_tokens or left))
            ids, lps, vers, reason = await actor.complete(p.prompt_ids + tokens, turn_spec, f"{name}-t{turn}", abortable)
            text, cut = self._turn_text(ids, turn_spec.stop)
            if cut < len(ids):  # what the engine sampled past the stop string is never used
                ids, lps, vers, reason = ids[:cut], lps[:cut], vers[:cut], "stop"
            record.spans.append([len(tokens), len(tokens) + len(ids), "model"])
            tokens += ids
            logprobs += lps
            versions += vers
            mask += [1] * len(ids)
            record.turns += 1
            if len(tokens) >= base.max_tokens:
                reason = "length"
                break
            try:
                step = await self._step(env, Turn(turn, text, list(ids), reason), record)
                obs = [] if step.done else self._observation(step.observation)[:base.max_tokens - len(tokens)]
            except EnvStepFailed as e:
                record.fail(e.__cause__ or e)
                break
            if step.done:
                reason, record.status = "stop", EpisodeStatus.DONE
                break
            record.spans.append([len(tokens), len(tokens) + len(obs), "env"])
            record.observation_tokens += len(obs)
            tokens += obs
            logprobs += [0.0] * len(obs)
            versions += [versions[-1] if versions else actor.version] * len(obs)
            mask += [0] * len(obs)
            reason = "length"  # an episode that ends here (turns or tokens used up) is truncated
        return episode_sample(p, index, actor.actor_id, base.temperature, p.prompt_ids, tokens, logprobs, versions,
                              mask, reason, record)

    def _turn_text(self, ids: list[int], stop: tuple[str, ...]) -> tuple[str, int]:
        """The turn's text, and how many of its tokens make the turn: all, unless a stop string
        ends before the last token. That happens when an in-flight update aborted the turn in the
        middle of a stop string: the engine matches stop strings in a request's own output, so the
        resumed request ran past it. The turn then ends at the first token that completes one."""
        # special tokens left out, as the engine's own stop-string check leaves them out
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        ends = [i + len(s) for s in stop if (i := text.find(s)) >= 0]
        if not ends or min(ends) >= len(text) or len(ids) <= 1:
            return text, len(ids)
        for k in range(1, len(ids)):
            head = self.tokenizer.decode(ids[:k], skip_special_tokens=True)
            if any(s in head for s in stop):
                return head, k
        return text, len(ids)

    async def _step(self, env: Any, turn: Turn, record: EpisodeRecord) -> Step:
        """env.step(turn) within env.step_timeout_s; its reward and counters go into `record`."""
        t0 = time.monotonic()
        try:
            if inspect.iscoroutinefunction(env.step):
                step = await asyncio.wait_for(env.step(turn), self.cfg.step_timeout_s)
            else:
                step = await self.threads.run(env.step, turn, self.cfg.step_timeout_s)
        except asyncio.TimeoutError:
            raise EnvStepFailed() from TimeoutError(f"env.step took longer than env.step_timeout_s="
                                                    f"{self.cfg.step_timeout_s:g}")
        except Exception as e:
            raise EnvStepFailed() from e
        finally:
            record.env_s += time.monotonic() - t0
        if not isinstance(step, Step):
            raise EnvStepFailed() from TypeError(f"env.step returned {type(step).__name__}, not a Step")
        if step.reward is not None:
            # the environment's fault, not the verifier's: scored as an env error, not a reward error
            if not isinstance(step.reward, numbers.Real) or not math.isfinite(step.reward):
                raise EnvStepFailed() from ValueError(f"env.step returned a reward of {step.reward!r}, not a "
                                                      f"finite number")
            record.reward = (record.reward or 0.0) + float(step.reward)
        record.tool_calls += int(step.info.get("tool_calls", 0))
        record.tool_errors += int(step.info.get("tool_errors", 0))
        return step

    def _observation(self, obs: str | list[int]) -> list[int]:
        if isinstance(obs, str):
            return list(self.tokenizer.encode(obs, add_special_tokens=False)) if obs else []
        vocab = len(self.tokenizer)  # an id past it would fail the engine, and with it the actor
        if not isinstance(obs, list) or not all(type(t) is int and 0 <= t < vocab for t in obs):
            raise EnvStepFailed() from TypeError(f"an observation must be text or a list of token ids "
                                                 f"below {vocab}, got {str(obs)[:100]}")
        return obs

    def stuck(self) -> str | None:
        n = self.threads.hung
        return (f"{n} environment step(s) still running past env.step_timeout_s={self.cfg.step_timeout_s:g}s "
                f"(their episodes ended as env errors; the steps hang)") if n else None

    def close(self) -> None:
        self.threads.close()
