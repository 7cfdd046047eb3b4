"""Step metrics to JSONL (always) and TensorBoard / W&B (when enabled).

Keys are namespaced (`reward/`, `loss/`, `entropy/`, `staleness/`, `buffer/`, `rollout/`,
`sync/`, `timing/`, `throughput/`), one JSON object per step in `<run_dir>/metrics.jsonl`, so a
run can be plotted or compared with nothing but the standard library.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsWriter:
    def __init__(self, run_dir: Path, tensorboard: bool = True, wandb_project: str | None = None,
                 run_name: str = "", config: dict | None = None):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._file = open(self.path, "a", encoding="utf-8")
        self._events = open(run_dir / "events.jsonl", "a", encoding="utf-8")
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
        """Keep only the rows up to `last_step` (a resumed run writes the later ones again)."""
        path = run_dir / "metrics.jsonl"
        if path.exists():
            rows = [line for line in path.read_text(encoding="utf-8").splitlines()
                    if line.strip() and json.loads(line)["step"] <= last_step]
            path.write_text("".join(r + "\n" for r in rows), encoding="utf-8")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        clean = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        record = {"step": step, **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                   for k, v in clean.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def event(self, step: int, kind: str, **fields: Any) -> None:
        """Rare things worth a line of their own (start, pushes that failed a probe, saves)."""
        self._events.write(json.dumps({"step": step, "event": kind, **fields}) + "\n")
        self._events.flush()

    def close(self) -> None:
        self._file.close()
        self._events.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
