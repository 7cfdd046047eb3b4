"""Held-out evaluation during training: avg@n and pass@k of the policy the actors hold.

At step 0, every `eval.every_steps` steps (right after the push that brings the actors that
version) and at the end, one rollout actor gets every eval prompt n times (`RolloutActor.evaluate`).
The requests run in the same engine beside the training ones, so training is not stopped; the
next push waits for them like for any request in flight (the only stall, the eval's generation
time, and it lets every eval sample see one version). Their samples come back over Ray, not into
the buffer; the reward pool scores them like training samples (same verifiers and timeouts) under
an `EvalKey`, and once all are scored the metrics (algo/pass_at_k.py) go into the next step row
as `eval/avg@<n>`, `eval/pass@<k>`, with `eval/step` the version that was evaluated.

One evaluation runs at a time: one that is due while another runs is skipped. An actor lost (or
an engine failing) during an evaluation loses that evaluation (an `eval_lost` event), not the run.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from asyncrl.algo.pass_at_k import eval_metrics
from asyncrl.config import Config
from asyncrl.data.build import BUILTIN_TASKS, load_records
from asyncrl.data.prompt_source import PromptSource
from asyncrl.data.stages import ResolvedStage, resolve_stages
from asyncrl.observe.metrics import EventLog, Say
from asyncrl.reward.episode_reward import verifier_metadata
from asyncrl.reward.registry import route
from asyncrl.rollout.engine import SamplingSpec
from asyncrl.types import ActorCallFailed, EpisodeRecord, PromptItem, as_list

if TYPE_CHECKING:  # the pool runs Ray; evaluation only asks it for a call
    from asyncrl.orchestrator.actor_pool import ActorPool
    from asyncrl.reward.pool import RewardPool


@dataclass
class EvalKey:
    """The reward pool key of an eval sample (training samples use the Sample itself); the
    version evaluated is the evaluator's, one for all (see the module docstring)."""

    prompt_index: int
    response_len: int
    response: str
    metadata: dict[str, Any]
    episode: EpisodeRecord | None = None


def eval_records(cfg: Config) -> list[dict[str, Any]] | None:
    """The held-out records of this run (None: it has none, so no evaluation)."""
    if not cfg.eval.every_steps:
        return None
    verifier_of = functools.partial(route, cfg.reward)
    if cfg.eval.data:
        records = load_records(cfg.data, verifier_of, path=cfg.eval.data)
    elif cfg.data.type in BUILTIN_TASKS:
        records = load_records(cfg.data, split="eval")
    else:
        return None
    return records[:cfg.eval.max_prompts]


