"""Per-step accounting of what the orchestrator saw: rewards, lengths, staleness, throughput.

Pure bookkeeping; `flush` turns what accumulated since the last step into namespaced metrics.
Staleness is measured per trained token: lag = learner version that trains it - version that
generated it.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from collections import Counter
from typing import Any

from asyncrl.types import Sample, SequenceChunk


class StepStats:
    def __init__(self) -> None:
        self._t_last = time.monotonic()
        self._reset()
        self._seen: set[str] = set()  # every key a row has had: later rows carry them too
        self.total_samples = 0
        self.total_gen_tokens = 0

    def _reset(self) -> None:
        self.rewards: list[float] = []
        self.lengths: list[int] = []
        self.finish = Counter()
        self.outcomes = Counter()
        self.lags: list[int] = []
        self.shaping: dict[str, float] = {}
        self.by_source: dict[str, list[float]] = {}
        self.latencies: list[float] = []
        self.sandbox = Counter()

    _WINDOW = ("rewards", "lengths", "finish", "outcomes", "lags", "shaping", "by_source", "latencies", "sandbox")

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

    def add_sample(self, s: Sample, reward: float, info: dict[str, Any], latency_s: float = 0.0) -> None:
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
        self.total_samples += 1
        self.total_gen_tokens += len(s.response_ids)

    def add_batch(self, chunks: list[SequenceChunk], learner_version: int) -> None:
        for c in chunks:
            self.lags.extend(learner_version - v for v in c.versions)

    def flush(self, buffer, assembler, receiver) -> dict[str, Any]:
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
            "staleness/mean": sum(self.lags) / len(self.lags) if self.lags else 0.0,
            "staleness/max": max(self.lags) if self.lags else 0,
            "buffer/loss_tokens": buffer.num_loss_tokens,
            **{f"buffer/{k}": v for k, v in asdict(buffer.stats).items()},
            "buffer/groups_zero_variance": assembler.stats.groups_zero_variance,
            "buffer/groups_complete": assembler.stats.groups_complete,
            "buffer/duplicate_samples": assembler.stats.duplicates,
            "rollout/frames_dropped": receiver.num_dropped,
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
        # One schema for every row, so a column never vanishes from metrics.jsonl or a plot: a
        # key seen before is a count of 0, an outcome fraction of 0, or None (no samples: no mean).
        for key in self._seen - out.keys():
            counted = key.startswith("reward/sandbox_tests_") or (n and key.startswith("reward/outcome_"))
            out[key] = 0 if counted else None
        self._seen |= out.keys()
        self._t_last = now
        self._reset()
        return out
