"""Per-step accounting of what the orchestrator saw: rewards, lengths, staleness, throughput.

Pure bookkeeping; `flush` turns what accumulated since the last step into namespaced metrics.
A key ending in `_total` is a running total since the run started; every other key is a value of
the step window or a current one (a gauge, like `buffer/loss_tokens`).

Staleness is measured per trained token: lag = learner version that trains it - version that
generated it. It splits at the version the token's response entered training (the chunk's
`entered_at`: its rollout batch was sealed, or a streaming step first took a chunk of it), where
the staleness bound was checked:
    lag = (learner version - entered at) + (entered at - generation version)
            reuse lag (staleness/reuse_*)      asynchronous lag (staleness/async_*)
so staleness/async_max <= buffer.max_staleness, except under buffer.stale_policy ess, which admits
stale work up to buffer.ess_max_lag by design (buffer/tokens_beyond_bound_total counts it). The
reuse part is what N_SGD > 1 asks for (up to N_SGD - 1 with rollout batches) or, streaming, the
steps the rest of a response split at the Phi boundary follows its prefix by (usually 1).
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from typing import Any

from asyncrl.buffer.stale_policy import lag_counts
from asyncrl.types import EpisodeRecord, EpisodeStatus, Sample, SequenceChunk

# Info keys the reward router sets or reports elsewhere (outcome fractions, errors, shaping terms).
ROUTER_INFO = frozenset({"outcome", "verifier", "data_source", "error", "traceback", "shaping"})


def own_info(info: dict[str, Any], max_chars: int = 200) -> dict[str, Any]:
    """A verifier's info beyond what the router reports (a user function's own keys): kept with
    the example completions in samples.jsonl, and its numbers averaged as reward/info/<key>."""
    return {k: v for k, v in info.items()
            if k not in ROUTER_INFO and not k.startswith("tests_") and len(repr(v)) <= max_chars}


def _mean(counts: Counter[int]) -> float:
    n = counts.total()
    return sum(lag * k for lag, k in counts.items()) / n if n else 0.0


class StepStats:
    def __init__(self, examples_per_step: int = 4) -> None:
        self._t_last = time.monotonic()
        self._reset()
        self._seen: set[str] = set()  # every key a row has had: later rows carry them too
        self.total_samples = 0
        self.total_gen_tokens = 0
        self.examples_per_step = examples_per_step
        # a few completions to read next to the numbers, a uniform sample of the step's (reservoir
        # sampling: the first to finish are the short ones, and lengths drawn from samples.jsonl
        # must not lean short); not checkpointed (a resumed run's first step may show fewer)
        self._examples: list[dict[str, Any]] = []
        self._offered = 0  # completions offered this window
        self._slot: int | None = None  # where wants_example said the next one goes (-1: nowhere)
        self._rng = random.Random(0)

    def _reset(self) -> None:
        self.rewards: list[float] = []
        self.lengths: list[int] = []
        self.finish = Counter()
        self.outcomes = Counter()
        self.lags: Counter[int] = Counter()  # lag -> tokens: a step holds Phi of them
        self.async_lags: Counter[int] = Counter()
        self.reuse_lags: list[int] = []  # one per chunk: every token of a chunk has the same
        self.shaping: dict[str, float] = {}
        self.by_source: dict[str, list[float]] = {}
        self.latencies: list[float] = []
        self.sandbox = Counter()
        self.user_info: dict[str, list[float]] = {}  # key -> [sum, count]
        self.episodes = Counter()  # sums over multi-turn episodes (rollout/episode.py records)

    _WINDOW = ("rewards", "lengths", "finish", "outcomes", "lags", "async_lags", "reuse_lags", "shaping",
               "by_source", "latencies", "sandbox", "user_info", "episodes")

    def state_dict(self) -> dict[str, Any]:
        """Running totals, the row schema, and what accumulated since the last row (so the next
        row of a resumed run counts the samples scored before the checkpoint)."""
        window = {k: dict(v) if isinstance(v, Counter) else v for k, v in
                  ((k, getattr(self, k)) for k in self._WINDOW)}
        return {"total_samples": self.total_samples, "total_gen_tokens": self.total_gen_tokens,
                "seen": sorted(self._seen), "window": window}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total_samples, self.total_gen_tokens = state["total_samples"], state["total_gen_tokens"]
        self._seen = set(state["seen"])
        for k, v in state["window"].items():
            setattr(self, k, Counter(v) if isinstance(getattr(self, k), Counter) else v)

    def restart_clock(self) -> None:
        """The next row's window (its rates) starts now."""
        self._t_last = time.monotonic()

    def wants_example(self) -> bool:
        """Whether the next sample's completion is kept (decode its text only then): the n-th of
        the window replaces a random kept one with probability examples_per_step / n."""
        if self._slot is None:
            self._slot = self._draw_slot()
        return self._slot >= 0

    def _draw_slot(self) -> int:
        self._offered += 1
        if len(self._examples) < self.examples_per_step:
            return len(self._examples)
        j = self._rng.randrange(self._offered)
        return j if j < self.examples_per_step else -1

    def add_sample(self, s: Sample, reward: float, info: dict[str, Any], latency_s: float = 0.0,
                   completion: str | None = None, prompt: str | None = None,
                   turns: list[dict[str, str]] | None = None) -> None:
        """`completion` (and `prompt`): the texts, kept as an example if the draw of
        `wants_example` (made now, if it was not asked) says so; without them the sample is not
        offered as an example. `turns`: an episode's text turn by turn ({"origin", "text"})."""
        slot, self._slot = self._slot, None
        if completion is not None and (slot := self._draw_slot() if slot is None else slot) >= 0:
            example = {
                "prompt_id": s.prompt_id, "prompt": prompt, "response": completion,
                "response_tokens": len(s.response_ids), "reward": reward,
                "outcome": info.get("outcome"), "version": s.versions[0] if s.versions else None,
                "finish_reason": s.finish_reason, "data_source": s.metadata.get("data_source"),
                **({"info": extra} if (extra := own_info(info)) else {}),
                **({"turns": turns} if turns else {})}
            self._examples[slot:slot + 1] = [example]
        if s.episode is not None:
            self._add_episode(s.episode, s.num_loss_tokens)
        self.rewards.append(reward)
        self.by_source.setdefault(str(s.metadata.get("data_source", "unknown")), []).append(reward)
        self.latencies.append(latency_s)
        for key, k in info.items():  # the code verifier's per-test sandbox outcomes: tests_<status>
            if key.startswith("tests_") and key not in ("tests_total", "tests_run") and isinstance(k, int):
                self.sandbox[key.removeprefix("tests_")] += k
        self.lengths.append(len(s.response_ids))
        self.finish[s.finish_reason] += 1
        self.outcomes[info.get("outcome", "unknown")] += 1
        for k, v in info.get("shaping", {}).items():
            self.shaping[k] = self.shaping.get(k, 0.0) + v
        if str(info.get("verifier", "")).startswith("import:"):  # a user function's own numbers
            for k, v in own_info(info).items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    total = self.user_info.setdefault(k, [0.0, 0])
                    total[0], total[1] = total[0] + float(v), total[1] + 1
        self.total_samples += 1
        self.total_gen_tokens += len(s.response_ids)

    def add_batch(self, chunks: list[SequenceChunk], learner_version: int,
                  batch_start_version: int | None = None) -> None:
        """A step's chunks, trained by `learner_version`; `batch_start_version`: the version their
        rollout batch was first trained at (the buffer's `batch_start_version`; None: this step)."""
        default = learner_version if batch_start_version is None else batch_start_version
        for c in chunks:  # counted by runs of one version (a bisection each), not token by token
            start = default if c.entered_at is None else c.entered_at
            versions = c.versions if not c.loss_mask else [v for v, m in zip(c.versions, c.loss_mask) if m]
            lag_counts(versions, 0, len(versions), learner_version, into=self.lags)
            lag_counts(versions, 0, len(versions), start, into=self.async_lags)
            self.reuse_lags.append(learner_version - start)

    def _add_episode(self, record: EpisodeRecord, model_tokens: int) -> None:
        e = self.episodes
        e["episodes"] += 1
        e["errors"] += record.status is EpisodeStatus.FAILED
        e["model_tokens"] += model_tokens
        for key in ("turns", "tool_calls", "tool_errors", "env_s", "observation_tokens"):
            e[key] += getattr(record, key)

    def _episode_metrics(self) -> dict[str, float]:
        """Per step: turns, tool calls and errors, environment time, tokens by origin and the share
        of response tokens masked (an environment's), over the episodes scored in the window."""
        e, n = self.episodes, self.episodes["episodes"]
        tokens = e["model_tokens"] + e["observation_tokens"]
        return {"episode/turns_mean": e["turns"] / n, "episode/tool_calls_mean": e["tool_calls"] / n,
                "episode/tool_error_frac": e["tool_errors"] / e["tool_calls"] if e["tool_calls"] else 0.0,
                "episode/env_s_mean": e["env_s"] / n, "episode/error_frac": e["errors"] / n,
                "episode/model_tokens_mean": e["model_tokens"] / n,
                "episode/observation_tokens_mean": e["observation_tokens"] / n,
                "episode/masked_frac": e["observation_tokens"] / tokens if tokens else 0.0}

    def take_examples(self) -> list[dict[str, Any]]:
        """The example completions kept since the last call (at most `examples_per_step`)."""
        out, self._examples, self._offered = self._examples, [], 0
        return out

    def flush(self, pipeline: dict[str, Any]) -> dict[str, Any]:
        """The step's row of what accumulated since the last one; `pipeline`: the current gauges
        and counters of the buffer and the stream (the ledger's `token_metrics` and the like)."""
        now = time.monotonic()
        dt = max(now - self._t_last, 1e-9)
        n = len(self.rewards)
        out: dict[str, Any] = {
            "reward/mean": sum(self.rewards) / n if n else None,
            "reward/num_samples": n,
            "rollout/response_len_mean": sum(self.lengths) / n if n else None,
            "rollout/truncated_frac": self.finish["length"] / n if n else None,
            "rollout/samples_total": self.total_samples,
            "throughput/gen_tokens_per_s": sum(self.lengths) / dt,
            "throughput/samples_per_s": n / dt,
            "staleness/mean": _mean(self.lags),
            "staleness/max": max(self.lags, default=0),
            "staleness/async_mean": _mean(self.async_lags),
            "staleness/async_max": max(self.async_lags, default=0),
            "staleness/reuse_max": max(self.reuse_lags) if self.reuse_lags else 0,
            **pipeline,
            "timing/step_wall_s": dt,
        }
        for key, total in self.shaping.items():
            out[key] = total / n if n else None
        for outcome, k in self.outcomes.items():
            out[f"reward/outcome_{outcome}"] = k / n
        for source, values in self.by_source.items():
            out[f"reward/by_source/{source}"] = sum(values) / len(values)
        if self.latencies:
            out["reward/latency_mean_s"] = sum(self.latencies) / len(self.latencies)
            out["reward/latency_max_s"] = max(self.latencies)
        for status, k in self.sandbox.items():
            out[f"reward/sandbox_tests_{status}"] = k
        for key, (total, k) in self.user_info.items():
            out[f"reward/info/{key}"] = total / k
        if self.episodes["episodes"]:
            out.update(self._episode_metrics())
        # One schema for every row, so a column never vanishes from metrics.jsonl or a plot: a
        # key seen before is a count of 0, an outcome fraction of 0, or None (no samples: no mean).
        for key in self._seen - out.keys():
            counted = key.startswith("reward/sandbox_tests_") or (n and key.startswith("reward/outcome_"))
            out[key] = 0 if counted else None
        self._seen |= out.keys()
        self._t_last = now
        self._reset()
        return out
