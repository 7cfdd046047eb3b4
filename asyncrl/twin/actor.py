"""A simulated rollout actor: what rollout/actor.py's RolloutActor does with its engine, on the
twin's clock. A prompt becomes n requests; a finished one leaves as a real `Sample` in a real
frame (transport/codec.py), scored by the driver's pool (twin/rewards.py) or, with
reward.placement actor, by the actor; a weight update
closes the gate to new requests and gets the engine idle by its sync mode:

- drain: the running requests finish (the engine idles for the longest of them);
- inflight: they are aborted at the end of the engine's step, keep their tokens (each tagged with
  the version that generated it) and resume after the load as requests whose context is the
  prompt plus that prefix (prefilled again: the prefix cache is reset by a load);
- inflight with keep_kv (sync.keep_kv): the engine pauses at the end of its step with every
  request and its KV cache in place and decodes on after the load, no prefill; the tokens after
  the load carry the new version.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from asyncrl.rollout.engine import SamplingSpec
from asyncrl.transport.codec import encode_samples
from asyncrl.twin.engine import Request, SimEngine
from asyncrl.twin.rewards import score
from asyncrl.twin.workload import Lengths, PassRates
from asyncrl.types import PromptItem, Sample

TOKEN = array("i", [5])  # every response token: the twin decides lengths and rewards, never text
LOGPROB = array("f", [-1.0])


@dataclass
class _Draw:
    """One sample in the making."""

    prompt: PromptItem
    index: int
    length: int
    max_tokens: int
    temperature: float
    runs: list[tuple[int, int]] = field(default_factory=list)
    """(version, tokens) of each request it took (more than one after in-flight updates)."""
    version: int = 0
    """Version of its current request."""


class SimActor:
    def __init__(self, actor_id: int, engine: SimEngine, sync_mode: str, prompt_tokens: int,
                 lengths: Lengths, rewards: PassRates, deliver: Callable[[bytes, int, float], None],
                 scored: bool = False, keep_kv: bool = False):
        self.actor_id, self.engine, self.sync_mode, self.prompt_tokens = actor_id, engine, sync_mode, prompt_tokens
        self.keep_kv = keep_kv and sync_mode == "inflight"
        self._kept: list[Request] = []  # paused in the engine for a load (keep_kv)
        self.lengths, self.rewards, self.deliver, self.scored = lengths, rewards, deliver, scored
        self.version = 0
        self.gate_open = True
        self._held: list[Request] = []  # submitted while the gate was closed
        self._ready: Callable[[float], None] | None = None
        self.generated_samples = self.generated_tokens = self.resumed = self.aborted = 0
        engine.on_finished, engine.on_idle = self._finished, self._idle

    def submit(self, prompts: list[PromptItem], spec: SamplingSpec, group_size: int, t: float) -> None:
        requests = []
        for p in prompts:
            for i in range(group_size):
                d = _Draw(p, i, self.lengths.draw(p.prompt_id, i), spec.max_tokens, spec.temperature)
                d.length = min(d.length, spec.max_tokens)
                requests.append(Request(self.prompt_tokens, d.length, d))
        if self.gate_open:
            self._start(requests, t)
        else:
            self._held += requests

    def _start(self, requests: list[Request], t: float) -> None:
        for r in requests:
            r.owner.version = self.version
        self.engine.submit(requests, t)

    def _finished(self, requests: list[Request], t: float) -> None:
        samples = []
        for r in requests:
            d: _Draw = r.owner
            d.runs.append((d.version, r.generated))
            versions = array("i")
            for v, n in d.runs:
                versions += array("i", [v]) * n
            s = Sample(d.prompt.prompt_id, d.prompt.prompt_id, d.index, d.prompt.prompt_ids, TOKEN * d.length,
                       LOGPROB * d.length, versions, "length" if d.length >= d.max_tokens else "stop", self.actor_id,
                       d.prompt.metadata, d.temperature)
            if self.scored:  # reward.placement actor: the actor's verifier, beside the engine
                s.reward, s.reward_info = score(self.rewards, s)
            samples.append(s)
            self.generated_samples += 1
            self.generated_tokens += d.length
        self.deliver(encode_samples(samples), len(samples), t)

    # -- weight updates -----------------------------------------------------------------------

    def begin_update(self, t: float, ready: Callable[[float], None]) -> None:
        """Close the gate and get the engine idle; `ready(t)` once it is (the load can start)."""
        self.gate_open, self._ready = False, ready
        if self.keep_kv and not self.engine.empty:
            self.engine.pause(t, self._paused)
        elif self.sync_mode == "inflight" and not self.engine.empty:
            self.engine.abort(t, self._aborted)
        elif self.engine.empty:
            self._idle(t)
        # drain: the engine calls _idle when its last request finishes

    def _aborted(self, requests: list[Request], t: float) -> None:
        resumed = []
        for r in requests:
            d: _Draw = r.owner
            if r.generated:
                d.runs.append((d.version, r.generated))
                self.resumed += 1
            self.aborted += 1
            resumed.append(Request(r.context, r.remaining, d, resumed=True))  # from its prefix, after the load
        self._held[:0] = resumed  # ahead of anything submitted since: they are older
        self._idle(t)

    def _paused(self, requests: list[Request], t: float) -> None:
        for r in requests:  # the tokens so far are the old version's; the rest the new one's
            d: _Draw = r.owner
            if r.generated:
                d.runs.append((d.version, r.generated))
                r.generated = 0
        self._kept = requests
        ready, self._ready = self._ready, None
        ready(t)

    def _idle(self, t: float) -> None:
        if self._ready is not None and not self.gate_open and self.engine.empty:
            ready, self._ready = self._ready, None
            ready(t)

    def end_update(self, version: int, t: float) -> None:
        """The new weights are loaded: reopen, resume what was aborted, start what was held."""
        self.version, self.gate_open = version, True
        kept, self._kept = self._kept, []
        for r in kept:
            r.owner.version = version
        if kept:
            self.engine.resume(t)
        held, self._held = self._held, []
        if held:
            self._start(held, t)