class Evaluator:
    """`items` None: the run has no held-out data and nothing is ever started. `metrics` gets
    an `eval` event per completed evaluation and `eval_lost` for one whose actor died."""

    def __init__(self, cfg: Config, items: list[PromptItem] | None, metrics: EventLog, say: Say = print):
        if items is not None and not items:
            raise ValueError("no eval prompt fits the context (each is longer than max_model_len - max_tokens)")
        self.cfg, self.items, self.metrics, self.say = cfg.eval, items, metrics, say
        self.top_p = cfg.rollout.top_p
        self.ks = cfg.eval.pass_k or [cfg.eval.n]
        self.done: set[int] = set()  # versions evaluated (or started)
        self._call, self._version, self._t0 = None, None, 0.0
        self._rewards: dict[int, list[float]] = {}
        self._lengths: list[int] = []
        self._expected = 0
        self._tools: list[tuple[bool, bool]] = []  # an episode's (called a tool, solved with tools)
        self._ready: dict[str, float] = {}

    @classmethod
    def build(cls, cfg: Config, tokenizer: Any, metrics: EventLog, say: Say = print) -> Evaluator:
        records = eval_records(cfg)
        if records is None:
            if cfg.eval.every_steps:
                say("no held-out evaluation: the data is jsonl and eval.data is not set")
            return cls(cfg, None, metrics, say)
        longest = max(st.max_tokens for st in resolve_stages(cfg))
        source = PromptSource(records, tokenizer, apply_chat_template=cfg.data.apply_chat_template,
                              max_prompt_tokens=cfg.model.max_model_len - longest, source_name="eval")
        return cls(cfg, source.all_items(), metrics, say)

    @property
    def running(self) -> bool:
        return self._version is not None

    def maybe_start(self, version: int, pool: ActorPool, stage: ResolvedStage, final: bool = False) -> bool:
        """Start evaluating `version` on the first actor when it is due; True if started."""
        due = self.items is not None and (final or version % self.cfg.every_steps == 0)
        if not due or self.running or version in self.done or not pool.ids:
            return False
        spec = SamplingSpec(self.cfg.temperature or stage.temperature, self.top_p, stage.max_tokens)
        prompts = [replace(p, prompt_id=f"eval{version}-{i}") for i, p in enumerate(self.items)]
        self._call = pool.evaluate(pool.ids[0], prompts, spec, self.cfg.n)
        self._version, self._t0 = version, time.monotonic()
        self.done.add(version)
        self._rewards, self._lengths, self._expected, self._tools = {}, [], 0, []
        return True

    def poll(self, rewards: RewardPool, tokenizer: Any, step: int) -> None:
        """Hand the samples of a finished generation to the reward pool."""
        if self._call is None or not self._call.done():
            return
        call, self._call = self._call, None
        try:
            samples = call.result()
        except ActorCallFailed as e:  # the actor died, or its engine failed the requests
            self.metrics.event(step, "eval_lost", version=self._version, reason=str(e)[:300])
            self.say(f"warning: the evaluation of step {self._version} was lost ({str(e)[:100]}); "
                     "training goes on")
            self._version = None
            return
        self._expected = len(samples)
        for s in samples:
            index = int(s.prompt_id.rsplit("-", 1)[1])
            text = tokenizer.decode(as_list(s.response_ids), skip_special_tokens=True)
            rewards.submit(EvalKey(index, len(s.response_ids), text, s.metadata, s.episode), text,
                           verifier_metadata(s.metadata, s.episode))

    def on_scored(self, key: EvalKey, reward: float) -> None:
        self._rewards.setdefault(key.prompt_index, []).append(reward)
        self._lengths.append(key.response_len)
        if (episode := key.episode) is not None:  # (called a tool, solved it with tools that all answered)
            called = episode.tool_calls > 0
            self._tools.append((called, called and not episode.tool_errors and reward > 0))
        if len(self._lengths) == self._expected:
            m = eval_metrics(list(self._rewards.values()), self.cfg.n, self.ks)
            self._ready = {"eval/step": self._version, "eval/time_s": time.monotonic() - self._t0,
                           "eval/response_len_mean": sum(self._lengths) / len(self._lengths),
                           **{f"eval/{k}": v for k, v in m.items()}}
            if self._tools:
                self._ready["eval/tool_call_rate"] = sum(c for c, _ in self._tools) / len(self._tools)
                self._ready["eval/tool_success_rate"] = sum(ok for _, ok in self._tools) / len(self._tools)
            self._version = None

    def take_metrics(self, step: int) -> dict[str, float]:
        """The metrics of the evaluation that completed since the last call (empty if none)."""
        out, self._ready = self._ready, {}
        if out:
            self.metrics.event(step, "eval", **out)
        return out

    def after_push(self, version: int, pool: ActorPool, stage: ResolvedStage, last: bool,
                   poll: Callable[[float], None]) -> None:
        """The actors hold `version` now: start its evaluation if due; after the last step,
        evaluate it whatever every_steps says and wait (`wait_final`)."""
        if last:
            self.wait_final(version, pool, stage, poll)
        else:
            self.maybe_start(version, pool, stage)

    def wait_final(self, version: int, pool: ActorPool, stage: ResolvedStage, poll: Callable[[float], None],
                   timeout_s: float = 600.0) -> None:
        """The running evaluation, then the final policy's, waited for while `poll(timeout_s)`
        keeps the run's rewards flowing (the actors have nothing else to do)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.running and not self.maybe_start(version, pool, stage, final=True):
                return
            poll(0.05)


def eval_summary(history: list[dict[str, Any]]) -> dict[str, Any]:
    """The first and last evaluation of a run's rows, for summary.json (empty without any)."""
    rows = [h for h in history if h.get("eval/step") is not None]
    if not rows:
        return {}
    key = next(k for k in rows[0] if k.startswith("eval/avg@"))
    out = {"eval_metric": key.removeprefix("eval/"),
           "eval_first": rows[0][key], "eval_first_step": rows[0]["eval/step"],
           "eval_last": rows[-1][key], "eval_last_step": rows[-1]["eval/step"]}
    if rows[0].get("eval/tool_success_rate") is not None:
        out.update(tool_success_first=rows[0]["eval/tool_success_rate"],
                   tool_success_last=rows[-1].get("eval/tool_success_rate"))
    return out


def format_eval_summary(s: dict[str, Any]) -> str:
    if "eval_metric" not in s:
        return ""
    tools = (f"; tool success {s['tool_success_first']:.3f} -> {s['tool_success_last']:.3f}"
             if s.get("tool_success_last") is not None else "")
    return (f"  held-out {s['eval_metric']}: {s['eval_first']:.3f} (policy of step {s['eval_first_step']}) -> "
            f"{s['eval_last']:.3f} (step {s['eval_last_step']}){tools}")
