"""Reading run directories: metrics.jsonl (one row per step), events.jsonl (start, checkpoints,
resets, ... and last `end`), config.yaml (the resolved config), eval.json when `asyncrl evaluate`
has evaluated the run's saved policies (asyncrl/lab/offline/run_policies.py). Only the standard library and
PyYAML, so a finished run can be analysed anywhere, also while another is still writing (a half
written last line is skipped)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from asyncrl.lab.analysis.curves import Series

RunStatus = Literal["new", "finished", "interrupted", "failed", "unfinished"]


def read_jsonl(path: Path) -> list[dict]:
    """The complete JSON lines of a file ([] when it does not exist)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # the line a running process is writing
            continue
    return out


def status_of(events: list[dict]) -> RunStatus:
    """new: nothing written; finished / interrupted / failed: the last `end` event says so;
    unfinished: started but no `end` (still running, or killed without a chance to write it)."""
    if not events:
        return "new"
    last_end = max((i for i, e in enumerate(events) if e.get("event") == "end"), default=-1)
    last_start = max((i for i, e in enumerate(events) if e.get("event") in ("start", "resume")), default=-1)
    if last_end < 0 or last_end < last_start:  # a resumed attempt started after the last end has not ended
        return "unfinished"
    return events[last_end].get("status", "failed")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


ELAPSED = "elapsed"
"""An x axis of its own: seconds since the run started (its first `start` event, else its first
row), per step. A row's `time` is Unix time, so runs started apart would be drawn apart."""


def series_of(rows: list[dict], metric: str) -> Series:
    """The metric per step; rows without it (or with null / non-finite values) are skipped, and a
    step logged twice keeps its last row.

    An `eval/` metric stands at the step of the policy it measured (the row's `eval/step`), not at
    the step whose row it landed in: an evaluation finishes some steps after it started, a number
    that differs between seeds, so only the policy's step lines seeds (and checkpoints) up."""
    x_key = "eval/step" if metric.startswith("eval/") and metric != "eval/step" else "step"
    by_step: dict[float, float] = {}
    for r in rows:
        v, x = r.get(metric), r.get(x_key, r.get("step"))
        if _number(v) and _number(x):
            by_step[x] = float(v)
    steps = sorted(by_step)
    return Series(tuple(float(s) for s in steps), tuple(by_step[s] for s in steps))


def config_value(config: dict, dotted: str) -> Any:
    """`a.b.c` of a config tree (None when a part is missing)."""
    node: Any = config
    for part in dotted.split("."):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
    return node


@dataclass(frozen=True)
class RunRecord:
    """What a run directory holds, read once."""

    path: Path
    rows: list[dict]
    events: list[dict]
    config: dict
    evaluation: dict | None = None
    """eval.json (None: the run's policies were not evaluated offline)."""

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def status(self) -> RunStatus:
        return status_of(self.events)

    def series(self, metric: str) -> Series:
        if metric == ELAPSED:
            starts = [e["time"] for e in self.events if e.get("event") == "start" and _number(e.get("time"))]
            times = [r["time"] for r in self.rows if _number(r.get("time"))]
            t0 = min(starts) if starts else min(times, default=0.0)
            return series_of([{"step": r.get("step"), ELAPSED: r["time"] - t0} for r in self.rows
                              if _number(r.get("time"))], ELAPSED)
        return series_of(self.rows, metric)

    def has_checkpoint(self) -> bool:
        return any((d / "COMPLETE").exists() for d in (self.path / "checkpoints").glob("step_*"))


def read_run(path: str | Path) -> RunRecord:
    path = Path(path)
    cfg_file = path / "config.yaml"
    config = yaml.safe_load(cfg_file.read_text()) if cfg_file.exists() else {}
    evaluation = path / "eval.json"
    return RunRecord(path, read_jsonl(path / "metrics.jsonl"), read_jsonl(path / "events.jsonl"), config or {},
                     json.loads(evaluation.read_text()) if evaluation.is_file() else None)
