"""Where each reward the pool returns goes: an eval sample's to the evaluator; a training
sample's to the group ledger (shaping, groups, the buffer), the step's statistics and the stage's
pass rates. Every reward passes the error monitor first, so a verifier that raises is reported
with its traceback (console and events.jsonl) and stops the run past reward.max_error_frac.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncrl.observe.metrics import EventLog, Say
from asyncrl.orchestrator.evaluation import EvalKey, Evaluator
from asyncrl.orchestrator.ledger import GroupLedger
from asyncrl.orchestrator.step_stats import StepStats
from asyncrl.reward.errors import ENV_OUTCOMES, RewardErrorMonitor, format_report
from asyncrl.reward.pool import RewardResult
from asyncrl.types import IntSeq, Sample, as_list

if TYPE_CHECKING:  # it loads a tokenizer, and the router only records pass rates in it
    from asyncrl.orchestrator.stage_runner import StageRunner


class ResultRouter:
    def __init__(self, ledger: GroupLedger, stats: StepStats, stages: StageRunner, evaluator: Evaluator, tokenizer: Any,
                 errors: RewardErrorMonitor, metrics: EventLog, say: Say = print,
                 env_errors: RewardErrorMonitor | None = None):
        self.ledger, self.stats, self.stages, self.evaluator = ledger, stats, stages, evaluator
        self.tokenizer, self.errors, self.metrics, self.say = tokenizer, errors, metrics, say
        self.env_errors = env_errors
        """Episodes' environment errors (rollout/episode.py), when the run has an environment."""

    def __call__(self, results: list[RewardResult], step: int) -> None:
        for r in results:
            is_eval = isinstance(r.key, EvalKey)
            # an episode's environment error is its own kind: reported as one, and counted
            # against env.max_error_frac over episodes, not against the verifiers' fraction
            monitor = self.env_errors if self.env_errors is not None and r.info.get("outcome") in ENV_OUTCOMES \
                else self.errors
            if r.info.get("outcome") in monitor.outcomes:
                response = r.key.response if is_eval else self._text(r.key.response_ids)
                self._report(monitor.observe(r.info, response, r.key.metadata), step, monitor.event)
            else:
                self.errors.observe(r.info, "", {})
            if self.env_errors is not None and monitor is self.errors:
                self.env_errors.observe(r.info, "", {})
            if is_eval:
                self.evaluator.on_scored(r.key, r.reward)
            elif self.ledger.on_scored(r.key, r.reward, r.info) is not None:  # else: a group given up
                example = self.stats.wants_example()  # decode the texts only for the few kept
                self.stats.add_sample(r.key, r.reward, r.info, r.latency_s,
                                      completion=self._text(r.key.response_ids) if example else None,
                                      prompt=self._text(r.key.prompt_ids) if example else None,
                                      turns=self._turns(r.key) if example else None)
                self.stages.record(r.key.metadata, r.reward)

    def _turns(self, s: Sample) -> list[dict[str, str]] | None:
        """An episode's response turn by turn: what the model wrote, what the environment answered."""
        if s.episode is None:
            return None
        return [{"origin": origin, "text": self._text(s.response_ids[a:b])} for a, b, origin in s.episode.spans]

    def _text(self, token_ids: IntSeq) -> str:
        return self.tokenizer.decode(as_list(token_ids), skip_special_tokens=True)

    def _report(self, report: dict[str, Any] | None, step: int, event: str = "reward_error") -> None:
        if report is not None:
            self.metrics.event(step, event, **report)
            self.say(format_report(report))
