"""The live progress display: step, reward, entropy, staleness, tokens/s, held-out avg@n, elapsed time.

On a terminal it is one refreshing panel (rich); without one (CI, `ray job submit` logs) it
prints a plain line every few seconds so logs stay readable.
"""

from __future__ import annotations

import sys
import time
from typing import Any

FIELDS = [
    ("step", "step", "{:d}"),
    ("reward/mean", "reward", "{:.3f}"),
    ("entropy/learner", "entropy", "{:.3f}"),
    ("staleness/mean", "stale", "{:.2f}"),
    ("staleness/max", "stale max", "{:d}"),
    ("throughput/gen_tokens_per_s", "gen tok/s", "{:,.0f}"),
    ("loss/policy", "pg loss", "{:+.4f}"),
    ("buffer/loss_tokens", "buffered", "{:d}"),
    ("eval/avg@n", "held-out", "{:.3f}"),  # the latest evaluation, shown until the next
]
EVAL_KEY = "eval/avg@n"


def _fmt(fmt: str, v: Any) -> str:
    try:
        return fmt.format(int(v) if fmt.endswith("d}") else v)
    except (TypeError, ValueError):
        return "-"


class ProgressDisplay:
    def __init__(self, total_steps: int, mode: str = "live", line_every_s: float = 5.0):
        self.total = total_steps
        self.t0 = time.monotonic()
        self.mode = "lines" if mode == "live" and not sys.stdout.isatty() else mode
        self.line_every_s = line_every_s
        self._last_line = 0.0
        self._last_eval = None
        self._live = None
        if self.mode == "live":
            from rich.live import Live

            self._live = Live(self._table({}), refresh_per_second=4, transient=False)
            self._live.start()

    def _table(self, m: dict[str, Any]):
        from rich.table import Table

        elapsed = time.monotonic() - self.t0
        t = Table(title=f"asyncrl  {m.get('step', 0)}/{self.total} steps  {elapsed:,.0f}s", expand=False)
        for _, label, _ in FIELDS:
            t.add_column(label, justify="right")
        t.add_row(*[_fmt(fmt, m.get(key)) for key, _, fmt in FIELDS])
        return t

    def update(self, metrics: dict[str, Any]) -> None:
        if self.mode == "off":
            return
        for key, value in metrics.items():
            if key.startswith("eval/avg@"):
                self._last_eval = value
        metrics = {**metrics, EVAL_KEY: self._last_eval}
        if self._live is not None:
            self._live.update(self._table(metrics))
            return
        now = time.monotonic()
        if now - self._last_line >= self.line_every_s or metrics.get("step") == self.total:
            self._last_line = now
            parts = [f"{label}={_fmt(fmt, metrics.get(key))}" for key, label, fmt in FIELDS]
            print(f"[{now - self.t0:7.1f}s] " + "  ".join(parts), flush=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
