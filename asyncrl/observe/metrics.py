"""Step metrics to JSONL (always) and TensorBoard / W&B (when enabled).

Keys are namespaced (`reward/`, `loss/`, `entropy/`, `staleness/`, `buffer/`, `rollout/`,
`sync/`, `timing/`, `throughput/`), one JSON object per step in `<run_dir>/metrics.jsonl`, so a
run can be plotted or compared with nothing but the standard library. A key ending in `_total` is
a running total since the run started; any other is a value of the step or a current one. Each
row and event carries `time` (Unix seconds), so rows line up with logs and with other runs.

`<run_dir>/samples.jsonl` holds a few completions per step (and TensorBoard a table of them), to
read what the policy writes next to the numbers that score it.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any, Protocol


class EventLog(Protocol):
    """Where a component reports the run's events (`MetricsWriter` is the real one)."""

    def event(self, step: int, kind: str, **fields: Any) -> None: ...


Say = Callable[[str], None]
"""A line for the person running the run (the console)."""


class MetricsWriter:
    def __init__(self, run_dir: Path, tensorboard: bool = True, wandb_project: str | None = None,
                 run_name: str = "", config: dict | None = None):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._file = open(self.path, "a", encoding="utf-8")
        self._events = open(run_dir / "events.jsonl", "a", encoding="utf-8")
        self._samples = open(run_dir / "samples.jsonl", "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self._wandb = None
        if wandb_project:
            import wandb

            self._wandb = wandb.init(project=wandb_project, name=run_name, config=config)

    @staticmethod
    def truncate(run_dir: Path, last_step: int) -> None:
        """Keep only the rows (and sample lines) up to `last_step`: a resumed run writes the later
        ones again. Events stay: they are what happened, the interrupted attempt included."""
        for name in ("metrics.jsonl", "samples.jsonl"):
            path = run_dir / name
            if path.exists():
                rows = [line for line in path.read_text(encoding="utf-8").splitlines()
                        if line.strip() and json.loads(line)["step"] <= last_step]
                path.write_text("".join(r + "\n" for r in rows), encoding="utf-8")

    def rewind(self, last_step: int) -> None:
        """`truncate` while the run writes: its rows after `last_step` are trained again (a learner
        restarted from a checkpoint). The files are appended to, so writes go on at the new end."""
        self._file.flush()
        self._samples.flush()
        self.truncate(self.path.parent, last_step)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        clean = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        finite = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in clean.items()}
        record = {"step": step, "time": time.time(), **finite}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def event(self, step: int, kind: str, **fields: Any) -> None:
        """Rare things worth a line of their own (start, pushes that failed a probe, saves)."""
        self._events.write(json.dumps({"step": step, "time": time.time(), "event": kind, **fields}) + "\n")
        self._events.flush()

    def log_samples(self, step: int, examples: list[dict[str, Any]]) -> None:
        """A few of the step's completions (StepStats.take_examples): one line each in
        samples.jsonl, and one table in TensorBoard's text tab."""
        if not examples:
            return
        now = time.time()
        for e in examples:
            self._samples.write(json.dumps({"step": step, "time": now, **e}) + "\n")
        self._samples.flush()
        if self._tb is not None:
            self._tb.add_text("samples", samples_table(examples), step)

    def close(self) -> None:
        self._file.close()
        self._events.close()
        self._samples.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


_COLUMNS = ("prompt_id", "data_source", "version", "reward", "outcome", "finish_reason", "prompt", "response")


def samples_table(examples: list[dict[str, Any]]) -> str:
    """A markdown table, one row per example; a cell's `|` and line breaks are escaped (a raw one
    would end the cell or the row)."""
    def cell(v: Any) -> str:
        return str(v).replace("\\", "\\\\").replace("|", "\\|").replace("\r\n", "<br>").replace("\n", "<br>")

    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(cell(e.get(c)) for c in _COLUMNS) + " |" for e in examples]
    return "\n".join(lines)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
